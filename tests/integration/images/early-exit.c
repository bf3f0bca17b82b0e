/* A stand-in for an agent that fails early: as /init of a test initramfs it says why on the
 * console and exits, which the guest kernel reports as a panic. Built with EXIT_AFTER_SECONDS
 * defined, it waits that long after its line first, so a test can act on the host meanwhile. */
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

int main(void) {
    static const char msg[] = "bulkhead-agent: fatal: simulated early exit before serving\n";
    int fd = open("/dev/console", O_WRONLY);
    if (fd >= 0) write(fd, msg, strlen(msg));
#ifdef EXIT_AFTER_SECONDS
    sleep(EXIT_AFTER_SECONDS);
#endif
    return 3;
}
