/* Ops that are memory copies: loopback (both ends in this agent) and same-host
 * peers (the remote end mapped here, or reached with cross-memory attach).
 * Small ops copy on the caller's thread; large ones are cut into pieces that
 * the copy pool's threads share. */
#include "core/stream.h"
#include "internal.h"
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* Copies at or under this size run on the caller's thread: waking another
 * core costs more than the copy (docs/bench-history.md). Cross-memory attach is
 * several times slower than memcpy, so its bound is lower for a submission
 * of several pieces (the pool's threads share them); one piece up to
 * HX_COPY_PIECE_MIN would be the caller's alone anyway, so it runs inline
 * too, without a completion through the ring and a wake of the event loop. */
#define HX_INLINE_COPY_MAX (1024u * 1024u)
#define HX_INLINE_CMA_MAX (256u * 1024u)
/* Larger copies are shared by the pool's threads and the caller. */
#define HX_COPY_PIECE_MIN (1024u * 1024u)
/* Pieces per thread: with one piece each, a thread that waits for a CPU (more
 * threads than CPUs: two copy threads and the caller on 2 vCPUs) copies its
 * piece alone after the others, and a 64 MiB put took twice one piece's time;
 * smaller pieces go to whichever thread is free. */
#define HX_COPY_SHARES 4u
/* Submissions of up to this many pieces keep their bookkeeping on the stack. */
#define HX_STACK_SGES 4u

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

/* An op's bookkeeping while it is set up: its job (the regions it holds) and
 * each piece's two ends. A few pieces (every single put or get) need nothing
 * from the heap unless they go to the pool: the job moves there then. */
typedef struct {
    struct {
        hx_job job;
        hx_region *regions[2 * HX_STACK_SGES];
    } stack_job;
    uint8_t *stack_dst[HX_STACK_SGES];
    const uint8_t *stack_src[HX_STACK_SGES];
    hx_job *job; /* NULL once the pool owns it */
    uint8_t **dst;
    const uint8_t **src;
} copy_op;

static size_t job_size(uint32_t n) { return sizeof(hx_job) + 2 * n * sizeof(hx_region *); }

static int op_init(copy_op *o, uint32_t n)
{
    bool small = n <= HX_STACK_SGES;
    o->job = small ? memset(&o->stack_job, 0, sizeof o->stack_job) : calloc(1, job_size(n));
    o->dst = small ? o->stack_dst : malloc(n * sizeof *o->dst);
    o->src = small ? o->stack_src : malloc(n * sizeof *o->src);
    return o->job && o->dst && o->src ? HX_OK : HX_E_NOMEM;
}

static void op_end(copy_op *o)
{
    if (o->job != &o->stack_job.job)
        free(o->job);
    if (o->dst != o->stack_dst) {
        free(o->dst);
        free(o->src);
    }
}

static void job_init(hx_job *job, hx_peer *p, uint64_t op_id, uint32_t n)
{
    job->nregions = 2 * n;
    job->op_id = op_id;
    job->peer_id = p->id;
    job->transport = p->ops->transport;
    job->peer_failed = &p->failed;
    atomic_init(&job->status, HX_OK);
}

static void release_all(hx_job *job)
{
    for (uint32_t i = 0; i < job->nregions; i++)
        hx_region_release(job->regions[i]);
}

/* Every piece on this thread: cheaper than waking a pool thread and then the
 * event loop. HX_DONE_INLINE, or the first failure. */
static int run_inline(copy_op *o, int pid, int opcode, const hx_sge *sges, uint32_t n)
{
    int rc = HX_DONE_INLINE;
    for (uint32_t i = 0; i < n && rc == HX_DONE_INLINE; i++) {
        int s = hx_copy_run(opcode, pid, o->dst[i], o->src[i], sges[i].len);
        if (s != HX_OK)
            rc = s;
    }
    release_all(o->job);
    return rc;
}

/* Pieces for the pool's threads and for this thread, which would otherwise
 * only wait: HX_COPY_SHARES each, at least HX_COPY_PIECE_MIN, in whole pages. */
static uint64_t piece_size(uint64_t total, uint32_t nthreads, bool overlap)
{
    if (overlap)
        return total; /* one memmove: pieces copied in parallel would read bytes already overwritten */
    uint64_t piece = total / ((uint64_t)(nthreads + 1) * HX_COPY_SHARES) + 1;
    if (piece < HX_COPY_PIECE_MIN)
        piece = HX_COPY_PIECE_MIN;
    return (piece + 4095) & ~(uint64_t)4095;
}

/* The op cut into tasks of at most piece bytes, in order; NULL when out of
 * memory (none kept then). */
static hx_task *split_into_tasks(const copy_op *o, int pid, int opcode, const hx_sge *sges, uint32_t n,
                                 uint64_t piece, bool stream, hx_task **last, int *count)
{
    hx_task *first = NULL;
    *last = NULL;
    *count = 0;
    for (uint32_t i = 0; i < n; i++) {
        for (uint64_t off = 0; off < sges[i].len;) {
            uint64_t len = sges[i].len - off < piece ? sges[i].len - off : piece;
            hx_task *t = calloc(1, sizeof *t);
            if (!t) {
                free_tasks(first);
                return NULL;
            }
            *t = (hx_task){.job = o->job,
                           .dst = o->dst[i] + off,
                           .src = o->src[i] + off,
                           .len = len,
                           .pid = pid,
                           .opcode = opcode,
                           .stream = stream};
            if (*last)
                (*last)->next = t;
            else
                first = t;
            *last = t;
            (*count)++;
            off += len;
        }
    }
    return first;
}

/* Shares the op with the pool's threads; this thread copies the first piece
 * only: it is the event loop's, which the rest of the op would stall. HX_POSTED
 * (the pool completes the op), or HX_E_NOMEM with the regions released. */
static int run_on_pool(hx_agent *a, copy_op *o, int pid, int opcode, const hx_sge *sges, uint32_t n,
                       uint64_t piece, bool stream)
{
    if (o->job == &o->stack_job.job) {
        hx_job *heap = hx_fault(HX_FAULT_COPY_JOB) ? NULL : malloc(job_size(n));
        if (!heap) {
            release_all(o->job);
            return HX_E_NOMEM;
        }
        memcpy(heap, o->job, job_size(n)); /* atomics not yet shared with any thread */
        o->job = heap;
    }
    hx_task *last;
    int count;
    hx_task *mine = split_into_tasks(o, pid, opcode, sges, n, piece, stream, &last, &count);
    if (!mine) {
        release_all(o->job);
        return HX_E_NOMEM;
    }
    atomic_init(&o->job->remaining, count);
    o->job = NULL; /* owned by the pool now */
    if (mine->next)
        hx_pool_submit(a, mine->next, last);
    hx_pool_run(a, mine);
    return HX_POSTED;
}

/* The regions are held: copies inline, or on the pool. */
static int run(hx_agent *a, copy_op *o, int pid, int opcode, const hx_sge *sges, uint32_t n)
{
    int overlap = pid ? 0 : check_overlap(sges, n, o->dst, o->src);
    if (overlap < 0) {
        release_all(o->job);
        return overlap;
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        total += sges[i].len;
    if (total <= (pid ? HX_INLINE_CMA_MAX : HX_INLINE_COPY_MAX) || (n == 1 && total <= HX_COPY_PIECE_MIN))
        return run_inline(o, pid, opcode, sges, n);
    bool stream = !pid && !overlap && total >= HX_STREAM_MIN;
    return run_on_pool(a, o, pid, opcode, sges, n, piece_size(total, a->nthreads, overlap), stream);
}

int hx_copy_post(hx_peer *p, hx_registry *remote, int pid, int opcode, uint64_t op_id, const hx_sge *sges,
                 uint32_t n)
{
    copy_op o;
    int rc = op_init(&o, n);
    if (rc == HX_OK)
        rc = acquire_all(p->agent, remote, opcode, sges, n, o.job->regions, o.dst, o.src);
    if (rc == HX_OK) {
        job_init(o.job, p, op_id, n);
        rc = run(p->agent, &o, pid, opcode, sges, n);
    }
    op_end(&o);
    return rc;
}
