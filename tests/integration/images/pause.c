/* A minimal pod "pause" process: holds the pod's namespaces, reaps zombies, and
 * exits on SIGINT/SIGTERM. Built statically by the harness, since no registry is
 * reachable to pull the upstream image. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }

static void on_chld(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction term = {0}, chld = {0};
    term.sa_handler = on_term;
    chld.sa_handler = on_chld;
    chld.sa_flags = SA_NOCLDSTOP;
    if (sigaction(SIGINT, &term, NULL) < 0 || sigaction(SIGTERM, &term, NULL) < 0 ||
        sigaction(SIGCHLD, &chld, NULL) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
