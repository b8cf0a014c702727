/* Queue pairs for RC peers that are not aiohixl (pyverbs, perftest, another
 * library): the same QP states as an aiohixl peer's, with the connection
 * facts traded by the caller, as data.
 *
 * An export is a target QP in a protection domain of its own that holds one
 * MR, over exactly the exported range with exactly the granted rights, and
 * the QP's receive buffers: the raw peer's QP can reach nothing else of the
 * agent, whatever rkey it tries. A raw initiator's QP lives in the agent's PD
 * (its local regions are registered there) and grants the remote end no
 * RDMA access at all. */
#include "verbs.h"

#ifdef HX_HAVE_VERBS
#include <errno.h>
#include <string.h>

static int ibv_rights(uint32_t access)
{
    int ibv = 0;
    if (access & HX_ACCESS_REMOTE_WRITE)
        ibv |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    if (access & HX_ACCESS_REMOTE_READ)
        ibv |= IBV_ACCESS_REMOTE_READ;
    return ibv;
}

int hx_verbs_export_new(hx_agent *a, uint64_t session, uint32_t region, uint64_t off, uint64_t len,
                        uint32_t access, uint32_t *qpn, uint32_t *psn, uint64_t *addr, uint32_t *rkey)
{
    hx_verbs *v = V(a);
    if (!v)
        return HX_E_INVAL;
    int rights = ibv_rights(access);
    hx_registry *reg = &a->regs;
    pthread_mutex_lock(&reg->lock); /* the region cannot go while its MR is made */
    hx_region *r = hx_reg_find_locked(reg, region);
    if (!r || r->removed || r->kind != HX_MEM_DIRECT) {
        pthread_mutex_unlock(&reg->lock);
        return HX_E_NOREGION;
    }
    if (len == 0 || off > r->len || len > r->len - off) {
        pthread_mutex_unlock(&reg->lock);
        return HX_E_BOUNDS;
    }
    uint8_t *base = r->base + off;
    struct ibv_pd *pd = v->api.alloc_pd(v->ctx);
    struct ibv_mr *mr = pd ? v->api.reg_mr(pd, base, len, rights) : NULL;
    pthread_mutex_unlock(&reg->lock);
    if (!mr) {
        VB_FAIL("registering %llu bytes for export failed: %s (is the memlock limit too low?)",
                (unsigned long long)len, strerror(errno));
        if (pd)
            v->api.dealloc_pd(pd);
        return HX_E_SYS;
    }
    struct ibv_qp *qp = vb_create_qp(v, pd, rights);
    vqp *q = qp ? vb_vqp_new(a, true, session, qp) : NULL;
    if (!q) {
        if (qp)
            v->api.destroy_qp(qp);
        v->api.dereg_mr(mr);
        v->api.dealloc_pd(pd);
        return HX_E_SYS;
    }
    q->own_pd = pd;
    q->export_mr = mr;
    q->lpsn = vb_random_psn();
    *qpn = qp->qp_num;
    *psn = q->lpsn;
    *addr = (uint64_t)(uintptr_t)base;
    *rkey = mr->rkey;
    return HX_OK;
}

int hx_verbs_export_connect(hx_agent *a, uint64_t session, uint32_t qpn, uint32_t psn, const uint8_t *gid,
                            uint16_t lid, int mtu)
{
    hx_verbs *v = V(a);
    if (!v)
        return HX_E_INVAL;
    pthread_mutex_lock(&v->lock);
    vqp *q = v->qps;
    while (q && !(q->target && q->session == session && q->export_mr))
        q = q->next_all;
    int rc = HX_E_INVAL;
    if (q && !q->rmr) { /* not connected yet: an RC QP connects once */
        rc = vb_connect_qp(v, q->qp, qpn, psn, q->lpsn, gid, lid, mtu);
        if (rc == HX_OK && vb_post_receives(v, q) < 0)
            rc = HX_E_SYS;
        if (rc != HX_OK)
            vb_qp_to_error(v, q);
    } else {
        VB_FAIL(q ? "this export is connected already" : "no such export");
    }
    pthread_mutex_unlock(&v->lock);
    return rc;
}

hx_peer *hx_verbs_raw_peer_new(hx_agent *a, uint32_t *qpn, uint32_t *psn, int *status)
{
    hx_verbs *v = V(a);
    if (!v) {
        *status = HX_E_INVAL;
        return NULL;
    }
    struct ibv_qp *qp = vb_create_qp(v, v->pd, 0);
    vqp *q = qp ? vb_vqp_new(a, false, 0, qp) : NULL;
    if (!q) {
        if (qp)
            v->api.destroy_qp(qp);
        *status = HX_E_SYS;
        return NULL;
    }
    *qpn = qp->qp_num;
    *psn = q->lpsn = vb_random_psn();
    *status = HX_OK;
    return &q->base;
}

#endif
