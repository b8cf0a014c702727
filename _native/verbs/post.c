/* Posting: an op becomes one chain of work requests, posted with one
 * doorbell when the send queue has room, else queued in order. */
#include "verbs.h"

#ifdef HX_HAVE_VERBS
#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

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
    free(op->note);
    free(op);
}

/* An op that was never posted: nothing of it reached the NIC. */
static void vop_discard(vop *op)
{
    for (uint32_t j = 0; j < op->nregions; j++)
        hx_region_release(op->regions[j]);
    free(op->wrs);
    free(op->sgl);
    free(op->note);
    free(op);
}

bool vb_fits(vqp *q, vop *op) { return q->wr_inflight + op->nwr <= SQ_DEPTH && (!op->note || q->note_free); }

/* Posts op's chain now. Caller holds q->lock and has checked vb_fits. */
int vb_post_chain(vqp *q, vop *op)
{
    int slot = -1;
    if (op->note) {
        /* The message goes from a registered send buffer, held until the
         * SEND completes. */
        slot = __builtin_ctzll(q->note_free);
        uint8_t *buf = q->sbuf + (size_t)slot * HX_NOTE_MAX;
        memcpy(buf, op->note, op->note_len);
        *op->sgl = (struct ibv_sge){.addr = (uintptr_t)buf, .length = op->note_len, .lkey = q->smr->lkey};
        op->wrs->num_sge = op->note_len ? 1 : 0;
    }
    struct ibv_send_wr *bad;
    int rc = ibv_post_send(q->qp, op->wrs, &bad);
    if (rc) {
        errno = rc; /* it returns the error instead of setting errno; HX_E_SYS's errno tells */
        return rc;
    }
    if (slot >= 0) {
        q->note_free &= ~(1ull << slot);
        op->note_slot = slot;
    }
    q->wr_inflight += op->nwr;
    q->ops_inflight++;
    free(op->wrs);
    free(op->sgl);
    free(op->note);
    op->wrs = NULL;
    op->sgl = NULL;
    op->note = NULL;
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
    op->note_slot = -1;
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
    if (q->pending_head || !vb_fits(q, op)) {
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

/* The send buffers of a QP's notifications, registered on its first. */
static int note_buffers(vqp *q)
{
    hx_verbs *v = V(q->base.agent);
    pthread_mutex_lock(&q->lock);
    int rc = HX_OK;
    if (!q->sbuf) {
        size_t size = (size_t)NOTE_SLOTS * HX_NOTE_MAX;
        uint8_t *buf = aligned_alloc(4096, size);
        struct ibv_mr *mr = buf ? v->api.reg_mr(v->pd, buf, size, IBV_ACCESS_LOCAL_WRITE) : NULL;
        if (mr) {
            q->sbuf = buf;
            q->smr = mr;
            q->note_free = NOTE_SLOTS == 64 ? ~0ull : (1ull << NOTE_SLOTS) - 1;
        } else {
            free(buf);
            rc = buf ? HX_E_SYS : HX_E_NOMEM;
        }
    }
    pthread_mutex_unlock(&q->lock);
    return rc;
}

/* A notification: a SEND after everything posted before it. The QP keeps
 * it behind earlier WRITEs; the fence also makes it wait for earlier READs.
 * dep needs nothing here: if that op fails, the QP breaks and the SEND is
 * flushed, never delivered. */
int vb_note(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len, int flags)
{
    (void)dep;
    (void)flags; /* the completion thread reads every answer */
    vqp *q = (vqp *)p;
    int rc = note_buffers(q);
    if (rc != HX_OK)
        return rc;
    vop *op = calloc(1, sizeof *op);
    struct ibv_send_wr *wr = calloc(1, sizeof *wr);
    struct ibv_sge *sge = calloc(1, sizeof *sge);
    uint8_t *copy = malloc(len ? len : 1);
    if (!op || !wr || !sge || !copy) {
        free(op);
        free(wr);
        free(sge);
        free(copy);
        return HX_E_NOMEM;
    }
    memcpy(copy, data, len);
    *op = (vop){.qp = q,
                .op_id = op_id,
                .nwr = 1,
                .note_slot = -1,
                .note = copy,
                .note_len = len,
                .wrs = wr,
                .sgl = sge};
    *wr = (struct ibv_send_wr){.wr_id = (uintptr_t)op | 1u,
                               .sg_list = sge,
                               .opcode = IBV_WR_SEND,
                               .send_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE};
    return verbs_submit(q, op);
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
