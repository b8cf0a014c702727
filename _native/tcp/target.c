/* The target side of tcp: requests checked against the agent's registry,
 * answered in order. */
#include "tcp.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int hx_tcp_serve_fd(hx_agent *a, int fd, uint64_t session, const uint8_t *first, uint32_t first_len)
{
    frame *f = NULL;
    if (first_len) {
        f = calloc(1, sizeof *f);
        uint8_t *copy = malloc(first_len);
        if (!f || !copy) {
            free(f);
            free(copy);
            close(fd);
            return HX_E_NOMEM;
        }
        memcpy(copy, first, first_len);
        f->owned = copy;
        f->data = copy;
        f->datalen = first_len;
    }
    int status;
    /* The first bytes are queued before the I/O thread can see the conn. */
    conn *c = tcp_io_add(a, fd, &tcp_target_role, session, &status);
    if (!c) {
        close(fd);
        free(f ? f->owned : NULL);
        free(f);
        return status;
    }
    if (f) {
        pthread_mutex_lock(&c->lock);
        tcp_append_locked(c, f, f, 1);
        int rc = tcp_flush_locked(a, c);
        pthread_mutex_unlock(&c->lock);
        if (rc < 0) {
            atomic_store(&c->fail_req, HX_E_CONNLOST);
            tcp_io_wake(T(a)->io);
        }
    }
    return HX_OK;
}

void hx_tcp_drop_session(hx_agent *a, uint64_t session)
{
    tcp_agent *t = T(a);
    pthread_mutex_lock(&t->lock);
    tcp_io *io = t->io;
    bool any = false;
    if (io && !io->stopped)
        for (conn *c = io->conns; c; c = c->next_all)
            if (c->target && c->session == session) {
                atomic_store(&c->fail_req, HX_E_CONNLOST);
                any = true;
            }
    pthread_mutex_unlock(&t->lock);
    if (any)
        tcp_io_wake(io);
}

static int enqueue_response(hx_agent *a, conn *c, int kind, int status, uint64_t op_id, const uint8_t *data,
                            uint64_t len, hx_region *region)
{
    frame *f = calloc(1, sizeof *f);
    if (!f) {
        if (region)
            hx_region_release(region);
        return HX_E_CONNLOST;
    }
    tcp_put_resp(f->hdr, &(tcp_resp){.kind = kind, .status = status, .op_id = op_id, .len = len});
    f->hdrlen = RESP_SIZE;
    f->data = data;
    f->datalen = len;
    f->region = region;
    pthread_mutex_lock(&c->lock);
    tcp_append_locked(c, f, f, 1);
    int rc = c->reading ? HX_OK : tcp_flush_locked(a, c);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* A notification has all arrived: queue it with the agent, unless the op it
 * follows was refused; hold it (and stop reading) while the queue is full. */
static int note_done(hx_agent *a, conn *c)
{
    int status = HX_OK;
    if (c->note_dep && c->note_dep == c->refused_op) {
        status = c->refused_status;
    } else {
        int rc = hx_note_push(a, c->session, c->note_buf, c->note_len, 0, HX_NOTE_SERVED, 0);
        if (rc == HX_E_BUSY) {
            c->note_held = true;
            return HX_OK;
        }
        if (rc != HX_OK)
            status = HX_E_REMOTE;
        c->noted = rc == HX_OK;
    }
    c->note_held = false;
    c->rnote = false;
    return enqueue_response(a, c, R_ACK, status, c->note_id, NULL, 0, NULL);
}

static int note_retry(hx_agent *a, conn *c) { return c->note_held ? note_done(a, c) : HX_OK; }

static void begin_payload(hx_agent *a, conn *c, const tcp_req *q)
{
    c->rlen = q->len;
    c->rdone = 0;
    c->rop_id = q->op_id;
    c->in_payload = true;
    T(a)->io->payloads++;
}

/* A notification's header: its message is received into note_buf. */
static int note_request(hx_agent *a, conn *c, const tcp_req *q)
{
    c->rnote = true;
    c->note_id = q->op_id;
    c->note_dep = q->off;
    c->note_len = (uint32_t)q->len;
    if (q->len == 0)
        return note_done(a, c);
    c->rdst = c->note_buf;
    c->rregion = NULL;
    begin_payload(a, c, q);
    return HX_OK;
}

/* A CHECK's header: its entries are received, then checked (payload_done). */
static int check_request(hx_agent *a, conn *c, const tcp_req *q)
{
    c->rcheck = malloc(q->len);
    if (!c->rcheck)
        return HX_E_CONNLOST;
    c->rcheck_op = q->region;
    c->rstatus = HX_OK;
    c->rregion = NULL;
    c->rdst = c->rcheck;
    begin_payload(a, c, q);
    return HX_OK;
}

/* A piece of an op an earlier piece of which failed its check: nothing of it lands. */
static int refused_request(hx_agent *a, conn *c, const tcp_req *q)
{
    if (q->op == W_GET)
        return enqueue_response(a, c, R_DATA, c->refuse_status, q->op_id, NULL, 0, NULL);
    c->rstatus = c->refuse_status;
    c->rregion = NULL;
    c->rdst = NULL;
    begin_payload(a, c, q);
    return HX_OK;
}

/* A request header is complete: check it, then set up its payload or answer it. */
static int request(hx_agent *a, conn *c)
{
    tcp_req q;
    int rc = tcp_get_req(c->rhdr, &q);
    if (rc != HX_OK)
        return rc;
    c->rmore = c->rhdr[REQ_FLAGS] & REQ_MORE;
    if (q.op == W_PING)
        return enqueue_response(a, c, R_PONG, HX_OK, q.op_id, NULL, 0, NULL);
    T(a)->io->requests++;
    if (q.op == W_NOTE)
        return note_request(a, c, &q);
    uint8_t *ptr = NULL;
    hx_region *r = NULL;
    if (c->refusing && q.op_id != c->refuse_op_id)
        c->refusing = false; /* the refused op's frames are over */
    if (q.op == W_CHECK)
        return check_request(a, c, &q);
    if (c->refusing)
        return refused_request(a, c, &q);
    if (q.op == W_GET) {
        int rc = hx_reg_acquire(&a->regs, q.region, &q.key, q.off, q.len, HX_ACCESS_REMOTE_READ, &ptr, &r);
        if (rc != HX_OK)
            return enqueue_response(a, c, R_DATA, rc, q.op_id, NULL, 0, NULL);
        return enqueue_response(a, c, R_DATA, HX_OK, q.op_id, ptr, q.len, r);
    }
    c->rstatus = hx_reg_acquire(&a->regs, q.region, &q.key, q.off, q.len, HX_ACCESS_REMOTE_WRITE, &ptr, &r);
    c->rregion = c->rstatus == HX_OK ? r : NULL;
    c->rdst = c->rstatus == HX_OK ? ptr : NULL;
    begin_payload(a, c, &q);
    return HX_OK;
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }

/* Every piece of an op, checked before any of it is placed. */
static int check_entries(hx_agent *a, const uint8_t *e, uint64_t len, uint32_t op)
{
    uint32_t need = op == W_PUT ? HX_ACCESS_REMOTE_WRITE : HX_ACCESS_REMOTE_READ;
    for (uint64_t off = 0; off < len; off += CHECK_ENTRY) {
        uint64_t key = get64(e + off + 8);
        int rc = hx_reg_check(&a->regs, get32(e + off), &key, get64(e + off + 16), get64(e + off + 24), need);
        if (rc != HX_OK)
            return rc;
    }
    return HX_OK;
}

/* A payload has all arrived: a notification's, a CHECK's entries, or a PUT's bytes. */
static int payload_done(hx_agent *a, conn *c)
{
    c->in_payload = false;
    T(a)->io->payloads--;
    if (c->rnote)
        return note_done(a, c);
    if (c->rcheck) {
        int status = check_entries(a, c->rcheck, c->rlen, c->rcheck_op);
        free(c->rcheck);
        c->rcheck = NULL;
        c->rdst = NULL;
        if (status != HX_OK && !c->refusing) {
            c->refusing = true;
            c->refuse_op_id = c->rop_id;
            c->refuse_status = status;
        }
        if (c->refusing && c->refuse_op_id == c->rop_id)
            status = c->refuse_status;
        c->rstatus = status;
    }
    if (c->rregion) {
        hx_region_release(c->rregion);
        c->rregion = NULL;
    }
    if (c->rstatus != HX_OK) {
        /* A notification that follows this op must not be delivered. */
        c->refused_op = c->rop_id;
        c->refused_status = c->rstatus;
    }
    return enqueue_response(a, c, R_ACK, c->rstatus, c->rop_id, NULL, 0, NULL);
}

int hx_tcp_session_alive(hx_agent *a, uint64_t session)
{
    tcp_agent *t = T(a);
    int state = -1;
    pthread_mutex_lock(&t->lock);
    if (t->io)
        for (conn *c = t->io->conns; c; c = c->next_all)
            if (c->target && c->session == session) {
                if (!c->broken && !atomic_load(&c->fail_req)) {
                    state = 1;
                    break;
                }
                state = 0;
            }
    pthread_mutex_unlock(&t->lock);
    return state;
}

/* The target's heartbeat: R_ALIVE, which the initiator's matching skips. */
static void beacon_locked(hx_agent *a, conn *c)
{
    frame *f = calloc(1, sizeof *f);
    if (!f)
        return; /* the next tick tries again */
    tcp_put_resp(f->hdr, &(tcp_resp){.kind = R_ALIVE});
    f->hdrlen = RESP_SIZE;
    tcp_append_locked(c, f, f, 1);
    tcp_flush_locked(a, c);
}

const tcp_role tcp_target_role = {.target = true,
                                  .header_size = REQ_SIZE,
                                  .header = request,
                                  .payload_done = payload_done,
                                  .note_retry = note_retry,
                                  .beacon_locked = beacon_locked};
