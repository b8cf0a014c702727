/* Faulting registered memory in before the first op: a copy into cold pages
 * runs at a fraction of the speed of one into warm pages, and a KV pool is
 * tens of GiB. The kernel's bulk populate (MADV_POPULATE_WRITE/READ, Linux
 * 5.14) is several times faster than touching each page, and it scales over
 * threads; transparent huge pages, where the system allows them, cut the
 * faults and the TLB misses by 512. Older kernels get the page-by-page touch. */
#include "internal.h"
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define PIECE_MIN (256ull << 20) /* a thread's share is at least this much */
#define MAX_THREADS 8

typedef struct {
    uint8_t *addr;
    uint64_t len;
    int write;
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

static void *populate(void *arg)
{
    piece *w = arg;
    int advice = w->write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
    w->rc = madvise(w->addr, w->len, advice);
    if (w->rc != 0)
        touch(w->addr, w->len, w->write); /* EINVAL: a kernel before 5.14 */
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
    uintptr_t huge = 2u << 20;
    uintptr_t hs = (start + huge - 1) & ~(huge - 1), he = end & ~(huge - 1);
    if (he > hs)
        madvise((void *)hs, he - hs, MADV_HUGEPAGE);
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
    uint64_t share = (len / n + (uint64_t)page - 1) & ~(uint64_t)(page - 1);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t off = i * share;
        w[i] = (piece){(uint8_t *)start + off, off + share > len ? len - off : share, write, 0};
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
