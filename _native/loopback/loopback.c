/* The loopback transport: source and destination are regions of one agent. */
#include "internal.h"
#include <stdlib.h>

static int lb_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
{
    return hx_copy_post(p, &p->agent->regs, 0, opcode, op_id, sges, n);
}

/* Ops of a loopback peer finish before the call that posts the next returns
 * or are awaited by Python first, so the message lands after its data. */
static int lb_note(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len, int flags)
{
    (void)op_id;
    (void)dep;
    (void)flags;
    int rc = hx_note_push(p->agent, 0, data, len, 0, 0, 0);
    return rc == HX_OK ? HX_DONE_INLINE : rc;
}

static void lb_fail(hx_peer *p, int status) { hx_pool_fail_peer(p->agent, p->id, status); }

static void lb_destroy(hx_peer *p) { free(p); }

static const hx_peer_ops loopback_ops = {.post = lb_post,
                                         .note = lb_note,
                                         .fail = lb_fail,
                                         .destroy = lb_destroy,
                                         .transport = HX_TRANSPORT_LOOPBACK};

/* No state of its own: its copies run on the agent's pool. */
const hx_transport hx_loopback_transport = {.name = "loopback"};

hx_peer *hx_loopback_new(hx_agent *a, int *status)
{
    hx_peer *p = calloc(1, sizeof *p);
    if (!p) {
        *status = HX_E_NOMEM;
        return NULL;
    }
    hx_peer_init(p, a, &loopback_ops);
    *status = HX_OK;
    return p;
}
