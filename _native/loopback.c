/* The loopback transport: source and destination are regions of one agent.
 * Small ops copy on the caller's thread; the rest go to the copy pool. */
#include "internal.h"
#include <stdlib.h>
#include <string.h>

typedef struct {
    hx_peer base;
} loopback_peer;

/* Both ends of every piece are checked against the registry before anything
 * is copied: a refused op leaves all memory as it was. */
static int acquire_all(hx_agent *a, int opcode, const hx_sge *sges, uint32_t n,
                       hx_region **regions, uint8_t **dst, const uint8_t **src)
{
    uint32_t remote_need = opcode == HX_OP_PUT ? HX_ACCESS_REMOTE_WRITE : HX_ACCESS_REMOTE_READ;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *local, *remote;
        int rc = hx_region_acquire(a, sges[i].local_region, sges[i].local_off, sges[i].len,
                                   0, &local, &regions[2 * i]);
        if (rc == HX_OK) {
            rc = hx_region_acquire(a, sges[i].remote_region, sges[i].remote_off, sges[i].len,
                                   remote_need, &remote, &regions[2 * i + 1]);
            if (rc != HX_OK)
                hx_region_release(a, regions[2 * i]);
        }
        if (rc != HX_OK) {
            for (uint32_t j = 0; j < 2 * i; j++)
                hx_region_release(a, regions[j]);
            return rc;
        }
        dst[i] = opcode == HX_OP_PUT ? remote : local;
        src[i] = opcode == HX_OP_PUT ? local : remote;
    }
    return HX_OK;
}

static int lb_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
{
    hx_agent *a = p->agent;
    hx_job *job = calloc(1, sizeof *job + 2 * n * sizeof(hx_region *));
    uint8_t **dst = malloc(n * sizeof *dst);
    const uint8_t **src = malloc(n * sizeof *src);
    int rc = HX_E_NOMEM;
    if (!job || !dst || !src)
        goto out;
    rc = acquire_all(a, opcode, sges, n, job->regions, dst, src);
    if (rc != HX_OK)
        goto out;
    job->nregions = 2 * n;
    job->op_id = op_id;
    job->peer_id = p->id;
    atomic_init(&job->status, HX_OK);

    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        total += sges[i].len;
    if (total <= HX_INLINE_COPY_MAX) {
        for (uint32_t i = 0; i < n; i++)
            memmove(dst[i], src[i], sges[i].len);
        for (uint32_t i = 0; i < job->nregions; i++)
            hx_region_release(a, job->regions[i]);
        rc = HX_DONE_INLINE;
        goto out;
    }

    hx_task *first = NULL, *last = NULL;
    int pieces = 0;
    for (uint32_t i = 0; i < n; i++) {
        for (uint64_t off = 0; off < sges[i].len;) {
            uint64_t len = sges[i].len - off;
            if (len > HX_COPY_PIECE)
                len = HX_COPY_PIECE;
            hx_task *t = calloc(1, sizeof *t);
            if (!t) {
                while (first) {
                    hx_task *next = first->next;
                    free(first);
                    first = next;
                }
                for (uint32_t j = 0; j < job->nregions; j++)
                    hx_region_release(a, job->regions[j]);
                rc = HX_E_NOMEM;
                goto out;
            }
            t->job = job;
            t->dst = dst[i] + off;
            t->src = src[i] + off;
            t->len = len;
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
    hx_pool_submit(a, job, first, last);
    job = NULL; /* owned by the pool now */
    rc = HX_POSTED;
out:
    free(job);
    free(dst);
    free(src);
    return rc;
}

static void lb_fail(hx_peer *p, int status)
{
    (void)status; /* queued copies of a loopback peer can only be closed */
    hx_pool_fail_peer(p->agent, p->id);
}

static void lb_destroy(hx_peer *p)
{
    free(p);
}

static const hx_peer_ops loopback_ops = {lb_post, lb_fail, lb_destroy};

hx_peer *hx_loopback_new(hx_agent *a, int *status)
{
    loopback_peer *p = calloc(1, sizeof *p);
    if (!p) {
        *status = HX_E_NOMEM;
        return NULL;
    }
    hx_peer_init(&p->base, a, &loopback_ops);
    *status = HX_OK;
    return &p->base;
}
