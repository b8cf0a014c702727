/* Faulting registered memory in before the first op: a copy into cold pages
 * runs at a fraction of the speed of one into warm pages, and a KV pool is
 * tens of GiB. The kernel's bulk populate (MADV_POPULATE_WRITE/READ, Linux
 * 5.14) is several times faster than touching each page, and it scales over
 * threads; transparent huge pages, where the system allows them, cut the
 * faults and the TLB misses by 512. Older kernels get the page-by-page touch.
 *
 * A huge page is not always cheap: with THP defrag on "madvise" (Debian's
 * default) a fault that finds no free 2 MiB block compacts memory first, and
 * a populate with huge pages ran anywhere from a quarter of the speed of small
 * ones to several times it, from run to run, where small pages ran steadily
 * (CHANGELOG.md has the figures). So each thread populates its
 * share in 16 MiB chunks and keeps huge pages only while a chunk faults in at
 * least as fast as small pages do (timed once per process, on scratch memory).
 * A chunk is populated 2 MiB a call, so that the mmap lock each call holds
 * keeps other threads' mmap and munmap waiting 2 MiB's time at most, not 16. */
#include "internal.h"
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define PIECE_MIN (256ull << 20) /* a thread's share is at least this much */
#define CHUNK (16ull << 20)      /* timed as one */
#define HUGE (2ull << 20)
#define STEP HUGE /* populated in one call */
#define MAX_THREADS 8

typedef struct {
    uint8_t *addr;
    uint64_t len;
    int write;
    bool huge; /* huge pages were asked for this share */
    int rc;
} piece;

static void touch(uint8_t *addr, uint64_t len, int write)
{
    long page = sysconf(_SC_PAGESIZE);
    volatile uint8_t *p = addr;
    for (uint64_t off = 0; off < len; off += (uint64_t)page) {
        if (write)
            p[off] = p[off]; /* a read-modify-write keeps the contents */
        else
            (void)p[off];
    }
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Seconds per byte of a populate of [p, p + len), one STEP a call: each call holds
 * the process's mmap lock for reading, and a thread that maps or unmaps meanwhile
 * (an event loop's allocator growing its heap) waits for the call to end. < 0: the
 * kernel refused it. */
static double populate_steps(uint8_t *p, uint64_t len, int advice)
{
    double t = now();
    for (uint64_t off = 0; off < len; off += STEP) {
        uint64_t n = len - off < STEP ? len - off : STEP;
        if (madvise(p + off, n, advice) != 0)
            return -1;
    }
    return (now() - t) / (double)len;
}

/* Seconds per byte of a populate with small pages: measured once per process,
 * on a scratch mapping, so that every page of a region may still be huge. */
static double small_cost;
static pthread_once_t small_once = PTHREAD_ONCE_INIT;

static void measure_small_cost(void)
{
    uint64_t len = 8ull << 20;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return;
    madvise(p, len, MADV_NOHUGEPAGE);
    double cost = populate_steps(p, len, MADV_POPULATE_WRITE);
    munmap(p, len);
    small_cost = cost > 0 ? cost : 0;
}

static void *populate(void *arg)
{
    piece *w = arg;
    int advice = w->write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
    uint8_t *p = w->addr, *end = w->addr + w->len;
    double small = 0;
    if (w->huge) {
        pthread_once(&small_once, measure_small_cost);
        small = small_cost;
    }
    w->rc = 0;
    while (p < end) {
        uint8_t *next = (uint8_t *)(((uintptr_t)p + CHUNK) & ~(uintptr_t)(HUGE - 1));
        uint64_t n = (uint64_t)((next < end ? next : end) - p);
        double cost = populate_steps(p, n, advice);
        if (cost < 0) {
            w->rc = -1;
            touch(p, (uint64_t)(end - p), w->write); /* EINVAL: a kernel before 5.14 */
            return NULL;
        }
        p += n;
        if (w->huge && small > 0 && cost > small && p < end) {
            madvise(p, (uint64_t)(end - p), MADV_NOHUGEPAGE); /* compaction: small pages from here */
            w->huge = false;
        }
    }
    return NULL;
}

int hx_prefault(void *addr, uint64_t len, int write, int threads)
{
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)addr & ~(uintptr_t)(page - 1);
    uintptr_t end = (uintptr_t)addr + len;
    if (!len)
        return 0;
    len = end - start;
    /* Advice only: refused (THP off, a file mapping) changes nothing. */
    uintptr_t hs = (start + HUGE - 1) & ~(HUGE - 1), he = end & ~(HUGE - 1);
    bool huge = he > hs && madvise((void *)hs, he - hs, MADV_HUGEPAGE) == 0;
    uint64_t n = len / PIECE_MIN;
    if (n > (uint64_t)threads)
        n = (uint64_t)threads;
    if (n > MAX_THREADS)
        n = MAX_THREADS;
    if (n < 1)
        n = 1;
    piece w[MAX_THREADS];
    pthread_t t[MAX_THREADS];
    bool started[MAX_THREADS] = {false};
    /* Shares end on 2 MiB boundaries, so that no huge page straddles two threads' advice. */
    uintptr_t from = start;
    for (uint64_t i = 0; i < n; i++) {
        uintptr_t to = i + 1 == n ? end : ((start + (i + 1) * (len / n)) + HUGE - 1) & ~(HUGE - 1);
        if (to > end)
            to = end;
        w[i] = (piece){(uint8_t *)from, to - from, write, huge, 0};
        from = to;
        if (i > 0 && pthread_create(&t[i], NULL, populate, &w[i]) == 0)
            started[i] = true;
    }
    populate(&w[0]);
    for (uint64_t i = 1; i < n; i++) {
        if (started[i])
            pthread_join(t[i], NULL);
        else
            populate(&w[i]); /* no thread to spare: this one does it */
    }
    for (uint64_t i = 0; i < n; i++)
        if (w[i].rc != 0)
            return 1; /* fell back to touching pages */
    return 0;
}

/* Unmapping GiBs in one munmap holds the process's mmap lock for tens of
 * milliseconds, and every thread that maps or unmaps meanwhile waits (an
 * event loop's allocator mapping an arena: 65-71 ms beside 1 GiB). Dropped
 * first in pieces, under the lock taken for reading a piece at a time, the
 * wait is one piece. Called without the GIL (cffi): Python's mmap.madvise
 * holds it, which stalled the loop for as long. */
#define UNPOPULATE_PIECE (32ull << 20)

void hx_unpopulate(void *addr, uint64_t len)
{
    for (uint64_t off = 0; off < len; off += UNPOPULATE_PIECE) {
        uint64_t n = len - off < UNPOPULATE_PIECE ? len - off : UNPOPULATE_PIECE;
        madvise((char *)addr + off, n, MADV_DONTNEED); /* best effort: the munmap follows */
    }
}
