/* Ops that are memory copies: loopback (both ends in this agent) and same-host
 * peers (the remote end mapped here, or reached with cross-memory attach).
 * Small ops copy on the caller's thread; large ones are cut into pieces that
 * the copy pool's threads share. */
#include "internal.h"
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* Copies at or under this size run on the caller's thread: waking another
 * core (30-40 us each way) costs more than the copy. Cross-memory attach is
 * several times slower than memcpy, so its bound is lower for a submission
 * of several pieces (the pool's threads share them); one piece up to
 * HX_COPY_PIECE_MIN would be the caller's alone anyway, so it runs inline
 * too, without a completion through the ring and a wake of the event loop. */
#define HX_INLINE_COPY_MAX (1024u * 1024u)
#define HX_INLINE_CMA_MAX (256u * 1024u)
/* Larger copies are shared by the pool's threads and the caller. */
#define HX_COPY_PIECE_MIN (1024u * 1024u)
/* Submissions of up to this many pieces keep their bookkeeping on the stack. */
#define HX_STACK_SGES 4u

/* One cross-memory attach call; what it moved, or a negative status. */
static ssize_t cma_once(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len)
{
    struct iovec local, remote;
    if (opcode == HX_OP_PUT) {
        local = (struct iovec){(void *)src, len};
        remote = (struct iovec){dst, len};
        return process_vm_writev(pid, &local, 1, &remote, 1, 0);
    }
    local = (struct iovec){dst, len};
    remote = (struct iovec){(void *)src, len};
    return process_vm_readv(pid, &local, 1, &remote, 1, 0);
}

static int cma_copy(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len)
{
    /* Cross-memory attach moves at most what the kernel takes per call. */
    while (len) {
        ssize_t n = cma_once(opcode, pid, dst, src, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == ESRCH)
                return HX_E_CONNLOST; /* the target process is gone */
            if (errno == EPERM)
                return HX_E_ACCESS;
            return HX_E_REMOTE; /* EFAULT: the target's memory is not there */
        }
        if (n == 0)
            return HX_E_REMOTE;
        dst += n;
        src += n;
        len -= (uint64_t)n;
    }
    return HX_OK;
}

/* The kernel copies cross-memory attach with rep movsb, page by page. Where
 * the destination sits 1-63 bytes past the source modulo 4 KiB (a numpy
 * array's data 16 bytes into its page, written from a page-aligned region),
 * the stores alias the loads that follow them and the copy runs at a quarter
 * of its speed or less (2.3 against 10 GB/s measured on AMD EPYC), however it
 * is cut. Such copies go through a buffer of this thread's placed 2 KiB away
 * from both ends, in pieces that stay in the cache between the two copies. */
#define HX_BOUNCE (128u * 1024u)
#define HX_PAGE 4096u

static pthread_key_t bounce_key;
static pthread_once_t bounce_once = PTHREAD_ONCE_INIT;

static void bounce_key_make(void) { (void)pthread_key_create(&bounce_key, free); }

static uint8_t *bounce_buffer(void)
{
    pthread_once(&bounce_once, bounce_key_make);
    uint8_t *b = pthread_getspecific(bounce_key);
    if (!b) {
        if (posix_memalign((void **)&b, HX_PAGE, HX_BOUNCE + HX_PAGE) != 0)
            return NULL;
        if (pthread_setspecific(bounce_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    return b;
}

static bool aliased(const uint8_t *dst, const uint8_t *src)
{
    uintptr_t d = ((uintptr_t)dst - (uintptr_t)src) & (HX_PAGE - 1);
    return d != 0 && d < 64;
}

static int cma_bounced(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len, uint8_t *buf)
{
    /* The buffer 2 KiB away from the remote end, modulo a page; then 2 KiB plus
     * the old distance away from the local one: neither copy aliases. */
    const uint8_t *far = opcode == HX_OP_PUT ? dst : src;
    uint8_t *b = buf + (((uintptr_t)far + HX_PAGE / 2) & (HX_PAGE - 1));
    while (len) {
        uint64_t n = len < HX_BOUNCE ? len : HX_BOUNCE;
        int rc;
        if (opcode == HX_OP_PUT) {
            memcpy(b, src, n);
            rc = cma_copy(opcode, pid, dst, b, n);
        } else {
            rc = cma_copy(opcode, pid, b, src, n);
            if (rc == HX_OK)
                memcpy(dst, b, n);
        }
        if (rc != HX_OK)
            return rc;
        dst += n;
        src += n;
        len -= n;
    }
    return HX_OK;
}

int hx_copy_run(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len)
{
    if (!pid) {
        memmove(dst, src, len);
        return HX_OK;
    }
    if (len >= 256 && aliased(dst, src)) {
        uint8_t *buf = bounce_buffer();
        if (buf)
            return cma_bounced(opcode, pid, dst, src, len, buf);
    }
    return cma_copy(opcode, pid, dst, src, len);
}

/* Checks both ends of every piece before anything is copied: a refused op
 * leaves all memory as it was. */
static int acquire_all(hx_agent *a, hx_registry *remote, int opcode, const hx_sge *sges, uint32_t n,
                       hx_region **regions, uint8_t **dst, const uint8_t **src)
{
    uint32_t need = opcode == HX_OP_PUT ? HX_ACCESS_REMOTE_WRITE : HX_ACCESS_REMOTE_READ;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *local, *far;
        int rc = hx_region_acquire(a, sges[i].local_region, sges[i].local_off, sges[i].len, 0, &local,
                                   &regions[2 * i]);
        if (rc == HX_OK) {
            /* Loopback: the remote end is this agent's own registry, reached by
             * descriptor like any peer's, so the key is checked. A same-host
             * peer's maps hold only what the target itself handed out. */
            const uint64_t *key = remote == &a->regs ? &sges[i].remote_key : NULL;
            rc = hx_reg_acquire(remote, sges[i].remote_region, key, sges[i].remote_off, sges[i].len, need,
                                &far, &regions[2 * i + 1]);
            if (rc != HX_OK)
                hx_region_release(regions[2 * i]);
        }
        if (rc != HX_OK) {
            for (uint32_t j = 0; j < 2 * i; j++)
                hx_region_release(regions[j]);
            return rc;
        }
        dst[i] = opcode == HX_OP_PUT ? far : local;
        src[i] = opcode == HX_OP_PUT ? local : far;
    }
    return HX_OK;
}

typedef struct {
    uintptr_t start, end;
} span;

static int span_cmp(const void *x, const void *y)
{
    const span *a = x, *b = y;
    return a->start < b->start ? -1 : a->start > b->start;
}

/* Both ends in this address space (pid == 0): whether some destination range
 * overlaps some source range. One pair overlapping itself is copied like
 * memmove (in one piece); across pairs the order of copies is not defined, so
 * a submission whose destinations overlap its sources is refused. Returns
 * 1 (one pair, overlapping itself), 0 (no overlap), HX_E_INVAL or
 * HX_E_NOMEM. O(n log n). */
static int check_overlap(const hx_sge *sges, uint32_t n, uint8_t **dst, const uint8_t **src)
{
    if (n == 1) {
        uintptr_t d = (uintptr_t)dst[0], s = (uintptr_t)src[0], l = sges[0].len;
        return d < s + l && s < d + l;
    }
    /* Fast path: the hull of the destinations misses the hull of the sources. */
    uintptr_t dlo = UINTPTR_MAX, dhi = 0, slo = UINTPTR_MAX, shi = 0;
    for (uint32_t i = 0; i < n; i++) {
        uintptr_t d = (uintptr_t)dst[i], s = (uintptr_t)src[i], l = sges[i].len;
        dlo = d < dlo ? d : dlo;
        dhi = d + l > dhi ? d + l : dhi;
        slo = s < slo ? s : slo;
        shi = s + l > shi ? s + l : shi;
    }
    if (dhi <= slo || shi <= dlo)
        return 0;
    span *srcs = malloc(n * sizeof *srcs);
    uintptr_t *maxend = malloc(n * sizeof *maxend);
    if (!srcs || !maxend) {
        free(srcs);
        free(maxend);
        return HX_E_NOMEM;
    }
    for (uint32_t i = 0; i < n; i++)
        srcs[i] = (span){(uintptr_t)src[i], (uintptr_t)src[i] + sges[i].len};
    qsort(srcs, n, sizeof *srcs, span_cmp);
    for (uint32_t i = 0; i < n; i++)
        maxend[i] = i && maxend[i - 1] > srcs[i].end ? maxend[i - 1] : srcs[i].end;
    int rc = 0;
    for (uint32_t i = 0; i < n && !rc; i++) {
        uintptr_t ds = (uintptr_t)dst[i], de = ds + sges[i].len;
        uint32_t lo = 0, hi = n; /* how many sources start before de */
        while (lo < hi) {
            uint32_t mid = lo + (hi - lo) / 2;
            if (srcs[mid].start < de)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo && maxend[lo - 1] > ds)
            rc = HX_E_INVAL;
    }
    free(srcs);
    free(maxend);
    return rc;
}

static void free_tasks(hx_task *t)
{
    while (t) {
        hx_task *next = t->next;
        free(t);
        t = next;
    }
}

int hx_copy_post(hx_peer *p, hx_registry *remote, int pid, int opcode, uint64_t op_id, const hx_sge *sges,
                 uint32_t n)
{
    hx_agent *a = p->agent;
    /* A few pieces (every single put or get) need nothing from the heap
     * unless they go to the pool: the job moves there then. */
    struct {
        hx_job job;
        hx_region *regions[2 * HX_STACK_SGES];
    } on_stack;
    uint8_t *stack_dst[HX_STACK_SGES];
    const uint8_t *stack_src[HX_STACK_SGES];
    bool small = n <= HX_STACK_SGES;
    hx_job *job =
        small ? memset(&on_stack, 0, sizeof on_stack) : calloc(1, sizeof *job + 2 * n * sizeof(hx_region *));
    uint8_t **dst = small ? stack_dst : malloc(n * sizeof *dst);
    const uint8_t **src = small ? stack_src : malloc(n * sizeof *src);
    int rc = HX_E_NOMEM;
    if (!job || !dst || !src)
        goto out;
    rc = acquire_all(a, remote, opcode, sges, n, job->regions, dst, src);
    if (rc != HX_OK)
        goto out;
    job->nregions = 2 * n;
    job->op_id = op_id;
    job->peer_id = p->id;
    job->transport = p->ops->transport;
    job->peer_failed = &p->failed;
    atomic_init(&job->status, HX_OK);

    int overlap = pid ? 0 : check_overlap(sges, n, dst, src);
    if (overlap < 0) {
        for (uint32_t i = 0; i < job->nregions; i++)
            hx_region_release(job->regions[i]);
        rc = overlap;
        goto out;
    }

    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        total += sges[i].len;
    if (total <= (pid ? HX_INLINE_CMA_MAX : HX_INLINE_COPY_MAX) || (n == 1 && total <= HX_COPY_PIECE_MIN)) {
        /* Cheaper than waking a pool thread and then the event loop. */
        rc = HX_DONE_INLINE;
        for (uint32_t i = 0; i < n && rc == HX_DONE_INLINE; i++) {
            int s = hx_copy_run(opcode, pid, dst[i], (const uint8_t *)src[i], sges[i].len);
            if (s != HX_OK)
                rc = s;
        }
        for (uint32_t i = 0; i < job->nregions; i++)
            hx_region_release(job->regions[i]);
        goto out;
    }

    if (small) {
        size_t size = sizeof *job + 2 * n * sizeof(hx_region *);
        hx_job *heap = malloc(size);
        if (!heap) {
            for (uint32_t i = 0; i < job->nregions; i++)
                hx_region_release(job->regions[i]);
            job = NULL;
            goto out;
        }
        memcpy(heap, job, size); /* atomics not yet shared with any thread */
        job = heap;
    }

    /* Pieces for the pool's threads and for this thread, which would
     * otherwise only wait: one share each, at least HX_COPY_PIECE_MIN. */
    uint64_t piece = total / (a->nthreads + 1) + 1;
    if (piece < HX_COPY_PIECE_MIN)
        piece = HX_COPY_PIECE_MIN;
    piece = (piece + 4095) & ~(uint64_t)4095;
    if (overlap)
        piece = total; /* one memmove: pieces copied in parallel would read bytes already overwritten */
    hx_task *first = NULL, *last = NULL;
    int pieces = 0;
    for (uint32_t i = 0; i < n; i++) {
        for (uint64_t off = 0; off < sges[i].len;) {
            uint64_t len = sges[i].len - off;
            if (len > piece)
                len = piece;
            hx_task *t = calloc(1, sizeof *t);
            if (!t) {
                free_tasks(first);
                for (uint32_t j = 0; j < job->nregions; j++)
                    hx_region_release(job->regions[j]);
                rc = HX_E_NOMEM;
                goto out;
            }
            *t = (hx_task){.job = job,
                           .dst = dst[i] + off,
                           .src = src[i] + off,
                           .len = len,
                           .pid = pid,
                           .opcode = opcode};
            if (last)
                last->next = t;
            else
                first = t;
            last = t;
            pieces++;
            off += len;
        }
    }
    atomic_init(&job->remaining, pieces);
    hx_task *mine = first;
    first = first->next;
    job = NULL; /* owned by the pool now */
    if (first)
        hx_pool_submit(a, first, last);
    hx_pool_run(a, mine);
    rc = HX_POSTED;
out:
    if (job != &on_stack.job)
        free(job);
    if (dst != stack_dst) {
        free(dst);
        free(src);
    }
    return rc;
}
