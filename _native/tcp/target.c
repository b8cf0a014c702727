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
    conn *c = tcp_conn_add(a, fd, true, session, &status);
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
        return -2;
    }
    tcp_put_resp(f->hdr, &(tcp_resp){.kind = kind, .status = status, .op_id = op_id, .len = len});
    f->hdrlen = RESP_SIZE;
    f->data = data;
    f->datalen = len;
    f->region = region;
    pthread_mutex_lock(&c->lock);
    tcp_append_locked(c, f, f, 1);
    int rc = tcp_flush_locked(a, c);
    pthread_mutex_unlock(&c->lock);
    return rc < 0 ? -2 : 0;
}

/* A request header is complete: check it, then set up its payload or answer it. */
int tcp_target_request(hx_agent *a, conn *c)
{
    tcp_req q;
    if (tcp_get_req(c->rhdr, &q) < 0)
        return -1;
    uint8_t *ptr = NULL;
    hx_region *r = NULL;
    if (q.op == W_GET) {
        int rc = hx_reg_acquire(&a->regs, q.region, &q.key, q.off, q.len, HX_ACCESS_REMOTE_READ, &ptr, &r);
        if (rc != HX_OK)
            return enqueue_response(a, c, R_DATA, rc, q.op_id, NULL, 0, NULL);
        return enqueue_response(a, c, R_DATA, HX_OK, q.op_id, ptr, q.len, r);
    }
    c->rstatus = hx_reg_acquire(&a->regs, q.region, &q.key, q.off, q.len, HX_ACCESS_REMOTE_WRITE, &ptr, &r);
    c->rregion = c->rstatus == HX_OK ? r : NULL;
    c->rdst = c->rstatus == HX_OK ? ptr : NULL;
    c->rlen = q.len;
    c->rdone = 0;
    c->rop_id = q.op_id;
    c->in_payload = true;
    T(a)->io->payloads++;
    return 0;
}

int tcp_target_payload_done(hx_agent *a, conn *c)
{
    if (c->rregion) {
        hx_region_release(c->rregion);
        c->rregion = NULL;
    }
    c->in_payload = false;
    T(a)->io->payloads--;
    return enqueue_response(a, c, R_ACK, c->rstatus, c->rop_id, NULL, 0, NULL);
}
