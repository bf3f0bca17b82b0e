/* A fork bomb that keeps score. Every bomb process forks as fast as it can, forever, and so does
 * each child; nothing exits. The counts of forks made and refused live in shared memory, and the
 * first process, which stays out of the bomb, prints them once a second:
 *   forked=<forks that succeeded> eagain=<refused with EAGAIN> other=<refused otherwise>
 * SIGTERM ends the reporter; as its container's PID 1 it takes the whole bomb with it. */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

struct score {
    atomic_long forked, eagain, other;
};

static void on_term(int sig) {
    (void)sig;
    _exit(0);
}

static void bomb(struct score *s) {
    for (;;) {
        pid_t pid = fork();
        if (pid > 0)
            atomic_fetch_add(&s->forked, 1);
        else if (pid < 0)
            atomic_fetch_add(errno == EAGAIN ? &s->eagain : &s->other, 1);
        /* pid == 0: the child goes on bombing. */
    }
}

int main(void) {
    struct score *s = mmap(NULL, sizeof *s, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    signal(SIGTERM, on_term);
    setvbuf(stdout, NULL, _IOLBF, 0);
    pid_t first = fork();
    if (first < 0) {
        perror("fork");
        return 1;
    }
    if (first == 0) {
        signal(SIGTERM, SIG_DFL);
        bomb(s);
    }
    atomic_fetch_add(&s->forked, 1);
    for (;;) {
        sleep(1);
        printf("forked=%ld eagain=%ld other=%ld\n", atomic_load(&s->forked), atomic_load(&s->eagain),
               atomic_load(&s->other));
    }
}
