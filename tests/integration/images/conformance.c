/* bulkhead-conformance: the kernel facilities ordinary programs take for granted, tried for real
 * from inside a container. Prints "ok <name>" or "FAIL <name>: <why>" per check and exits 1 if any
 * failed. Built static by the test harness (tests/integration/src/images.rs) into the busybox
 * test image as /bin/bulkhead-conformance. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <mqueue.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MQUEUE_MAGIC 0x19800202
#define TMPFS_MAGIC 0x01021994

static int failed;

static void report(const char *name, const char *why) {
    if (why) {
        printf("FAIL %s: %s (%s)\n", name, why, strerror(errno));
        failed = 1;
    } else {
        printf("ok %s\n", name);
    }
}

static const char *check_flock(void) {
    int a = open("/tmp/bulkhead-lock", O_CREAT | O_RDWR, 0600);
    int b = open("/tmp/bulkhead-lock", O_RDWR);
    if (a < 0 || b < 0) return "open";
    if (flock(a, LOCK_EX | LOCK_NB) != 0) return "flock";
    if (flock(b, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK) return "a second flock was not refused";
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    if (fcntl(a, F_OFD_SETLK, &fl) != 0) return "fcntl F_OFD_SETLK";
    if (fcntl(b, F_OFD_SETLK, &fl) == 0 || errno != EAGAIN) return "a second record lock was not refused";
    close(a);
    close(b);
    unlink("/tmp/bulkhead-lock");
    return NULL;
}

static const char *check_sysv_shm(void) {
    int id = shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0600);
    if (id < 0) return "shmget";
    char *p = shmat(id, NULL, 0);
    if (p == (void *)-1) return "shmat";
    strcpy(p, "shared");
    /* Removed while attached: with kernel.shm_rmid_forced=1 the last detach would remove it. */
    if (shmctl(id, IPC_RMID, NULL) != 0) return "shmctl IPC_RMID";
    if (shmdt(p) != 0) return "shmdt";
    return NULL;
}

static const char *check_sysv_msg(void) {
    struct { long type; char text[8]; } out = {1, "hello"}, in = {0};
    int id = msgget(IPC_PRIVATE, IPC_CREAT | 0600);
    if (id < 0) return "msgget";
    if (msgsnd(id, &out, sizeof out.text, 0) != 0) return "msgsnd";
    if (msgrcv(id, &in, sizeof in.text, 1, IPC_NOWAIT) < 0 || strcmp(in.text, "hello") != 0) return "msgrcv";
    if (msgctl(id, IPC_RMID, NULL) != 0) return "msgctl IPC_RMID";
    return NULL;
}

static const char *check_sysv_sem(void) {
    int id = semget(IPC_PRIVATE, 1, IPC_CREAT | 0600);
    if (id < 0) return "semget";
    struct sembuf up = {0, 1, 0}, down = {0, -1, IPC_NOWAIT};
    if (semop(id, &up, 1) != 0 || semop(id, &down, 1) != 0) return "semop";
    if (semctl(id, 0, IPC_RMID) != 0) return "semctl IPC_RMID";
    return NULL;
}

static const char *check_posix_mq(void) {
    struct statfs fs;
    if (statfs("/dev/mqueue", &fs) != 0 || fs.f_type != MQUEUE_MAGIC) return "/dev/mqueue is not an mqueue mount";
    struct mq_attr attr = {.mq_maxmsg = 4, .mq_msgsize = 16};
    mqd_t q = mq_open("/bulkhead-conformance", O_CREAT | O_RDWR, 0600, &attr);
    if (q == (mqd_t)-1) return "mq_open";
    char buf[16] = {0};
    if (mq_send(q, "hello", 6, 0) != 0) return "mq_send";
    if (mq_receive(q, buf, sizeof buf, NULL) != 6 || strcmp(buf, "hello") != 0) return "mq_receive";
    mq_close(q);
    if (mq_unlink("/bulkhead-conformance") != 0) return "mq_unlink";
    return NULL;
}

static const char *check_inotify(void) {
    int fd = inotify_init1(IN_NONBLOCK);
    if (fd < 0) return "inotify_init1";
    mkdir("/tmp/bulkhead-watch", 0700);
    if (inotify_add_watch(fd, "/tmp/bulkhead-watch", IN_CREATE) < 0) return "inotify_add_watch";
    int f = open("/tmp/bulkhead-watch/new", O_CREAT | O_WRONLY, 0600);
    if (f < 0) return "create a watched file";
    close(f);
    char buf[4096];
    if (read(fd, buf, sizeof buf) <= 0) return "no inotify event";
    close(fd);
    return NULL;
}

static const char *check_dev_shm(void) {
    struct statfs fs;
    if (statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC) return "/dev/shm is not a tmpfs";
    int fd = shm_open("/bulkhead-conformance", O_CREAT | O_RDWR, 0600);
    if (fd < 0) return "shm_open";
    if (ftruncate(fd, 4096) != 0) return "ftruncate";
    char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return "mmap";
    strcpy(p, "shared");
    munmap(p, 4096);
    close(fd);
    if (shm_unlink("/bulkhead-conformance") != 0) return "shm_unlink";
    return NULL;
}

static const char *check_madvise(void) {
    char *p = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return "mmap";
    p[0] = 1;
    if (madvise(p, 1 << 20, MADV_DONTNEED) != 0) return "madvise";
    if (posix_fadvise(0, 0, 0, POSIX_FADV_NORMAL) == ENOSYS) return "fadvise";
    munmap(p, 1 << 20);
    return NULL;
}

static const char *check_membarrier(void) {
    /* MEMBARRIER_CMD_QUERY */
    if (syscall(SYS_membarrier, 0, 0) < 0) return "membarrier";
    return NULL;
}

int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    report("flock", check_flock());
    report("sysv_shm", check_sysv_shm());
    report("sysv_msg", check_sysv_msg());
    report("sysv_sem", check_sysv_sem());
    report("posix_mq", check_posix_mq());
    report("inotify", check_inotify());
    report("dev_shm", check_dev_shm());
    report("madvise", check_madvise());
    report("membarrier", check_membarrier());
    return failed;
}
