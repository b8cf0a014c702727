/* The completion thread: polls the CQ (a short spin, then blocks on the
 * completion channel) and feeds the agent's completion ring. */
#include "verbs.h"

#ifdef HX_HAVE_VERBS
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <time.h>

#define SPIN_NS 20000

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

static vqp *find_qp(hx_verbs *v, uint32_t qp_num)
{
    for (vqp *q = v->qps; q; q = q->next_all)
        if (q->qp->qp_num == qp_num)
            return q;
    return NULL;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A successful completion on q: the remote QP, hence its process, is alive.
 * It counts as heard on q's control connection (the initiator's channel, a
 * target's session), so a peer whose process is late with its heartbeats
 * while its kernel or NIC still serves the QP (a loaded host: docs/rdma.md,
 * "Two guests") does not look silent. At most every HEARD_EVERY_NS per QP: the tcp side walks
 * its connections under a lock. Before the op completes, so no op's end is
 * seen before the liveness it proves. */
#define HEARD_EVERY_NS 20000000ull
static void heard(hx_agent *a, vqp *q)
{
    uint64_t with = q->target ? 0 : atomic_load_explicit(&q->base.heard_with, memory_order_relaxed);
    if (!with && !q->target)
        return;
    uint64_t now = now_ns();
    if (now - q->heard_ns < HEARD_EVERY_NS)
        return;
    q->heard_ns = now;
    hx_heard(a, with, q->target ? q->session : 0, now);
}

static void on_send_wc(hx_agent *a, hx_verbs *v, struct ibv_wc *wc)
{
    vop *op = (vop *)(uintptr_t)(wc->wr_id & ~(uint64_t)1);
    bool last = wc->wr_id & 1;
    vqp *q = op->qp;
    if (wc->status == IBV_WC_SUCCESS)
        heard(a, q);
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
            vb_fail_pending(a, q, HX_E_CONNLOST);
        }
    }
    if (!last)
        return;
    pthread_mutex_lock(&q->lock);
    q->wr_inflight -= op->nwr;
    q->ops_inflight--;
    if (op->note_slot >= 0)
        q->note_free |= 1ull << op->note_slot;
    /* Room freed: post what waits, in order. */
    while (!q->broken && q->pending_head && vb_fits(q, q->pending_head)) {
        vop *next = q->pending_head;
        q->pending_head = next->next;
        if (!q->pending_head)
            q->pending_tail = NULL;
        next->next = NULL;
        if (vb_post_chain(q, next)) {
            pthread_mutex_unlock(&q->lock);
            vb_vop_finish(a, next, HX_E_SYS);
            pthread_mutex_lock(&q->lock);
        }
    }
    if (q->ops_inflight == 0)
        pthread_cond_broadcast(&v->drained);
    pthread_mutex_unlock(&q->lock);
    vb_vop_finish(a, op, op->status != HX_OK ? op->status : map_wc_status(wc->status));
}

/* Queues one received message with the agent; false when its queue is full. */
static bool deliver(hx_agent *a, vqp *q, const struct vheld *h)
{
    const uint8_t *data = h->flags & HX_NOTE_IMM ? NULL : q->rbuf + (size_t)h->slot * HX_NOTE_MAX;
    uint32_t len = h->flags & HX_NOTE_IMM ? 0 : h->len;
    uint32_t nbytes = h->flags & HX_NOTE_IMM ? h->len : 0;
    int rc = hx_note_push(a, q->session, data, len, h->imm, h->flags, nbytes);
    if (rc == HX_E_BUSY)
        return false;
    if (rc != HX_OK)
        hx_note_dropped(a); /* out of memory: counted, never silent */
    if (!q->broken)
        vb_post_recv(q, h->slot);
    return true;
}

/* Caller holds v->lock. Delivers q's held messages in order while there is room. */
static void deliver_held(hx_agent *a, vqp *q)
{
    while (q->held_count && deliver(a, q, &q->held[q->held_head])) {
        q->held_head = (q->held_head + 1) % RQ_DEPTH;
        q->held_count--;
    }
}

static void on_recv_wc(hx_agent *a, hx_verbs *v, struct ibv_wc *wc)
{
    if (wc->status != IBV_WC_SUCCESS)
        return; /* flushed receives of a QP going away */
    pthread_mutex_lock(&v->lock);
    vqp *q = find_qp(v, wc->qp_num);
    if (q && !q->broken)
        heard(a, q); /* a SEND or WRITE WITH IMM of the session's initiator landed */
    if (q) {
        bool imm = wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM;
        struct vheld h = {.slot = (uint32_t)(wc->wr_id & ~RECV_TAG),
                          .len = wc->byte_len,
                          .imm = imm ? ntohl(wc->imm_data) : 0,
                          .flags = imm ? HX_NOTE_IMM : 0};
        /* Behind held ones, or when the queue is full: held in its buffer,
         * which is not reposted until the message is delivered. */
        if (q->held_count || !deliver(a, q, &h))
            q->held[(q->held_head + q->held_count++) % RQ_DEPTH] = h;
    }
    pthread_mutex_unlock(&v->lock);
}

void vb_note_space(hx_agent *a)
{
    hx_verbs *v = V(a);
    if (!v)
        return;
    pthread_mutex_lock(&v->lock);
    for (vqp *q = v->qps; q; q = q->next_all)
        if (q->target)
            deliver_held(a, q);
    pthread_mutex_unlock(&v->lock);
}

static int poll_some(hx_agent *a, hx_verbs *v)
{
    struct ibv_wc wcs[32];
    int n = ibv_poll_cq(v->cq, 32, wcs);
    for (int i = 0; i < n; i++) {
        /* opcode is undefined in error completions: receives are told apart
         * by their wr_id. */
        if (wcs[i].wr_id & RECV_TAG)
            on_recv_wc(a, v, &wcs[i]);
        else
            on_send_wc(a, v, &wcs[i]);
    }
    return n < 0 ? 0 : n;
}

void *vb_completion_main(void *arg)
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

#endif
