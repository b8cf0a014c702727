/* Native baselines for the bench: copies, process_vm_writev, a tcp stream and
 * tcp round trips, eventfd wake-ups, with the timing loops in C. See baselines.h.
 *
 * Children are fork()ed and do nothing but system calls until _exit(), so
 * forking from the (multi-threaded) Python process is safe; each one dies
 * with its parent (PR_SET_PDEATHSIG) and is reaped before a call returns. */
#define _GNU_SOURCE
#include "baselines.h"
#include "core/stream.h"
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_BATCHES 1024
#define MIN_BATCHES 5
#define RTT_WARMUP 200
#define RTT_MAX_SAMPLES (1u << 20)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define HUGE_PAGE (2u << 20)

static uint64_t map_len(uint64_t size) { return (size + HUGE_PAGE - 1) & ~(uint64_t)(HUGE_PAGE - 1); }

/* A mapping of `size` bytes (rounded up to 2 MiB, 2 MiB-aligned, transparent
 * huge pages asked for: the best case a page table gives a copy, as numpy's
 * large arrays get), every page faulted in. Only system calls and memset:
 * usable in a forked child. */
static void *map_buf(uint64_t size, int fill)
{
    uint64_t len = map_len(size);
    uint8_t *p = mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    uint8_t *a = (uint8_t *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (a > p)
        munmap(p, (size_t)(a - p));
    if (p + len + HUGE_PAGE > a + len)
        munmap(a + len, (size_t)(p + len + HUGE_PAGE - (a + len)));
    madvise(a, len, MADV_HUGEPAGE); /* advice: without THP, plain pages */
    memset(a, fill, len);           /* every page faulted in before anything is timed */
    return a;
}

/* The same from a memfd (MAP_SHARED): its pages are shmem's. */
static void *map_memfd(uint64_t size, int fill)
{
    uint64_t len = map_len(size);
    int fd = memfd_create("aiohixl-bench", MFD_CLOEXEC);
    if (fd < 0)
        return NULL;
    void *p = ftruncate(fd, (off_t)len) == 0 ? mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                                             : MAP_FAILED;
    int e = errno;
    close(fd); /* the mapping keeps the file */
    if (p == MAP_FAILED) {
        errno = e;
        return NULL;
    }
    madvise(p, len, MADV_HUGEPAGE); /* advice: refused where shmem_enabled says never */
    memset(p, fill, len);
    return p;
}

static void unmap_buf(void *p, uint64_t size)
{
    if (p)
        munmap(p, map_len(size));
}

/* ---------- children ---------- */

/* fork() a child that dies with us; in the child, only system calls follow. */
static pid_t fork_child(void)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        signal(SIGINT, SIG_IGN); /* ^C is for the bench; the child ends when it does */
    }
    return pid;
}

/* 0 if the child exited cleanly. */
static int reap(pid_t pid)
{
    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR)
            return -1;
    }
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

static int listen_loopback(uint16_t *port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 1) < 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &len) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    *port = ntohs(sa.sin_port);
    return fd;
}

static int connect_loopback(uint16_t port)
{
    struct sockaddr_in sa = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static void nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* All of buf, or -1. With spin, polls (MSG_DONTWAIT + sched_yield). */
static int send_all(int fd, const void *buf, size_t len, int spin)
{
    const char *p = buf;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL | (spin ? MSG_DONTWAIT : 0));
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n < 0 && errno == EAGAIN && spin) {
            sched_yield();
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            return -1;
        }
    }
    return 0;
}

/* All of len bytes, 0 at a clean end of stream before any, or -1. */
static int recv_all(int fd, void *buf, size_t len, int spin)
{
    char *p = buf;
    size_t got = 0;
    while (got < len) {
        ssize_t n = recv(fd, p + got, len - got, spin ? MSG_DONTWAIT : 0);
        if (n > 0) {
            got += (size_t)n;
        } else if (n == 0) {
            if (got == 0)
                return 0;
            errno = EPIPE;
            return -1;
        } else if (errno == EAGAIN && spin) {
            sched_yield();
        } else if (errno != EINTR) {
            return -1;
        }
    }
    return 1;
}

/* ---------- copies: memcpy and process_vm_writev ---------- */

enum { KIND_MEMCPY, KIND_STREAM, KIND_PVW };

typedef struct copier {
    int kind;
    pid_t pid;    /* KIND_PVW: the process that holds dst */
    uint8_t *dst; /* KIND_PVW: an address in that process */
    const uint8_t *src;
    uint64_t size, piece;
    int pieces;
    uint64_t iters; /* copies in the next batch */
    int stop;
    int ready; /* the barriers are set up: workers may start */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    pthread_barrier_t go, step;
    atomic_int err;
} copier;

typedef struct {
    copier *c;
    int index;
} worker_arg;

static void copy_piece(copier *c, int k)
{
    uint64_t off = (uint64_t)k * c->piece;
    uint64_t len = c->size - off < c->piece ? c->size - off : c->piece;
    if (c->kind != KIND_PVW) {
        if (c->kind == KIND_STREAM)
            hx_copy_stream(c->dst + off, c->src + off, len);
        else
            memcpy(c->dst + off, c->src + off, len);
        /* The copy is an observable effect: it cannot be elided. */
        __asm__ __volatile__("" : : "r"(c->dst) : "memory");
        return;
    }
    while (len) {
        struct iovec local = {(void *)(c->src + off), len};
        struct iovec remote = {c->dst + off, len};
        ssize_t n = process_vm_writev(c->pid, &local, 1, &remote, 1, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            atomic_store(&c->err, n < 0 ? errno : EIO);
            return;
        }
        off += (uint64_t)n;
        len -= (uint64_t)n;
    }
}

static void *copy_worker(void *p)
{
    worker_arg *w = p;
    copier *c = w->c;
    pthread_mutex_lock(&c->lock);
    while (!c->ready)
        pthread_cond_wait(&c->cond, &c->lock);
    pthread_mutex_unlock(&c->lock);
    if (c->stop)
        return NULL; /* not all threads started: nothing is measured */
    for (;;) {
        pthread_barrier_wait(&c->go);
        if (c->stop)
            return NULL;
        /* Read once: the caller sets the next batch's count as soon as it
         * leaves this batch's last barrier. */
        uint64_t iters = c->iters;
        for (uint64_t i = 0; i < iters; i++) {
            copy_piece(c, w->index);
            pthread_barrier_wait(&c->step);
        }
    }
}

/* Seconds for `iters` whole copies, the clock read only around them. */
static double copy_batch(copier *c, uint64_t iters)
{
    c->iters = iters;
    /* The clock starts before the other threads are let go, as a put's does
     * before it wakes the pool. Read after the barrier, it started late
     * whenever this thread was not the first back on a CPU: with 3 threads on
     * 2 vCPUs the other two had copied their shares by then, and a batch of
     * one or two 64 MiB copies timed one share's time for the whole copy (up
     * to 3x the rate; docs/bench-history.md, "Rows 4, 5: the x3 limits' clock"). */
    double t0 = now();
    if (c->pieces > 1)
        pthread_barrier_wait(&c->go);
    for (uint64_t i = 0; i < iters; i++) {
        copy_piece(c, 0);
        if (c->pieces > 1)
            pthread_barrier_wait(&c->step); /* the copy is done when its last piece is */
    }
    return now() - t0;
}

static void copy_measure(copier *c, double seconds, hb_copy_result *out)
{
    double rate[MAX_BATCHES];
    uint64_t iters = 1;
    double t;

    copy_batch(c, 2); /* warm: caches, TLB, the threads' first wake-up */
    /* Grow the batch until it is long enough to time, then size it to about
     * a tenth of the measurement (1-20 ms). */
    while ((t = copy_batch(c, iters)) < 1e-3 && iters < (1ull << 40))
        iters *= 4;
    double target = seconds / 10;
    target = target < 1e-3 ? 1e-3 : target > 20e-3 ? 20e-3 : target;
    double scaled = (double)iters * target / (t > 0 ? t : 1e-9);
    iters = scaled < 1 ? 1 : (uint64_t)scaled;

    int n = 0;
    double total = 0;
    while (n < MAX_BATCHES && (total < seconds || n < MIN_BATCHES)) {
        t = copy_batch(c, iters);
        total += t;
        rate[n++] = (double)iters * (double)c->size / t / 1e9;
        out->copies += iters;
    }
    qsort(rate, (size_t)n, sizeof rate[0], cmp_double);
    out->gbps = n % 2 ? rate[n / 2] : (rate[n / 2 - 1] + rate[n / 2]) / 2;
    out->best_gbps = rate[n - 1];
    out->seconds = total;
}

/* Cut as _native/copy.c's hx_copy_post cuts: one share per thread, at least
 * min_piece, rounded up to 4 KiB. */
static void copy_cut(copier *c, int threads, uint64_t min_piece)
{
    uint64_t piece = c->size / (uint64_t)(threads > 0 ? threads : 1) + 1;
    if (piece < min_piece)
        piece = min_piece;
    piece = (piece + 4095) & ~(uint64_t)4095;
    c->piece = piece;
    c->pieces = (int)((c->size + piece - 1) / piece);
}

static void copy_open_gate(copier *c)
{
    pthread_mutex_lock(&c->lock);
    c->ready = 1;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

static int copy_run(copier *c, double seconds, hb_copy_result *out)
{
    pthread_t tids[64];
    worker_arg args[64];
    int started = 1;
    atomic_init(&c->err, 0);
    if (c->pieces > 64)
        c->pieces = 64;
    out->pieces = c->pieces;
    if (c->pieces > 1) {
        pthread_mutex_init(&c->lock, NULL);
        pthread_cond_init(&c->cond, NULL);
        for (; started < c->pieces; started++) {
            args[started] = (worker_arg){c, started};
            int e = pthread_create(&tids[started], NULL, copy_worker, &args[started]);
            if (e) {
                out->err = e;
                out->where = "pthread_create";
                c->stop = 1;
                break;
            }
        }
        if (!c->stop) {
            pthread_barrier_init(&c->go, NULL, (unsigned)c->pieces);
            pthread_barrier_init(&c->step, NULL, (unsigned)c->pieces);
        }
        copy_open_gate(c);
        if (c->stop) {
            for (int i = 1; i < started; i++)
                pthread_join(tids[i], NULL);
            pthread_cond_destroy(&c->cond);
            pthread_mutex_destroy(&c->lock);
            errno = out->err;
            return -1;
        }
    }
    copy_measure(c, seconds, out);
    if (c->pieces > 1) {
        c->stop = 1;
        pthread_barrier_wait(&c->go);
        for (int i = 1; i < c->pieces; i++)
            pthread_join(tids[i], NULL);
        pthread_barrier_destroy(&c->go);
        pthread_barrier_destroy(&c->step);
        pthread_cond_destroy(&c->cond);
        pthread_mutex_destroy(&c->lock);
    }
    int e = atomic_load(&c->err);
    if (e) {
        out->err = e;
        out->where = c->kind == KIND_PVW ? "process_vm_writev" : "copy";
        errno = e;
        return -1;
    }
    return 0;
}

int hb_memcpy(uint64_t size, int threads, uint64_t min_piece, int stream, int memfd, double seconds,
              hb_copy_result *out)
{
    memset(out, 0, sizeof *out);
    copier c = {.kind = stream ? KIND_STREAM : KIND_MEMCPY, .size = size};
    void *(*map)(uint64_t, int) = memfd ? map_memfd : map_buf;
    uint8_t *src = map(size, 0x5a), *dst = map(size, 0);
    int rc = -1;
    if (!src || !dst) {
        out->err = errno;
        out->where = "mmap";
        goto done;
    }
    c.src = src;
    c.dst = dst;
    copy_cut(&c, threads, min_piece);
    rc = copy_run(&c, seconds, out);
done:
    unmap_buf(src, size);
    unmap_buf(dst, size);
    return rc;
}

int hb_process_vm_writev(uint64_t size, int threads, uint64_t min_piece, double seconds, hb_copy_result *out)
{
    memset(out, 0, sizeof *out);
    int up[2], down[2];
    if (pipe2(up, O_CLOEXEC) < 0) {
        out->err = errno;
        out->where = "pipe";
        return -1;
    }
    if (pipe2(down, O_CLOEXEC) < 0) {
        out->err = errno;
        out->where = "pipe";
        close(up[0]);
        close(up[1]);
        return -1;
    }
    pid_t pid = fork_child();
    if (pid == 0) {
        /* The target: a warm buffer of its own, its address sent up, then
         * nothing until the parent closes `down`. */
        close(up[0]);
        close(down[1]);
        void *p = map_buf(size, 0);
        if (write(up[1], &p, sizeof p) != (ssize_t)sizeof p)
            _exit(1);
        char ch;
        while (read(down[0], &ch, 1) < 0 && errno == EINTR)
            ;
        _exit(0);
    }
    close(up[1]);
    close(down[0]);
    int rc = -1;
    uint8_t *src = NULL;
    void *remote = NULL;
    if (pid < 0) {
        out->err = errno;
        out->where = "fork";
        close(up[0]);
        close(down[1]);
        return -1;
    }
    ssize_t got;
    while ((got = read(up[0], &remote, sizeof remote)) < 0 && errno == EINTR)
        ;
    if (got != (ssize_t)sizeof remote || !remote) {
        out->err = ENOMEM;
        out->where = "target process";
        goto done;
    }
    src = map_buf(size, 0x5a);
    if (!src) {
        out->err = errno;
        out->where = "mmap";
        goto done;
    }
    copier c = {.kind = KIND_PVW, .pid = pid, .dst = remote, .src = src, .size = size};
    copy_cut(&c, threads, min_piece);
    rc = copy_run(&c, seconds, out);
done:
    close(up[0]);
    close(down[1]); /* the child's read returns 0: it exits */
    reap(pid);
    unmap_buf(src, size);
    return rc;
}

/* ---------- tcp ---------- */

int hb_tcp_stream(uint64_t write_size, int spin, double seconds, hb_stream_result *out)
{
    memset(out, 0, sizeof *out);
    uint16_t port;
    int ls = listen_loopback(&port);
    if (ls < 0) {
        out->err = errno;
        out->where = "listen";
        return -1;
    }
    double interval = seconds / 5;
    interval = interval < 0.05 ? 0.05 : interval > 0.2 ? 0.2 : interval;
    pid_t pid = fork_child();
    if (pid == 0) {
        /* The receiver: reads write_size at a time until the end of the
         * stream, timing what arrives per interval, then reports. */
        int fd = accept(ls, NULL, NULL);
        if (fd < 0)
            _exit(1);
        close(ls);
        void *buf = map_buf(write_size, 0);
        if (!buf)
            _exit(1);
        double rate[MAX_BATCHES];
        int nrate = 0, reads = 0;
        uint64_t total = 0, mark_bytes = 0;
        double mark = 0;
        for (;;) {
            ssize_t n = recv(fd, buf, write_size, spin ? MSG_DONTWAIT : 0);
            if (n > 0) {
                if (total == 0)
                    mark = now();
                total += (uint64_t)n;
                if (++reads % 16 == 0) {
                    double t = now();
                    if (t - mark >= interval && nrate < MAX_BATCHES) {
                        rate[nrate++] = (double)(total - mark_bytes) / (t - mark) / 1e9;
                        mark = t;
                        mark_bytes = total;
                    }
                }
            } else if (n == 0) {
                break;
            } else if (errno == EAGAIN && spin) {
                sched_yield();
            } else if (errno != EINTR) {
                _exit(1);
            }
        }
        /* Leave out the first interval (slow start, buffers filling). */
        double report[4] = {(double)total, 0, 0, 0};
        if (nrate > 1) {
            qsort(rate + 1, (size_t)(nrate - 1), sizeof rate[0], cmp_double);
            int m = nrate - 1;
            report[1] = rate[nrate - 1];
            report[2] = m % 2 ? rate[1 + m / 2] : (rate[m / 2] + rate[1 + m / 2]) / 2;
            report[3] = m;
        }
        if (send_all(fd, report, sizeof report, 0) < 0)
            _exit(1);
        _exit(0);
    }
    close(ls); /* the child holds the listening socket now */
    if (pid < 0) {
        out->err = errno;
        out->where = "fork";
        return -1;
    }
    int rc = -1, fd = connect_loopback(port);
    void *buf = NULL;
    if (fd < 0) {
        out->err = errno;
        out->where = "connect";
        kill(pid, SIGKILL);
        reap(pid);
        return -1;
    }
    buf = map_buf(write_size, 0x5a);
    if (!buf) {
        out->err = errno;
        out->where = "mmap";
        goto done;
    }
    /* Like iperf3: the clock starts at the first write, slow start included. */
    uint64_t sent = 0;
    double theirs[4];
    double t0 = now(), t1;
    do {
        for (int i = 0; i < 16; i++) {
            if (send_all(fd, buf, write_size, spin) < 0) {
                out->err = errno;
                out->where = "send";
                goto done;
            }
        }
        sent += 16 * write_size;
    } while (now() - t0 < seconds);
    shutdown(fd, SHUT_WR);
    if (recv_all(fd, theirs, sizeof theirs, 0) != 1) {
        out->err = errno ? errno : EPIPE;
        out->where = "receiver";
        goto done;
    }
    t1 = now(); /* the receiver has read every byte */
    if ((uint64_t)theirs[0] != sent) {
        out->err = EPROTO;
        out->where = "receiver count";
        goto done;
    }
    out->bytes = sent;
    out->seconds = t1 - t0;
    out->gbps = (double)sent / (t1 - t0) / 1e9;
    out->best_gbps = theirs[1];
    out->median_gbps = theirs[2];
    out->intervals = (int)theirs[3];
    rc = 0;
done:
    close(fd);
    if (reap(pid) < 0 && rc == 0) {
        out->err = ECHILD;
        out->where = "receiver exit";
        rc = -1;
    }
    unmap_buf(buf, write_size);
    return rc;
}

/* Median, p99 and mean of n round-trip samples (seconds) taken over elapsed seconds. */
static void summarize_rtt(double *samples, uint64_t n, double elapsed, hb_rtt_result *out)
{
    qsort(samples, n, sizeof *samples, cmp_double);
    out->ops = n;
    out->median_us = (n % 2 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2) * 1e6;
    out->p99_us = samples[(uint64_t)((double)n * 0.99)] * 1e6;
    out->mean_us = elapsed / (double)n * 1e6;
}

/* One round trip of a timing loop: 0, or -1 with errno set (0: the responder went away). */
typedef int (*round_trip_fn)(void *ctx);

/* Times once(ctx) after RTT_WARMUP untimed ones, for `seconds` and at least 100 samples. */
static int time_rtt(round_trip_fn once, void *ctx, double seconds, const char *what, hb_rtt_result *out)
{
    double *samples = malloc(RTT_MAX_SAMPLES * sizeof *samples);
    if (!samples) {
        out->err = ENOMEM;
        out->where = "alloc";
        return -1;
    }
    uint64_t n = 0;
    double t0 = 0, start = 0, t = 0;
    for (int i = -RTT_WARMUP; n < RTT_MAX_SAMPLES; i++) {
        if (i == 0)
            start = now();
        if (i >= 0)
            t0 = now();
        errno = 0;
        if (once(ctx) < 0) {
            out->err = errno ? errno : EPIPE;
            out->where = what;
            free(samples);
            return -1;
        }
        if (i >= 0) {
            t = now();
            samples[n++] = t - t0;
            if (t - start >= seconds && n >= 100)
                break;
        }
    }
    summarize_rtt(samples, n, t - start, out);
    free(samples);
    return 0;
}

typedef struct {
    int fd, spin;
    void *buf;
    uint32_t request;
} tcp_rtt_ctx;

static int tcp_round_trip(void *p)
{
    tcp_rtt_ctx *c = p;
    char k;
    return send_all(c->fd, c->buf, c->request, c->spin) < 0 || recv_all(c->fd, &k, 1, c->spin) != 1 ? -1 : 0;
}

int hb_tcp_rtt(uint32_t request, int spin, double seconds, hb_rtt_result *out)
{
    memset(out, 0, sizeof *out);
    uint16_t port;
    int ls = listen_loopback(&port);
    if (ls < 0) {
        out->err = errno;
        out->where = "listen";
        return -1;
    }
    pid_t pid = fork_child();
    if (pid == 0) {
        /* The responder: request bytes in, one byte out, until the end. */
        int fd = accept(ls, NULL, NULL);
        if (fd < 0)
            _exit(1);
        close(ls);
        nodelay(fd);
        void *buf = map_buf(request, 0);
        if (!buf)
            _exit(1);
        char k = 'k';
        for (;;) {
            int r = recv_all(fd, buf, request, spin);
            if (r == 0)
                _exit(0);
            if (r < 0 || send_all(fd, &k, 1, spin) < 0)
                _exit(1);
        }
    }
    close(ls);
    if (pid < 0) {
        out->err = errno;
        out->where = "fork";
        return -1;
    }
    int rc = -1, fd = connect_loopback(port);
    void *buf = NULL;
    if (fd < 0) {
        out->err = errno;
        out->where = "connect";
        kill(pid, SIGKILL);
        reap(pid);
        return -1;
    }
    nodelay(fd);
    buf = map_buf(request, 0x5a);
    if (!buf) {
        out->err = ENOMEM;
        out->where = "alloc";
        goto done;
    }
    tcp_rtt_ctx ctx = {.fd = fd, .spin = spin, .buf = buf, .request = request};
    rc = time_rtt(tcp_round_trip, &ctx, seconds, "round trip", out);
done:
    close(fd);
    if (reap(pid) < 0 && rc == 0) {
        out->err = ECHILD;
        out->where = "responder exit";
        rc = -1;
    }
    unmap_buf(buf, request);
    return rc;
}

/* The first two CPUs of `allowed` in *a and *b; false with fewer. */
static bool two_cpus(const cpu_set_t *allowed, int *a, int *b)
{
    int found = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE && found < 2; cpu++)
        if (CPU_ISSET(cpu, allowed))
            *(found++ ? b : a) = cpu;
    return found == 2;
}

static void pin(int cpu)
{
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    (void)sched_setaffinity(0, sizeof one, &one);
}

/* ctx: the {ping, pong} eventfds. */
static int wake_round_trip(void *p)
{
    const int *fd = p;
    uint64_t v = 1;
    return write(fd[0], &v, sizeof v) != sizeof v || read(fd[1], &v, sizeof v) != sizeof v ? -1 : 0;
}

int hb_wake_rtt(double seconds, int cpus, hb_rtt_result *out)
{
    memset(out, 0, sizeof *out);
    cpu_set_t allowed;
    int cpu_a = 0, cpu_b = 0;
    if (cpus) {
        if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
            out->err = errno;
        else if (!two_cpus(&allowed, &cpu_a, &cpu_b) && cpus == 2)
            out->err = EINVAL;
        if (out->err) {
            out->where = cpus == 2 ? "two CPUs to pin to" : "a CPU to pin to";
            return -1;
        }
    }
    int ping = eventfd(0, EFD_CLOEXEC), pong = eventfd(0, EFD_CLOEXEC);
    if (ping < 0 || pong < 0) {
        out->err = errno;
        out->where = "eventfd";
        if (ping >= 0)
            close(ping);
        return -1;
    }
    if (cpus)
        pin(cpu_a); /* this thread; given back below */
    pid_t pid = fork_child();
    if (pid == 0) {
        /* The responder: each wake-up answered with one, until ping says 2 (the end). */
        uint64_t v;
        if (cpus == 2)
            pin(cpu_b);
        for (;;) {
            if (read(ping, &v, sizeof v) != sizeof v)
                _exit(1);
            if (v != 1)
                _exit(0);
            v = 1;
            if (write(pong, &v, sizeof v) != sizeof v)
                _exit(1);
        }
    }
    int rc = -1;
    if (pid < 0) {
        out->err = errno;
        out->where = "fork";
        goto done;
    }
    int fds[2] = {ping, pong};
    rc = time_rtt(wake_round_trip, fds, seconds, "wake-up", out);
done:
    if (pid > 0) {
        uint64_t v = 2;
        if (write(ping, &v, sizeof v) != sizeof v)
            kill(pid, SIGKILL);
        if (reap(pid) < 0 && rc == 0) {
            out->err = ECHILD;
            out->where = "responder exit";
            rc = -1;
        }
    }
    close(ping);
    close(pong);
    if (cpus)
        (void)sched_setaffinity(0, sizeof allowed, &allowed);
    return rc;
}
