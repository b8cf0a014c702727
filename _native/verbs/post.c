/* Posting: an op becomes one chain of work requests, posted with one
 * doorbell when the send queue has room, else queued in order. */
#include "verbs.h"

#ifdef HX_HAVE_VERBS
#include <arpa/inet.h>
#include <stdlib.h>

#define MAX_CHAIN (SQ_DEPTH / 2)

void vb_vop_finish(hx_agent *a, vop *op, int status)
{
    for (uint32_t i = 0; i < op->nregions; i++)
        hx_region_release(op->regions[i]);
    if (status != HX_OK)
        hx_stat_error(a, HX_TRANSPORT_VERBS);
    hx_complete(a, op->op_id, status);
    free(op->wrs);
    free(op->sgl);
    free(op);
}

/* An op that was never posted: nothing of it reached the NIC. */
static void vop_discard(vop *op)
{
    for (uint32_t j = 0; j < op->nregions; j++)
        hx_region_release(op->regions[j]);
    free(op->wrs);
    free(op->sgl);
    free(op);
}

/* Posts op's chain now. Caller holds q->lock and has checked there is room. */
int vb_post_chain(vqp *q, vop *op)
{
    struct ibv_send_wr *bad;
    int rc = ibv_post_send(q->qp, op->wrs, &bad);
    if (rc)
        return rc;
    q->wr_inflight += op->nwr;
    q->ops_inflight++;
    free(op->wrs);
    free(op->sgl);
    op->wrs = NULL;
    op->sgl = NULL;
    return 0;
}

static int verbs_build(vqp *q, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n, bool with_imm,
                       uint32_t imm, vop **out)
{
    hx_agent *a = q->base.agent;
    hx_verbs *v = V(a);
    uint32_t nwr = 0;
    for (uint32_t i = 0; i < n; i++)
        nwr += (uint32_t)((sges[i].len + v->max_msg - 1) / v->max_msg);
    if (nwr == 0 || nwr > MAX_CHAIN)
        return HX_E_INVAL;
    vop *op = calloc(1, sizeof *op + n * sizeof(hx_region *));
    struct ibv_send_wr *wrs = calloc(nwr, sizeof *wrs);
    struct ibv_sge *sgl = calloc(nwr, sizeof *sgl);
    if (!op || !wrs || !sgl) {
        free(op);
        free(wrs);
        free(sgl);
        return HX_E_NOMEM;
    }
    op->qp = q;
    op->op_id = op_id;
    op->nwr = nwr;
    op->wrs = wrs;
    op->sgl = sgl;
    uint32_t w = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *local;
        hx_region *r;
        int rc = hx_region_acquire(a, sges[i].local_region, sges[i].local_off, sges[i].len, 0, &local, &r);
        if (rc == HX_OK && !r->mr) {
            hx_region_release(r);
            rc = HX_E_ACCESS; /* no MR: registered before the device was opened and never since */
        }
        if (rc != HX_OK) {
            vop_discard(op);
            return rc;
        }
        op->regions[op->nregions++] = r;
        uint32_t lkey = ((struct ibv_mr *)r->mr)->lkey;
        for (uint64_t off = 0; off < sges[i].len; off += v->max_msg, w++) {
            uint64_t len = sges[i].len - off;
            if (len > v->max_msg)
                len = v->max_msg;
            sgl[w] =
                (struct ibv_sge){.addr = (uintptr_t)(local + off), .length = (uint32_t)len, .lkey = lkey};
            wrs[w].wr_id = (uintptr_t)op;
            wrs[w].sg_list = &sgl[w];
            wrs[w].num_sge = 1;
            wrs[w].opcode = opcode == HX_OP_PUT ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
            /* The remote NIC checks the rkey and the address range. */
            wrs[w].wr.rdma.remote_addr = sges[i].raddr + off;
            wrs[w].wr.rdma.rkey = sges[i].rkey;
            wrs[w].next = w + 1 < nwr ? &wrs[w + 1] : NULL;
        }
    }
    struct ibv_send_wr *last = &wrs[nwr - 1];
    last->send_flags = IBV_SEND_SIGNALED;
    last->wr_id = (uintptr_t)op | 1u;
    if (with_imm) {
        last->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        last->imm_data = htonl(imm);
    }
    *out = op;
    return HX_OK;
}

static int verbs_submit(vqp *q, vop *op)
{
    pthread_mutex_lock(&q->lock);
    int failed = atomic_load(&q->base.failed);
    if (q->broken || failed) {
        pthread_mutex_unlock(&q->lock);
        vop_discard(op);
        return failed ? failed : HX_E_CONNLOST;
    }
    /* Never overrun the send queue: what does not fit waits, in order. */
    if (q->pending_head || q->wr_inflight + op->nwr > SQ_DEPTH) {
        if (q->pending_tail)
            q->pending_tail->next = op;
        else
            q->pending_head = op;
        q->pending_tail = op;
    } else if (vb_post_chain(q, op)) {
        pthread_mutex_unlock(&q->lock);
        vop_discard(op);
        return HX_E_SYS;
    }
    pthread_mutex_unlock(&q->lock);
    return HX_POSTED;
}

int vb_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
{
    vop *op;
    int rc = verbs_build((vqp *)p, opcode, op_id, sges, n, false, 0, &op);
    return rc == HX_OK ? verbs_submit((vqp *)p, op) : rc;
}

int hx_verbs_post_imm(hx_peer *p, uint64_t op_id, const hx_sge *sges, uint32_t n, uint32_t imm)
{
    if (atomic_load(&p->closed))
        return HX_E_CLOSED;
    vop *op;
    int rc = verbs_build((vqp *)p, HX_OP_PUT, op_id, sges, n, true, imm, &op);
    rc = rc == HX_OK ? verbs_submit((vqp *)p, op) : rc;
    hx_stat_post(p, sges, n, rc);
    return rc;
}

/* Ops that were never posted fail at once; posted ones come back flushed. */
void vb_fail_pending(hx_agent *a, vqp *q, int status)
{
    pthread_mutex_lock(&q->lock);
    vop *op = q->pending_head;
    q->pending_head = q->pending_tail = NULL;
    pthread_mutex_unlock(&q->lock);
    while (op) {
        vop *next = op->next;
        vb_vop_finish(a, op, status);
        op = next;
    }
}

#endif
