/* Queue pairs: RESET -> INIT -> RTR -> RTS, ERR on failure; one per peer
 * (initiator) or per session (target); the verbs peer's fail and destroy. */
#include "verbs.h"

#ifdef HX_HAVE_VERBS
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define AIOHIXL_QP_ACCESS (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE)

struct ibv_qp *vb_create_qp(hx_verbs *v, struct ibv_pd *pd, int access)
{
    struct ibv_qp_init_attr ia = {
        .send_cq = v->cq,
        .recv_cq = v->cq,
        .qp_type = IBV_QPT_RC,
        .sq_sig_all = 0,
        .cap = {.max_send_wr = SQ_DEPTH, .max_recv_wr = RQ_DEPTH, .max_send_sge = 1, .max_recv_sge = 1},
    };
    struct ibv_qp *qp = v->api.create_qp(pd, &ia);
    if (!qp) {
        VB_FAIL("ibv_create_qp failed: %s", strerror(errno));
        return NULL;
    }
    struct ibv_qp_attr at = {.qp_state = IBV_QPS_INIT,
                             .port_num = (uint8_t)v->port,
                             .pkey_index = 0,
                             .qp_access_flags = (unsigned)access};
    if (v->api.modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        VB_FAIL("QP to INIT failed: %s", strerror(errno));
        v->api.destroy_qp(qp);
        return NULL;
    }
    return qp;
}

int vb_connect_qp(hx_verbs *v, struct ibv_qp *qp, uint32_t rqpn, uint32_t rpsn, uint32_t lpsn,
                  const uint8_t *gid, uint16_t lid, int mtu)
{
    struct ibv_qp_attr at = {0};
    at.qp_state = IBV_QPS_RTR;
    at.path_mtu = (enum ibv_mtu)(mtu < v->mtu ? mtu : v->mtu); /* the smaller of the two ports' */
    at.dest_qp_num = rqpn;
    at.rq_psn = rpsn;
    at.max_dest_rd_atomic = 16;
    at.min_rnr_timer = 12;
    at.ah_attr.port_num = (uint8_t)v->port;
    at.ah_attr.dlid = lid;
    bool global = false;
    for (int i = 0; i < 16; i++)
        global |= gid[i] != 0;
    if (global) {
        at.ah_attr.is_global = 1;
        memcpy(at.ah_attr.grh.dgid.raw, gid, 16);
        at.ah_attr.grh.sgid_index = (uint8_t)v->gid_index;
        at.ah_attr.grh.hop_limit = 64;
    }
    if (v->api.modify_qp(qp, &at,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
        VB_FAIL("QP to RTR failed: %s", strerror(errno));
        return HX_E_SYS;
    }
    memset(&at, 0, sizeof at);
    at.qp_state = IBV_QPS_RTS;
    at.timeout = (uint8_t)v->timeout;
    at.retry_cnt = (uint8_t)v->retry_cnt;
    at.rnr_retry = 7;
    at.sq_psn = lpsn;
    at.max_rd_atomic = 16;
    if (v->api.modify_qp(qp, &at,
                         IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                             IBV_QP_MAX_QP_RD_ATOMIC)) {
        VB_FAIL("QP to RTS failed: %s", strerror(errno));
        return HX_E_SYS;
    }
    return HX_OK;
}

void vb_qp_to_error(hx_verbs *v, vqp *q)
{
    struct ibv_qp_attr at = {.qp_state = IBV_QPS_ERR};
    v->api.modify_qp(q->qp, &at, IBV_QP_STATE);
}

uint32_t vb_random_psn(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint32_t)(ts.tv_nsec ^ (ts.tv_sec << 7) ^ getpid()) & 0xffffff;
}

int vb_post_recv(vqp *q, uint32_t slot)
{
    struct ibv_sge sge = {.addr = (uintptr_t)(q->rbuf + (size_t)slot * HX_NOTE_MAX),
                          .length = HX_NOTE_MAX,
                          .lkey = q->rmr->lkey};
    struct ibv_recv_wr wr = {.wr_id = RECV_TAG | slot, .sg_list = &sge, .num_sge = 1}, *bad;
    return ibv_post_recv(q->qp, &wr, &bad) ? -1 : 0;
}

int vb_post_receives(hx_verbs *v, vqp *q)
{
    size_t size = (size_t)RQ_DEPTH * HX_NOTE_MAX;
    q->rbuf = aligned_alloc(4096, size);
    q->rmr =
        q->rbuf ? v->api.reg_mr(q->own_pd ? q->own_pd : v->pd, q->rbuf, size, IBV_ACCESS_LOCAL_WRITE) : NULL;
    if (!q->rmr) {
        VB_FAIL("registering the receive buffers failed: %s", strerror(errno));
        return -1;
    }
    for (uint32_t i = 0; i < RQ_DEPTH; i++)
        if (vb_post_recv(q, i) < 0) {
            VB_FAIL("ibv_post_recv failed");
            return -1;
        }
    return 0;
}

/* After its QP: the buffers the NIC may have used. */
void vb_qp_free(hx_verbs *v, vqp *q)
{
    v->api.destroy_qp(q->qp);
    if (q->rmr)
        v->api.dereg_mr(q->rmr);
    if (q->smr)
        v->api.dereg_mr(q->smr);
    if (q->export_mr)
        v->api.dereg_mr(q->export_mr);
    if (q->own_pd)
        v->api.dealloc_pd(q->own_pd);
    free(q->rbuf);
    free(q->sbuf);
    pthread_mutex_destroy(&q->lock);
    free(q);
}

/* Caller holds v->lock and knows no op of q is outstanding. Completions
 * still queued for q name its qp_num, which no longer matches: ignored. */
static void vqp_destroy_locked(hx_verbs *v, vqp *q)
{
    for (vqp **pp = &v->qps; *pp; pp = &(*pp)->next_all)
        if (*pp == q) {
            *pp = q->next_all;
            break;
        }
    if (q->held_count)
        hx_note_dropped(q->base.agent); /* the session ended with messages held: counted */
    vb_qp_free(v, q);
}

static void verbs_fail(hx_peer *p, int status)
{
    vqp *q = (vqp *)p;
    hx_verbs *v = V(p->agent);
    pthread_mutex_lock(&q->lock);
    bool was = q->broken;
    q->broken = true;
    pthread_mutex_unlock(&q->lock);
    if (!was)
        vb_qp_to_error(v, q);
    vb_fail_pending(p->agent, q, status);
}

static void verbs_destroy(hx_peer *p)
{
    vqp *q = (vqp *)p;
    hx_verbs *v = V(p->agent);
    pthread_mutex_lock(&v->lock);
    pthread_mutex_lock(&q->lock);
    bool idle = q->ops_inflight == 0 && !q->pending_head;
    pthread_mutex_unlock(&q->lock);
    /* Python frees a peer once its ops are done; should any remain, the QP
     * stays listed and goes with the agent, after their flushed completions. */
    if (idle)
        vqp_destroy_locked(v, q);
    pthread_mutex_unlock(&v->lock);
}

static const hx_peer_ops verbs_ops = {.post = vb_post,
                                      .note = vb_note,
                                      .fail = verbs_fail,
                                      .destroy = verbs_destroy,
                                      .transport = HX_TRANSPORT_VERBS};

vqp *vb_vqp_new(hx_agent *a, bool target, uint64_t session, struct ibv_qp *qp)
{
    hx_verbs *v = V(a);
    vqp *q = calloc(1, sizeof *q);
    if (!q) {
        VB_FAIL("out of memory");
        return NULL;
    }
    q->qp = qp;
    hx_peer_init(&q->base, a, &verbs_ops);
    pthread_mutex_init(&q->lock, NULL);
    q->target = target;
    q->session = session;
    pthread_mutex_lock(&v->lock);
    q->next_all = v->qps;
    v->qps = q;
    pthread_mutex_unlock(&v->lock);
    return q;
}

hx_peer *hx_verbs_peer_new(hx_agent *a, uint32_t *qpn, uint32_t *psn, int *status)
{
    if (!V(a)) {
        *status = HX_E_INVAL;
        return NULL;
    }
    /* Remote rights on the QP as on the MRs: the MRs' own flags narrow them. */
    struct ibv_qp *qp = vb_create_qp(V(a), V(a)->pd, AIOHIXL_QP_ACCESS);
    vqp *q = qp ? vb_vqp_new(a, false, 0, qp) : NULL;
    if (!q) {
        if (qp)
            V(a)->api.destroy_qp(qp);
        *status = HX_E_SYS;
        return NULL;
    }
    *qpn = q->qp->qp_num;
    *psn = q->lpsn = vb_random_psn();
    *status = HX_OK;
    return &q->base;
}

int hx_verbs_peer_connect(hx_peer *p, uint32_t qpn, uint32_t psn, const uint8_t *gid, uint16_t lid, int mtu)
{
    vqp *q = (vqp *)p;
    return vb_connect_qp(V(p->agent), q->qp, qpn, psn, q->lpsn, gid, lid, mtu);
}

int hx_verbs_accept(hx_agent *a, uint64_t session, uint32_t qpn, uint32_t psn, const uint8_t *gid,
                    uint16_t lid, int mtu, uint32_t *lqpn, uint32_t *lpsn)
{
    hx_verbs *v = V(a);
    if (!v)
        return HX_E_INVAL;
    struct ibv_qp *qp = vb_create_qp(v, v->pd, AIOHIXL_QP_ACCESS);
    vqp *q = qp ? vb_vqp_new(a, true, session, qp) : NULL;
    if (!q) {
        if (qp)
            v->api.destroy_qp(qp);
        return HX_E_SYS;
    }
    *lqpn = q->qp->qp_num;
    *lpsn = vb_random_psn();
    int rc = vb_connect_qp(v, q->qp, qpn, psn, *lpsn, gid, lid, mtu);
    if (rc == HX_OK && vb_post_receives(v, q) < 0)
        rc = HX_E_SYS;
    if (rc != HX_OK) {
        pthread_mutex_lock(&q->lock);
        q->broken = true;
        pthread_mutex_unlock(&q->lock);
        vb_qp_to_error(v, q);
    }
    return rc;
}

void hx_verbs_drop_session(hx_agent *a, uint64_t session)
{
    hx_verbs *v = V(a);
    if (!v)
        return;
    pthread_mutex_lock(&v->lock);
    vqp *q = v->qps;
    while (q) {
        vqp *next = q->next_all;
        /* A target QP only answers the peer's NIC: it has no ops of its own. */
        if (q->target && q->session == session)
            vqp_destroy_locked(v, q);
        q = next;
    }
    pthread_mutex_unlock(&v->lock);
}

#endif
