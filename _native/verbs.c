/* The verbs transport: RDMA over RC queue pairs (libibverbs).
 *
 * libibverbs is loaded with dlopen when an agent opens a device, so the
 * module imports, and every other transport works, on machines without it.
 *
 * One protection domain, one completion queue and one completion channel per
 * agent; one RC queue pair per peer and direction. A put is an RDMA WRITE (or
 * WRITE WITH IMM), a get an RDMA READ; an op is one chain of work requests
 * posted with one doorbell, only the last signalled. Every work request of a
 * chain carries the op in wr_id (low bit set on the last), so an error on any
 * of them is charged to its op. A native thread polls the CQ (a short spin,
 * then blocks on the completion channel) and feeds the agent's completion
 * ring. A QP in error fails every op outstanding on it: their memory is only
 * released when the flushed completions come back.
 */
#include "internal.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef HX_HAVE_VERBS

int hx_verbs_built(void) { return 0; }
int hx_verbs_open(hx_agent *a, const char *dev, int port, int gid_index, int timeout, int retry_cnt)
{
    (void)a; (void)dev; (void)port; (void)gid_index; (void)timeout; (void)retry_cnt;
    return HX_E_SYS;
}
const char *hx_verbs_error(void) { return "aiohixl was built without rdma-core headers (libibverbs-dev)"; }
int hx_verbs_local(hx_agent *a, uint8_t *gid, uint16_t *lid, int *mtu) { (void)a; (void)gid; (void)lid; (void)mtu; return HX_E_SYS; }
int hx_verbs_reg(hx_agent *a, uint32_t region, int readonly, uint32_t *rkey) { (void)a; (void)region; (void)readonly; (void)rkey; return HX_E_SYS; }
hx_peer *hx_verbs_peer_new(hx_agent *a, uint32_t *qpn, uint32_t *psn, int *status) { (void)a; (void)qpn; (void)psn; *status = HX_E_SYS; return NULL; }
int hx_verbs_peer_connect(hx_peer *p, uint32_t qpn, uint32_t psn, const uint8_t *gid, uint16_t lid, int mtu) { (void)p; (void)qpn; (void)psn; (void)gid; (void)lid; (void)mtu; return HX_E_SYS; }
int hx_verbs_accept(hx_agent *a, uint64_t session, uint32_t qpn, uint32_t psn, const uint8_t *gid, uint16_t lid, int mtu, uint32_t *lqpn, uint32_t *lpsn) { (void)a; (void)session; (void)qpn; (void)psn; (void)gid; (void)lid; (void)mtu; (void)lqpn; (void)lpsn; return HX_E_SYS; }
void hx_verbs_drop_session(hx_agent *a, uint64_t session) { (void)a; (void)session; }
int hx_verbs_post_imm(hx_peer *p, uint64_t op_id, const hx_sge *sges, uint32_t n, uint32_t imm) { (void)p; (void)op_id; (void)sges; (void)n; (void)imm; return HX_E_SYS; }
const hx_transport hx_verbs_transport = {.name = "verbs"};

#else

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define SQ_DEPTH 512
#define RQ_DEPTH 256          /* receives posted for WRITE WITH IMM notifications */
#define MAX_CHAIN (SQ_DEPTH / 2)
#define SPIN_NS 20000

static __thread char verbs_err[256];

int hx_verbs_built(void) { return 1; }

const char *hx_verbs_error(void) { return verbs_err; }

#define FAIL(...) snprintf(verbs_err, sizeof verbs_err, __VA_ARGS__)

/* The libibverbs entry points we call; the data path (post, poll, notify)
 * goes through the provider's function table and needs none of them. */
typedef struct {
    void *dl;
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *);
    int (*destroy_comp_channel)(struct ibv_comp_channel *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*destroy_qp)(struct ibv_qp *);
    int (*get_cq_event)(struct ibv_comp_channel *, struct ibv_cq **, void **);
    void (*ack_cq_events)(struct ibv_cq *, unsigned int);
} ibv_api;

typedef struct vop {
    struct vop *next;
    struct vqp *qp;
    uint64_t op_id;
    int status;
    uint32_t nwr;
    struct ibv_send_wr *wrs; /* kept until posted (pending ops) */
    struct ibv_sge *sgl;
    uint32_t nregions;
    hx_region *regions[];
} vop;

typedef struct vqp {
    hx_peer base; /* the initiator side is a peer Python posts to */
    struct vqp *next_all;
    struct ibv_qp *qp;
    bool target;
    uint64_t session;
    pthread_mutex_t lock;
    uint32_t wr_inflight;   /* posted and not yet completed */
    uint32_t ops_inflight;
    vop *pending_head, *pending_tail; /* waiting for room in the send queue */
    bool broken;
    uint32_t lpsn; /* our starting PSN, told to the other side */
} vqp;

typedef struct hx_verbs {
    ibv_api api;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    int port, gid_index, mtu;
    union ibv_gid gid;
    uint16_t lid;
    uint32_t max_msg;
    int timeout, retry_cnt;
    pthread_t thread;
    bool thread_started;
    int stop_fd;
    atomic_bool stop;
    pthread_mutex_t lock; /* the QP list */
    pthread_cond_t drained;
    vqp *qps;
} hx_verbs;

static hx_verbs *V(hx_agent *a) { return a->state[HX_TRANSPORT_VERBS]; }

static int load_api(ibv_api *api)
{
    api->dl = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!api->dl) {
        FAIL("libibverbs not available: %s", dlerror());
        return -1;
    }
#define SYM(field, name)                                   \
    do {                                                   \
        *(void **)&api->field = dlsym(api->dl, name);      \
        if (!api->field) {                                 \
            FAIL("libibverbs lacks %s", name);             \
            return -1;                                     \
        }                                                  \
    } while (0)
    SYM(get_device_list, "ibv_get_device_list");
    SYM(free_device_list, "ibv_free_device_list");
    SYM(get_device_name, "ibv_get_device_name");
    SYM(open_device, "ibv_open_device");
    SYM(close_device, "ibv_close_device");
    SYM(query_port, "ibv_query_port");
    SYM(query_gid, "ibv_query_gid");
    SYM(alloc_pd, "ibv_alloc_pd");
    SYM(dealloc_pd, "ibv_dealloc_pd");
    SYM(reg_mr, "ibv_reg_mr");
    SYM(dereg_mr, "ibv_dereg_mr");
    SYM(create_comp_channel, "ibv_create_comp_channel");
    SYM(destroy_comp_channel, "ibv_destroy_comp_channel");
    SYM(create_cq, "ibv_create_cq");
    SYM(destroy_cq, "ibv_destroy_cq");
    SYM(create_qp, "ibv_create_qp");
    SYM(modify_qp, "ibv_modify_qp");
    SYM(destroy_qp, "ibv_destroy_qp");
    SYM(get_cq_event, "ibv_get_cq_event");
    SYM(ack_cq_events, "ibv_ack_cq_events");
#undef SYM
    return 0;
}

static int map_wc_status(enum ibv_wc_status s)
{
    switch (s) {
    case IBV_WC_SUCCESS:
        return HX_OK;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_ACCESS_ERR:
        return HX_E_ACCESS;
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_LOC_LEN_ERR:
        return HX_E_BOUNDS;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_WR_FLUSH_ERR:
        return HX_E_CONNLOST;
    default:
        return HX_E_REMOTE;
    }
}

/* ---------- memory regions ---------- */

static void release_mr(void *ctx, void *mr)
{
    hx_verbs *v = ctx;
    v->api.dereg_mr(mr);
}

int hx_verbs_reg(hx_agent *a, uint32_t region, int readonly, uint32_t *rkey)
{
    hx_verbs *v = V(a);
    if (!v)
        return HX_E_INVAL;
    hx_registry *reg = &a->regs;
    pthread_mutex_lock(&reg->lock);
    hx_region *r = hx_reg_find_locked(reg, region);
    if (!r || r->removed) {
        pthread_mutex_unlock(&reg->lock);
        return HX_E_NOREGION;
    }
    if (r->mr) {
        *rkey = ((struct ibv_mr *)r->mr)->rkey;
        pthread_mutex_unlock(&reg->lock);
        return HX_OK;
    }
    int access = readonly ? 0 : IBV_ACCESS_LOCAL_WRITE;
    if (r->access & HX_ACCESS_REMOTE_WRITE)
        access |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    if (r->access & HX_ACCESS_REMOTE_READ)
        access |= IBV_ACCESS_REMOTE_READ;
    /* A zero-length region still gets an MR of one byte's worth of nothing. */
    struct ibv_mr *mr = r->len ? v->api.reg_mr(v->pd, r->base, r->len, access) : NULL;
    if (!mr) {
        pthread_mutex_unlock(&reg->lock);
        FAIL("ibv_reg_mr of %llu bytes failed: %s (is the memlock limit too low?)",
             (unsigned long long)r->len, strerror(errno));
        return HX_E_SYS;
    }
    r->mr = mr;
    *rkey = mr->rkey;
    pthread_mutex_unlock(&reg->lock);
    return HX_OK;
}

/* ---------- queue pairs ---------- */

static struct ibv_qp *create_qp(hx_verbs *v)
{
    struct ibv_qp_init_attr ia = {
        .send_cq = v->cq, .recv_cq = v->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
        .cap = {.max_send_wr = SQ_DEPTH, .max_recv_wr = RQ_DEPTH, .max_send_sge = 1, .max_recv_sge = 1},
    };
    struct ibv_qp *qp = v->api.create_qp(v->pd, &ia);
    if (!qp) {
        FAIL("ibv_create_qp failed: %s", strerror(errno));
        return NULL;
    }
    struct ibv_qp_attr at = {.qp_state = IBV_QPS_INIT, .port_num = (uint8_t)v->port, .pkey_index = 0,
                             .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE};
    if (v->api.modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        FAIL("QP to INIT failed: %s", strerror(errno));
        v->api.destroy_qp(qp);
        return NULL;
    }
    return qp;
}

static int connect_qp(hx_verbs *v, struct ibv_qp *qp, uint32_t rqpn, uint32_t rpsn, uint32_t lpsn,
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
    if (v->api.modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                      IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
        FAIL("QP to RTR failed: %s", strerror(errno));
        return HX_E_SYS;
    }
    memset(&at, 0, sizeof at);
    at.qp_state = IBV_QPS_RTS;
    at.timeout = (uint8_t)v->timeout;
    at.retry_cnt = (uint8_t)v->retry_cnt;
    at.rnr_retry = 7;
    at.sq_psn = lpsn;
    at.max_rd_atomic = 16;
    if (v->api.modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                      IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) {
        FAIL("QP to RTS failed: %s", strerror(errno));
        return HX_E_SYS;
    }
    return HX_OK;
}

static void qp_to_error(hx_verbs *v, vqp *q)
{
    struct ibv_qp_attr at = {.qp_state = IBV_QPS_ERR};
    v->api.modify_qp(q->qp, &at, IBV_QP_STATE);
}

static uint32_t random_psn(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint32_t)(ts.tv_nsec ^ (ts.tv_sec << 7) ^ getpid()) & 0xffffff;
}

static int post_recvs(vqp *q, int n)
{
    for (int i = 0; i < n; i++) {
        struct ibv_recv_wr wr = {.wr_id = 0, .sg_list = NULL, .num_sge = 0}, *bad;
        if (ibv_post_recv(q->qp, &wr, &bad))
            return -1;
    }
    return 0;
}

static const hx_peer_ops verbs_ops;

static vqp *vqp_new(hx_agent *a, bool target, uint64_t session)
{
    hx_verbs *v = V(a);
    vqp *q = calloc(1, sizeof *q);
    if (!q)
        return NULL;
    q->qp = create_qp(v);
    if (!q->qp) {
        free(q);
        return NULL;
    }
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
    vqp *q = vqp_new(a, false, 0);
    if (!q) {
        *status = HX_E_SYS;
        return NULL;
    }
    *qpn = q->qp->qp_num;
    *psn = q->lpsn = random_psn();
    *status = HX_OK;
    return &q->base;
}

int hx_verbs_peer_connect(hx_peer *p, uint32_t qpn, uint32_t psn, const uint8_t *gid, uint16_t lid, int mtu)
{
    vqp *q = (vqp *)p;
    return connect_qp(V(p->agent), q->qp, qpn, psn, q->lpsn, gid, lid, mtu);
}

int hx_verbs_accept(hx_agent *a, uint64_t session, uint32_t qpn, uint32_t psn, const uint8_t *gid,
                    uint16_t lid, int mtu, uint32_t *lqpn, uint32_t *lpsn)
{
    hx_verbs *v = V(a);
    if (!v)
        return HX_E_INVAL;
    vqp *q = vqp_new(a, true, session);
    if (!q)
        return HX_E_SYS;
    *lqpn = q->qp->qp_num;
    *lpsn = random_psn();
    int rc = connect_qp(v, q->qp, qpn, psn, *lpsn, gid, lid, mtu);
    if (rc == HX_OK && post_recvs(q, RQ_DEPTH) < 0) {
        FAIL("ibv_post_recv failed");
        rc = HX_E_SYS;
    }
    if (rc != HX_OK) {
        pthread_mutex_lock(&q->lock);
        q->broken = true;
        pthread_mutex_unlock(&q->lock);
        qp_to_error(v, q);
    }
    return rc;
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
    v->api.destroy_qp(q->qp);
    pthread_mutex_destroy(&q->lock);
    free(q);
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

/* ---------- posting ---------- */

static void vop_finish(hx_agent *a, vop *op, int status)
{
    for (uint32_t i = 0; i < op->nregions; i++)
        hx_region_release(op->regions[i]);
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
static int post_chain(vqp *q, vop *op)
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

static int verbs_build(vqp *q, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n,
                       bool with_imm, uint32_t imm, vop **out)
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
            sgl[w] = (struct ibv_sge){.addr = (uintptr_t)(local + off), .length = (uint32_t)len, .lkey = lkey};
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
    } else if (post_chain(q, op)) {
        pthread_mutex_unlock(&q->lock);
        vop_discard(op);
        return HX_E_SYS;
    }
    pthread_mutex_unlock(&q->lock);
    return HX_POSTED;
}

static int verbs_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
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
    return rc == HX_OK ? verbs_submit((vqp *)p, op) : rc;
}

/* Ops that were never posted fail at once; posted ones come back flushed. */
static void fail_pending(hx_agent *a, vqp *q, int status)
{
    pthread_mutex_lock(&q->lock);
    vop *op = q->pending_head;
    q->pending_head = q->pending_tail = NULL;
    pthread_mutex_unlock(&q->lock);
    while (op) {
        vop *next = op->next;
        vop_finish(a, op, status);
        op = next;
    }
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
        qp_to_error(v, q);
    fail_pending(p->agent, q, status);
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

static const hx_peer_ops verbs_ops = {verbs_post, verbs_fail, verbs_destroy};

/* ---------- the completion thread ---------- */

static vqp *find_qp(hx_verbs *v, uint32_t qp_num)
{
    for (vqp *q = v->qps; q; q = q->next_all)
        if (q->qp->qp_num == qp_num)
            return q;
    return NULL;
}

static void on_send_wc(hx_agent *a, hx_verbs *v, struct ibv_wc *wc)
{
    vop *op = (vop *)(uintptr_t)(wc->wr_id & ~(uint64_t)1);
    bool last = wc->wr_id & 1;
    vqp *q = op->qp;
    if (wc->status != IBV_WC_SUCCESS) {
        int s = map_wc_status(wc->status);
        int failed = atomic_load(&q->base.failed);
        if (wc->status == IBV_WC_WR_FLUSH_ERR && failed)
            s = failed; /* flushed because we closed or gave up the peer */
        if (op->status == HX_OK)
            op->status = s;
        pthread_mutex_lock(&q->lock);
        bool was = q->broken;
        q->broken = true;
        pthread_mutex_unlock(&q->lock);
        if (!was) {
            int expected = 0;
            atomic_compare_exchange_strong(&q->base.failed, &expected, HX_E_CONNLOST);
            fail_pending(a, q, HX_E_CONNLOST);
        }
    }
    if (!last)
        return;
    pthread_mutex_lock(&q->lock);
    q->wr_inflight -= op->nwr;
    q->ops_inflight--;
    /* Room freed: post what waits, in order. */
    while (!q->broken && q->pending_head && q->wr_inflight + q->pending_head->nwr <= SQ_DEPTH) {
        vop *next = q->pending_head;
        q->pending_head = next->next;
        if (!q->pending_head)
            q->pending_tail = NULL;
        next->next = NULL;
        if (post_chain(q, next)) {
            pthread_mutex_unlock(&q->lock);
            vop_finish(a, next, HX_E_SYS);
            pthread_mutex_lock(&q->lock);
        }
    }
    if (q->ops_inflight == 0)
        pthread_cond_broadcast(&v->drained);
    pthread_mutex_unlock(&q->lock);
    vop_finish(a, op, op->status != HX_OK ? op->status : map_wc_status(wc->status));
}

static void on_recv_wc(hx_agent *a, hx_verbs *v, struct ibv_wc *wc)
{
    if (wc->status != IBV_WC_SUCCESS)
        return; /* flushed receives of a QP going away */
    if (wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM)
        hx_notify(a, ntohl(wc->imm_data), wc->byte_len);
    pthread_mutex_lock(&v->lock);
    vqp *q = find_qp(v, wc->qp_num);
    if (q && !q->broken)
        post_recvs(q, 1);
    pthread_mutex_unlock(&v->lock);
}

static int poll_some(hx_agent *a, hx_verbs *v)
{
    struct ibv_wc wcs[32];
    int n = ibv_poll_cq(v->cq, 32, wcs);
    for (int i = 0; i < n; i++) {
        /* opcode is undefined in error completions: receives are told apart
         * by their wr_id of 0. */
        if (wcs[i].wr_id == 0)
            on_recv_wc(a, v, &wcs[i]);
        else
            on_send_wc(a, v, &wcs[i]);
    }
    return n < 0 ? 0 : n;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *completion_main(void *arg)
{
    hx_agent *a = arg;
    hx_verbs *v = V(a);
    unsigned int unacked = 0;
    while (!atomic_load(&v->stop)) {
        /* A short spin catches the next completion of a burst without a wake-up. */
        uint64_t until = now_ns() + SPIN_NS;
        do {
            if (poll_some(a, v))
                until = now_ns() + SPIN_NS;
        } while (now_ns() < until && !atomic_load(&v->stop));
        ibv_req_notify_cq(v->cq, 0);
        if (poll_some(a, v))
            continue; /* arrived between the last poll and the arming */
        struct pollfd fds[2] = {{.fd = v->ch->fd, .events = POLLIN}, {.fd = v->stop_fd, .events = POLLIN}};
        if (poll(fds, 2, -1) < 0 && errno != EINTR)
            break;
        if (fds[0].revents & POLLIN) {
            struct ibv_cq *cq;
            void *ctx;
            if (v->api.get_cq_event(v->ch, &cq, &ctx) == 0 && ++unacked >= 64) {
                v->api.ack_cq_events(v->cq, unacked);
                unacked = 0;
            }
        }
    }
    if (unacked)
        v->api.ack_cq_events(v->cq, unacked);
    return NULL;
}

/* ---------- open / close ---------- */

int hx_verbs_open(hx_agent *a, const char *dev, int port, int gid_index, int timeout, int retry_cnt)
{
    if (V(a))
        return HX_OK;
    hx_verbs *v = calloc(1, sizeof *v);
    if (!v)
        return HX_E_NOMEM;
    v->stop_fd = -1;
    if (load_api(&v->api) < 0)
        goto fail;
    int num = 0;
    struct ibv_device **list = v->api.get_device_list(&num);
    if (!list || num == 0) {
        FAIL("no RDMA device");
        if (list)
            v->api.free_device_list(list);
        goto fail;
    }
    struct ibv_device *chosen = NULL;
    for (int i = 0; i < num; i++)
        if (!dev || !*dev || strcmp(v->api.get_device_name(list[i]), dev) == 0) {
            chosen = list[i];
            break;
        }
    if (!chosen) {
        FAIL("no RDMA device named %s", dev);
        v->api.free_device_list(list);
        goto fail;
    }
    v->ctx = v->api.open_device(chosen);
    v->api.free_device_list(list);
    if (!v->ctx) {
        FAIL("ibv_open_device failed: %s", strerror(errno));
        goto fail;
    }
    struct ibv_port_attr pa;
    memset(&pa, 0, sizeof pa);
    if (v->api.query_port(v->ctx, (uint8_t)port, &pa)) {
        FAIL("ibv_query_port(%d) failed: %s", port, strerror(errno));
        goto fail;
    }
    if (pa.state != IBV_PORT_ACTIVE) {
        FAIL("port %d is not active (state %d)", port, pa.state);
        goto fail;
    }
    v->max_msg = 1u << 30;
    if (pa.max_msg_sz && pa.max_msg_sz < v->max_msg)
        v->max_msg = pa.max_msg_sz;
    v->port = port;
    v->gid_index = gid_index;
    v->mtu = pa.active_mtu;
    v->lid = pa.lid;
    if (v->api.query_gid(v->ctx, (uint8_t)port, gid_index, &v->gid)) {
        FAIL("ibv_query_gid(%d) failed: %s", gid_index, strerror(errno));
        goto fail;
    }
    v->timeout = timeout;
    v->retry_cnt = retry_cnt;
    v->pd = v->api.alloc_pd(v->ctx);
    v->ch = v->pd ? v->api.create_comp_channel(v->ctx) : NULL;
    v->cq = v->ch ? v->api.create_cq(v->ctx, 4 * SQ_DEPTH, NULL, v->ch, 0) : NULL;
    if (!v->cq) {
        FAIL("creating the protection domain, completion channel or CQ failed: %s", strerror(errno));
        goto fail;
    }
    fcntl(v->ch->fd, F_SETFL, fcntl(v->ch->fd, F_GETFL) | O_NONBLOCK);
    v->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    pthread_mutex_init(&v->lock, NULL);
    pthread_cond_init(&v->drained, NULL);
    atomic_init(&v->stop, false);
    a->state[HX_TRANSPORT_VERBS] = v;
    a->regs.release = release_mr;
    a->regs.release_ctx = v;
    if (pthread_create(&v->thread, NULL, completion_main, a) != 0) {
        FAIL("cannot start the completion thread");
        a->state[HX_TRANSPORT_VERBS] = NULL;
        a->regs.release = NULL;
        goto fail;
    }
    v->thread_started = true;
    return HX_OK;
fail:
    if (v->cq)
        v->api.destroy_cq(v->cq);
    if (v->ch)
        v->api.destroy_comp_channel(v->ch);
    if (v->pd)
        v->api.dealloc_pd(v->pd);
    if (v->ctx)
        v->api.close_device(v->ctx);
    if (v->stop_fd >= 0)
        close(v->stop_fd);
    if (v->api.dl)
        dlclose(v->api.dl);
    free(v);
    return HX_E_SYS;
}

int hx_verbs_local(hx_agent *a, uint8_t *gid, uint16_t *lid, int *mtu)
{
    hx_verbs *v = V(a);
    if (!v)
        return HX_E_INVAL;
    memcpy(gid, v->gid.raw, 16);
    *lid = v->lid;
    *mtu = v->mtu;
    return HX_OK;
}

/* Every QP to error; wait (bounded) for the flushed completions, so no op's
 * memory is released while the NIC may still touch it; stop the thread. */
static void verbs_shutdown(hx_agent *a)
{
    hx_verbs *v = V(a);
    if (!v || !v->thread_started)
        return;
    pthread_mutex_lock(&v->lock);
    for (vqp *q = v->qps; q; q = q->next_all) {
        int expected = 0;
        atomic_compare_exchange_strong(&q->base.failed, &expected, HX_E_CLOSED);
        pthread_mutex_lock(&q->lock);
        q->broken = true;
        pthread_mutex_unlock(&q->lock);
        qp_to_error(v, q);
    }
    vqp *all = v->qps;
    pthread_mutex_unlock(&v->lock);
    for (vqp *q = all; q; q = q->next_all)
        fail_pending(a, q, HX_E_CLOSED);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 5;
    for (vqp *q = all; q; q = q->next_all) {
        pthread_mutex_lock(&q->lock);
        while (q->ops_inflight) {
            /* drained is signalled under q->lock by the completion thread */
            if (pthread_cond_timedwait(&v->drained, &q->lock, &deadline) == ETIMEDOUT)
                break;
        }
        pthread_mutex_unlock(&q->lock);
    }
    atomic_store(&v->stop, true);
    uint64_t one = 1;
    ssize_t w = write(v->stop_fd, &one, sizeof one);
    (void)w;
    pthread_join(v->thread, NULL);
    v->thread_started = false;
}

static void verbs_free(hx_agent *a)
{
    hx_verbs *v = V(a);
    if (!v)
        return;
    verbs_shutdown(a);
    vqp *q = v->qps;
    while (q) {
        vqp *next = q->next_all;
        v->api.destroy_qp(q->qp);
        pthread_mutex_destroy(&q->lock);
        free(q);
        q = next;
    }
    v->qps = NULL;
    /* MRs go with the regions (hx_reg_destroy), before this is called. */
    v->api.destroy_cq(v->cq);
    v->api.destroy_comp_channel(v->ch);
    v->api.dealloc_pd(v->pd);
    v->api.close_device(v->ctx);
    close(v->stop_fd);
    dlclose(v->api.dl);
    free(v);
    a->state[HX_TRANSPORT_VERBS] = NULL;
}

const hx_transport hx_verbs_transport = {"verbs", NULL, verbs_shutdown, verbs_free};

#endif
