/* The initiator side of tcp: ops cut into request chunks, responses matched
 * to the oldest chunk outstanding. */
#include "tcp.h"
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HX_INLINE_SEND (256u * 1024u) /* bytes a submitting thread may send itself */
/* A put held for the caller's flush (HX_OP_HOLD): sizes where the cost of a
 * sendmsg and of an answer per op shows; larger ones gain nothing by it. */
#define HX_HOLD_MIN (32u * 1024u)
#define HX_HOLD_MAX HX_INLINE_SEND

static void op_discard(tcp_op *op, frame *first);

hx_peer *hx_tcp_connect_fd(hx_agent *a, int fd, int *status)
{
    conn *c = tcp_io_add(a, fd, &tcp_initiator_role, 0, status);
    if (!c) {
        close(fd);
        return NULL;
    }
    return &c->base;
}

/* Queues an op's frames and sends what fits on this thread: small ops go
 * out at once, the I/O thread streams the rest, so the caller's event loop
 * never waits on a big send. Frees them when the connection is gone. With
 * poll_ok, an op sent whole with nothing before it on the way (unanswered
 * ops held for it go out with it) is HX_POSTED_POLL: the answers to come
 * are this send's. Unless the last poll missed (poll_skip). */
static int submit(hx_agent *a, conn *c, frame *first, frame *last, int count, bool hold, uint64_t *done_at,
                  bool poll_ok)
{
    int rc = HX_POSTED;
    pthread_mutex_lock(&c->lock);
    if (c->broken) {
        rc = HX_E_CONNLOST;
    } else if (hold && (!done_at || c->unsent || c->answered != c->queued)) {
        /* Waits for the caller's flush, so that a burst goes out in few
         * sendmsg calls, the first op not alone; if the caller's event loop
         * is blocked meanwhile, the hold timer or an answer that wakes the
         * I/O thread sends it. Busy polling (done_at), an op with nothing
         * else on the way goes out now instead, and its answer is polled. */
        if (!c->unsent) {
            tcp_hold_arm(T(a)->io);
            c->held_since = tcp_now_ns();
        }
        tcp_append_locked(c, first, last, (uint32_t)count);
        rc = HX_POSTED_HELD;
    } else {
        /* Nothing is on the way (what is queued is unsent: held for this op),
         * so the answers to come are those of this send, and the last poll
         * caught its answers: the poster reads them (HX_POSTED_POLL). */
        bool poll = poll_ok && c->head == c->unsent;
        if (poll && c->poll_skip) {
            c->poll_skip--;
            poll = false;
        }
        tcp_append_locked(c, first, last, (uint32_t)count);
        /* Busy polling: the I/O thread is not woken for the answer (the flush
         * updates what it watches). Only one thread posts on a peer at a time. */
        c->polling = done_at != NULL || poll;
        c->poll_owed = 0;
        if (c->polling) {
            /* Before the send: its answer must wake nobody. Nor must what this
             * thread is about to send itself (EPOLLOUT would wake the I/O
             * thread only to wait for this lock); what the send leaves, the
             * flush hands to the I/O thread. */
            c->tx_self = true;
            tcp_update_interest(a, c);
            c->tx_self = false;
        }
        if (tcp_flush_budget(a, c, HX_INLINE_SEND) < 0) {
            /* The I/O thread fails this op with the rest. */
            atomic_store(&c->fail_req, HX_E_CONNLOST);
            tcp_io_wake(T(a)->io);
        } else if (done_at && !c->unsent) {
            *done_at = c->queued; /* all sent here: answered once this many frames are */
        } else if (poll && !c->unsent) {
            c->poll_owed = tcp_now_ns();
            tcp_hold_arm(T(a)->io);
            rc = HX_POSTED_POLL;
        } else if (c->polling) {
            c->polling = false;
            tcp_update_interest(a, c);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* Every frame up to done_at answered, or nothing more will be. */
static bool answered(conn *c, uint64_t done_at)
{
    pthread_mutex_lock(&c->lock);
    bool over = c->broken || c->answered >= done_at;
    pthread_mutex_unlock(&c->lock);
    return over;
}

/* Busy polling (Agent(busy_poll_us=...)): the op went out whole from this
 * thread; read its answer here for up to busy_ns rather than wait for the
 * I/O thread and the event loop's wake-up. Any answer that arrives meanwhile
 * is handled as the I/O thread would. HX_DONE_INLINE when the op succeeded
 * here (no completion follows), else HX_POSTED: the ring has it, or will. */
static int poll_answer(hx_agent *a, conn *c, uint64_t op_id, uint64_t done_at, uint64_t busy_ns, bool keep)
{
    uint64_t deadline = tcp_now_ns() + busy_ns;
    int fail = 0;
    tcp_inline_op = op_id;
    tcp_inline_done = false;
    pthread_mutex_lock(&c->rx_lock);
    while (!answered(c, done_at)) {
        fail = tcp_conn_read(a, c);
        if (fail != HX_OK)
            break;
        /* No yield once the answer is in: the yield may hand the core over. */
        if (tcp_inline_done || answered(c, done_at) || tcp_now_ns() >= deadline)
            break;
        sched_yield(); /* the target's thread may share this core (2 cores: it often does) */
    }
    pthread_mutex_unlock(&c->rx_lock);
    pthread_mutex_lock(&c->lock);
    if (keep && !fail && !c->broken && c->answered == c->queued) {
        /* All answered (hx_peer_flush): reading stays the poster's, as if an
         * op had gone out HX_POSTED_POLL now, so the next lone op needs no
         * epoll_ctl either way (two per op otherwise). The next op that is
         * not polled gives reading back; the hold timer does within
         * HOLD_MAX_NS if none comes. */
        c->poll_owed = tcp_now_ns();
        tcp_hold_arm(T(a)->io);
    } else {
        c->polling = false;
        tcp_update_interest(a, c); /* the I/O thread reads again: what comes later is its */
    }
    pthread_mutex_unlock(&c->lock);
    tcp_inline_op = 0;
    if (fail)
        tcp_peer_fail(&c->base, fail); /* the I/O thread fails the connection, this op with it */
    return tcp_inline_done ? HX_DONE_INLINE : HX_POSTED;
}

/* The request frame of a notification (a copy of its message), part of op:
 * delivered after the op dep (0: none) placed every byte. NULL: no memory. */
static frame *note_frame(tcp_op *op, uint64_t dep, const uint8_t *data, uint32_t len)
{
    frame *f = calloc(1, sizeof *f);
    uint8_t *copy = len ? malloc(len) : NULL;
    if (!f || (len && !copy)) {
        free(f);
        free(copy);
        return NULL;
    }
    if (len)
        memcpy(copy, data, len);
    tcp_put_req(f->hdr, &(tcp_req){.op = W_NOTE, .off = dep, .len = len, .op_id = op->op_id});
    f->hdrlen = REQ_SIZE;
    f->op = op;
    f->op_id = op->op_id;
    f->opcode = OP_NOTE;
    f->owned = copy;
    f->data = copy;
    f->datalen = len;
    return f;
}

static int tcp_note(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len, int flags)
{
    conn *c = (conn *)p;
    tcp_op *op = calloc(1, sizeof *op);
    if (!op)
        return HX_E_NOMEM;
    op->op_id = op_id;
    op->remaining = 1;
    frame *f = note_frame(op, dep, data, len);
    if (!f) {
        free(op);
        return HX_E_NOMEM;
    }
    /* Polled as a lone op is: behind its put (held for it, put(notify=)) it
     * goes out with it, and the poster reads both answers. */
    bool poll = (flags & HX_OP_POLL) && !T(p->agent)->busy_ns;
    int rc = submit(p->agent, c, f, f, 1, false, NULL, poll);
    if (rc != HX_POSTED && rc != HX_POSTED_POLL)
        op_discard(op, f);
    return rc;
}

int hx_test_tcp_poll_owed(hx_peer *p)
{
    conn *c = (conn *)p;
    pthread_mutex_lock(&c->lock);
    bool owed = c->polling && c->poll_owed;
    pthread_mutex_unlock(&c->lock);
    return owed;
}

/* The initiator's heartbeat: W_PING, answered R_PONG in order. */
static void beacon_locked(hx_agent *a, conn *c)
{
    frame *f = calloc(1, sizeof *f);
    if (!f)
        return; /* the next tick tries again */
    tcp_put_req(f->hdr, &(tcp_req){.op = W_PING});
    f->hdrlen = REQ_SIZE;
    f->opcode = OP_PING;
    tcp_append_locked(c, f, f, 1);
    tcp_flush_locked(a, c);
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}

/* CHECK frames for an op of more than one frame: the target checks every
 * piece before it places any, so a refused op leaves its memory untouched. */
static int check_frames(tcp_op *op, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n, frame **first,
                        frame **last, int *count)
{
    const uint32_t per = HX_TCP_CHUNK / CHECK_ENTRY;
    for (uint32_t start = 0; start < n; start += per) {
        uint32_t k = n - start < per ? n - start : per;
        frame *f = calloc(1, sizeof *f);
        uint8_t *e = calloc(k, CHECK_ENTRY);
        if (!f || !e) {
            free(f);
            free(e);
            return HX_E_NOMEM;
        }
        for (uint32_t i = 0; i < k; i++) {
            const hx_sge *s = &sges[start + i];
            put32(e + i * CHECK_ENTRY, s->remote_region);
            put64(e + i * CHECK_ENTRY + 8, s->remote_key);
            put64(e + i * CHECK_ENTRY + 16, s->remote_off);
            put64(e + i * CHECK_ENTRY + 24, s->len);
        }
        tcp_put_req(f->hdr, &(tcp_req){.op = W_CHECK,
                                       .region = opcode == HX_OP_PUT ? W_PUT : W_GET,
                                       .len = (uint64_t)k * CHECK_ENTRY,
                                       .op_id = op_id});
        f->hdrlen = REQ_SIZE;
        f->op = op;
        f->op_id = op_id;
        f->opcode = HX_OP_PUT; /* answered with an ack */
        f->owned = e;
        f->data = e;
        f->datalen = (uint64_t)k * CHECK_ENTRY;
        if (*last)
            (*last)->next = f;
        else
            *first = f;
        *last = f;
        (*count)++;
    }
    return HX_OK;
}

/* hx_peer_flush: what submit held goes out from this thread, the rest of it
 * (over HX_INLINE_SEND) from the I/O thread. When all of it went out here,
 * the answers are read here for up to FLUSH_POLL_NS (they go to the ring):
 * on loopback they mostly arrive within that, and two wake-ups (the I/O
 * thread's, then the event loop's) are saved. With nothing held, the answer
 * of an op submit called HX_POSTED_POLL is read for up to LONE_POLL_NS: the
 * event loop would block for it otherwise. Not in the latency mode, where
 * the I/O thread polls already. An answer read here to op_id (hx_peer_await)
 * makes it HX_DONE_INLINE, not a completion. */
static int tcp_flush(hx_peer *p, uint64_t op_id)
{
    conn *c = (conn *)p;
    hx_agent *a = p->agent;
    pthread_mutex_lock(&c->lock);
    uint64_t done_at = 0;
    bool held = c->unsent != NULL, lone = !held && c->answered < c->queued;
    /* A broken conn has let go of its frames (tail NULL) but not of its counts. */
    uint64_t poll_ns = !lone                                   ? FLUSH_POLL_NS
                       : c->tail && c->tail->opcode == OP_NOTE ? NOTE_POLL_NS
                                                               : LONE_POLL_NS;
    c->poll_owed = 0; /* this thread reads now, or hands reading back below */
    if (held && c->poll_skip) {
        c->poll_skip--;     /* the last poll missed: answers take longer than that here */
        c->polling = false; /* reading kept from an earlier poll goes back with the flush */
    } else
        c->polling = (held || lone) && !T(a)->busy_ns; /* the flush below stops the I/O thread reading */
    if (!c->broken && tcp_flush_budget(a, c, HX_INLINE_SEND) < 0) {
        atomic_store(&c->fail_req, HX_E_CONNLOST);
        tcp_io_wake(T(a)->io);
    } else if (c->polling && !c->unsent && !c->broken) {
        done_at = c->queued;
    }
    if (c->polling && !done_at) {
        c->polling = false;
        tcp_update_interest(a, c);
    }
    pthread_mutex_unlock(&c->lock);
    if (!done_at)
        return HX_POSTED;
    int rc = poll_answer(a, c, op_id, done_at, poll_ns, true);
    /* A peer whose answers take longer (another host) is not polled for
     * again until POLL_SKIP bursts later: the wait would only cost the loop. */
    pthread_mutex_lock(&c->lock);
    if (c->answered < done_at)
        c->poll_skip = POLL_SKIP;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* The request frames of one piece (local bytes at `local`), appended to
 * first..last; HX_E_NOMEM when one cannot be made. */
static int piece_frames(tcp_op *op, int opcode, const hx_sge *s, uint8_t *local, frame **first, frame **last,
                        int *count)
{
    for (uint64_t off = 0; off < s->len; off += HX_TCP_CHUNK) {
        uint64_t len = s->len - off < HX_TCP_CHUNK ? s->len - off : HX_TCP_CHUNK;
        frame *f = calloc(1, sizeof *f);
        if (!f)
            return HX_E_NOMEM;
        tcp_put_req(f->hdr, &(tcp_req){.op = opcode == HX_OP_PUT ? W_PUT : W_GET,
                                       .region = s->remote_region,
                                       .off = s->remote_off + off,
                                       .len = len,
                                       .op_id = op->op_id,
                                       .key = s->remote_key});
        f->hdrlen = REQ_SIZE;
        f->op = op;
        f->op_id = op->op_id;
        f->opcode = opcode;
        f->local = local + off;
        f->len = len;
        if (opcode == HX_OP_PUT) {
            f->data = local + off;
            f->datalen = len;
        }
        if (*last)
            (*last)->next = f;
        else
            *first = f;
        *last = f;
        (*count)++;
    }
    return HX_OK;
}

/* Frees an op that was never queued, and the frames made for it. */
static void op_discard(tcp_op *op, frame *first)
{
    while (first) {
        frame *next = first->next;
        free(first->owned);
        free(first);
        first = next;
    }
    for (uint32_t i = 0; i < op->nregions; i++)
        hx_region_release(op->regions[i]);
    free(op);
}

/* The request frames of op's pieces, appended to first..last, their local
 * regions held by op (made with room for n). */
static int op_frames(hx_agent *a, tcp_op *op, int opcode, const hx_sge *sges, uint32_t n, frame **first,
                     frame **last, int *count)
{
    int rc = HX_OK;
    uint64_t frames = 0;
    for (uint32_t i = 0; i < n; i++)
        frames += (sges[i].len + HX_TCP_CHUNK - 1) / HX_TCP_CHUNK;
    if (frames > 1)
        rc = check_frames(op, opcode, op->op_id, sges, n, first, last, count);
    for (uint32_t i = 0; i < n && rc == HX_OK; i++) {
        uint8_t *local;
        rc = hx_region_acquire(a, sges[i].local_region, sges[i].local_off, sges[i].len, 0, &local,
                               &op->regions[op->nregions]);
        if (rc == HX_OK) {
            op->nregions++;
            rc = piece_frames(op, opcode, &sges[i], local, first, last, count);
        }
    }
    return rc;
}

/* Sends op's frames (or holds them, hold), polled (poll) or busy polled as
 * the agent asks; discards them if they cannot be queued. */
static int send_op(hx_agent *a, conn *c, tcp_op *op, frame *first, frame *last, int count, bool hold,
                   bool poll)
{
    op->remaining = count;
    uint64_t busy_ns = T(a)->busy_ns, done_at = 0;
    int rc = submit(a, c, first, last, count, hold, busy_ns ? &done_at : NULL, poll && !busy_ns);
    if (rc == HX_POSTED_HELD || rc == HX_POSTED_POLL)
        return rc;
    if (rc == HX_POSTED)
        return done_at ? poll_answer(a, c, op->op_id, done_at, busy_ns, false) : HX_POSTED;
    op_discard(op, first);
    return rc;
}

static int tcp_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
{
    conn *c = (conn *)p;
    hx_agent *a = p->agent;
    bool hold = opcode & HX_OP_HOLD, note_next = opcode & HX_OP_NOTE_NEXT, poll = opcode & HX_OP_POLL;
    opcode &= ~(HX_OP_HOLD | HX_OP_NOTE_NEXT | HX_OP_POLL);
    tcp_op *op = calloc(1, sizeof *op + n * sizeof(hx_region *));
    if (!op)
        return HX_E_NOMEM;
    op->op_id = op_id;
    frame *first = NULL, *last = NULL;
    int count = 0;
    int rc = op_frames(a, op, opcode, sges, n, &first, &last, &count);
    if (rc != HX_OK) {
        op_discard(op, first);
        return rc;
    }
    uint64_t payload = 0;
    for (uint32_t i = 0; opcode == HX_OP_PUT && i < n; i++)
        payload += sges[i].len;
    /* With its notification next, an op goes out in one sendmsg with it and
     * is answered with it: one wake-up at each end, not two. */
    hold = hold && payload <= HX_HOLD_MAX && (payload >= HX_HOLD_MIN || note_next);
    return send_op(a, c, op, first, last, count, hold, poll);
}

/* A put and its notification as one op (hx_peer_put_note): the message's
 * frame behind the put's, the op answered once both are; a put the target
 * refused has the message dropped and answered with the put's failure. */
static int tcp_post_note(hx_peer *p, int flags, uint64_t op_id, const hx_sge *sge, const uint8_t *data,
                         uint32_t len)
{
    conn *c = (conn *)p;
    hx_agent *a = p->agent;
    tcp_op *op = calloc(1, sizeof *op + sizeof(hx_region *));
    if (!op)
        return HX_E_NOMEM;
    op->op_id = op_id;
    frame *first = NULL, *last = NULL;
    int count = 0;
    int rc = op_frames(a, op, HX_OP_PUT, sge, 1, &first, &last, &count);
    frame *f = rc == HX_OK ? note_frame(op, op_id, data, len) : NULL;
    if (!f) {
        op_discard(op, first);
        return rc == HX_OK ? HX_E_NOMEM : rc;
    }
    if (last)
        last->next = f;
    else
        first = f;
    return send_op(a, c, op, first, f, count + 1, false, flags & HX_OP_POLL);
}

static int sanitize_remote_status(int32_t s)
{
    switch (s) {
    case HX_OK:
    case HX_E_BOUNDS:
    case HX_E_ACCESS:
    case HX_E_NOREGION:
        return s;
    default:
        return HX_E_REMOTE;
    }
}

static void chunk_done(hx_agent *a, conn *c, frame *f, int status)
{
    pthread_mutex_lock(&c->lock);
    c->answered++;
    c->head = f->next;
    if (!c->head)
        c->tail = NULL;
    pthread_mutex_unlock(&c->lock);
    tcp_frame_free(a, f, status);
}

/* A response header is complete: it answers the oldest chunk sent. */
static int response(hx_agent *a, conn *c)
{
    tcp_resp r;
    if (tcp_get_resp(c->rhdr, &r) != HX_OK)
        return HX_E_PROTO;
    if (r.kind == R_ALIVE)
        return r.len == 0 ? HX_OK : HX_E_PROTO; /* the target's heartbeat: answers nothing */
    pthread_mutex_lock(&c->lock);
    frame *f = c->head;
    bool sent = f && f != c->unsent;
    pthread_mutex_unlock(&c->lock);
    if (!sent || r.op_id != f->op_id)
        return HX_E_PROTO; /* an answer to nothing we asked */
    int status = sanitize_remote_status(r.status);
    if (f->opcode == OP_PING || f->opcode == HX_OP_PUT || f->opcode == OP_NOTE) {
        int kind = f->opcode == OP_PING ? R_PONG : R_ACK;
        if (r.kind != kind || r.len != 0)
            return HX_E_PROTO;
        chunk_done(a, c, f, f->opcode == OP_PING ? HX_OK : status);
        return HX_OK;
    }
    if (r.kind != R_DATA || r.len != (status == HX_OK ? f->len : 0))
        return HX_E_PROTO;
    if (status != HX_OK) {
        chunk_done(a, c, f, status);
        return HX_OK;
    }
    c->rframe = f;
    c->rdst = f->local;
    c->rlen = r.len;
    c->rdone = 0;
    c->in_payload = true;
    return HX_OK;
}

/* A GET's data has all arrived in place. */
static int payload_done(hx_agent *a, conn *c)
{
    c->in_payload = false;
    frame *f = c->rframe;
    c->rframe = NULL;
    c->rdst = NULL;
    chunk_done(a, c, f, HX_OK);
    return HX_OK;
}

static const hx_peer_ops tcp_ops = {.post = tcp_post,
                                    .note = tcp_note,
                                    .post_note = tcp_post_note,
                                    .flush = tcp_flush,
                                    .fail = tcp_peer_fail,
                                    .destroy = tcp_peer_destroy,
                                    .transport = HX_TRANSPORT_TCP};

const tcp_role tcp_initiator_role = {.target = false,
                                     .header_size = RESP_SIZE,
                                     .header = response,
                                     .payload_done = payload_done,
                                     .beacon_locked = beacon_locked,
                                     .peer_ops = &tcp_ops};
