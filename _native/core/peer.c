/* Peers: what every transport's peers share (post checks, close, failure). */
#include "internal.h"

void hx_peer_init(hx_peer *p, hx_agent *a, const hx_peer_ops *ops)
{
    p->ops = ops;
    p->agent = a;
    p->id = atomic_fetch_add(&a->next_peer_id, 1);
    atomic_init(&p->closed, false);
    atomic_init(&p->failed, 0);
    atomic_init(&p->heard_with, 0);
}

void hx_peer_heard_with(hx_peer *p, hx_peer *channel)
{
    if (p && channel && p != channel)
        atomic_store(&p->heard_with, channel->id);
}

void hx_heard(hx_agent *a, uint64_t peer_id, uint64_t session, uint64_t now_ns)
{
    for (int i = 0; i < HX_NTRANSPORTS; i++)
        if (hx_transports[i]->heard)
            hx_transports[i]->heard(a, peer_id, session, now_ns);
}

/* Counts a post: the op and its bytes once accepted, an error when refused. */
void hx_stat_post(hx_peer *p, const hx_sge *sges, uint32_t n, int rc)
{
    int t = p->ops->transport;
    if (rc < 0) {
        hx_stat_error(p->agent, t);
        return;
    }
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; i++)
        bytes += sges[i].len;
    atomic_fetch_add_explicit(&p->agent->stats.ops[t], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->agent->stats.bytes[t], bytes, memory_order_relaxed);
}

/* 0 while p takes ops, else the status a post fails with. */
static int peer_refuses(hx_peer *p)
{
    if (atomic_load(&p->closed))
        return HX_E_CLOSED;
    return atomic_load(&p->failed);
}

static hx_sge one_sge(uint32_t local_region, uint64_t local_off, uint32_t remote_region, uint64_t remote_off,
                      uint64_t len, uint64_t remote_key)
{
    return (hx_sge){.local_region = local_region,
                    .remote_region = remote_region,
                    .local_off = local_off,
                    .remote_off = remote_off,
                    .len = len,
                    .remote_key = remote_key};
}

static void count_note(hx_peer *p, int rc)
{
    if (rc >= 0)
        atomic_fetch_add_explicit(&p->agent->stats.notes_sent, 1, memory_order_relaxed);
}

int hx_peer_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
{
    int refused = peer_refuses(p);
    if (refused)
        return refused;
    int op = opcode & ~(HX_OP_HOLD | HX_OP_NOTE_NEXT | HX_OP_POLL);
    if (op != HX_OP_PUT && op != HX_OP_GET)
        return HX_E_INVAL;
    if (n == 0)
        return HX_E_INVAL;
    int rc = p->ops->post(p, p->ops->flush ? opcode : op, op_id, sges, n);
    hx_stat_post(p, sges, n, rc);
    return rc;
}

int hx_peer_post1(hx_peer *p, int opcode, uint64_t op_id, uint32_t local_region, uint64_t local_off,
                  uint32_t remote_region, uint64_t remote_off, uint64_t len, uint64_t remote_key)
{
    hx_sge sge = one_sge(local_region, local_off, remote_region, remote_off, len, remote_key);
    return hx_peer_post(p, opcode, op_id, &sge, 1);
}

int hx_peer_note(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len, int flags)
{
    int refused = peer_refuses(p);
    if (refused)
        return refused;
    if (len > HX_NOTE_MAX || !p->ops->note)
        return HX_E_INVAL;
    int rc = p->ops->note(p, op_id, dep, data, len, flags);
    count_note(p, rc);
    return rc;
}

int hx_peer_put_note(hx_peer *p, int flags, uint64_t op_id, uint32_t local_region, uint64_t local_off,
                     uint32_t remote_region, uint64_t remote_off, uint64_t len, uint64_t remote_key,
                     const uint8_t *data, uint32_t dlen)
{
    int refused = peer_refuses(p);
    if (refused)
        return refused;
    if (dlen > HX_NOTE_MAX || !p->ops->post_note)
        return HX_E_INVAL;
    hx_sge sge = one_sge(local_region, local_off, remote_region, remote_off, len, remote_key);
    int rc = p->ops->post_note(p, flags & HX_OP_POLL, op_id, &sge, data, dlen);
    hx_stat_post(p, &sge, 1, rc);
    count_note(p, rc);
    return rc;
}

int hx_peer_await(hx_peer *p, uint64_t op_id)
{
    if (!p->ops->flush)
        return HX_POSTED;
    hx_agent *a = p->agent;
    hx_hush(a);
    int rc = p->ops->flush(p, op_id);
    if (rc == HX_DONE_INLINE && (!hx_ring_empty(a) || hx_agent_notes_ready(a))) {
        /* The caller drains anyway: op_id goes with the rest, so that one
         * answer says all. */
        hx_complete(a, op_id, HX_OK);
        rc = HX_POSTED;
    }
    hx_hush(NULL);
    return rc;
}

/* hx_peer_await for no op: op ids start at 1, so none ends inline. */
void hx_peer_flush(hx_peer *p) { (void)hx_peer_await(p, 0); }

void hx_peer_close(hx_peer *p)
{
    if (atomic_exchange(&p->closed, true))
        return;
    hx_peer_fail(p, HX_E_CLOSED);
}

void hx_peer_fail(hx_peer *p, int status)
{
    if (status >= 0)
        status = HX_E_CONNLOST;
    int expected = 0;
    if (atomic_compare_exchange_strong(&p->failed, &expected, status))
        p->ops->fail(p, status);
}

int hx_peer_status(hx_peer *p) { return atomic_load(&p->failed); }

void hx_peer_free(hx_peer *p)
{
    if (!p)
        return;
    hx_peer_close(p);
    p->ops->destroy(p);
}
