/* The tcp transport: one native I/O thread per agent (epoll) serves every tcp
 * connection, in both roles.
 *
 * Initiator: an op is cut into chunks of at most HX_TCP_CHUNK bytes, each a
 * request frame (a 40-byte header, then for a PUT the payload, sent straight
 * from the source memory with sendmsg). The target answers every request in
 * order, so responses are matched to the oldest outstanding chunk: no address
 * ever comes from the wire.
 *
 * Target: each request is checked against the registry (region alive, bounds,
 * right) before a byte is placed; a PUT payload is received straight into the
 * region, and acknowledged only once it is all there. A refused PUT's payload
 * is read into a scratch buffer and dropped. A frame that breaks the protocol
 * closes that connection and no other.
 */
#include "internal.h"
#include <endian.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sched.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define WIRE_MAGIC 0x50445848u /* "HXDP" little endian */
#define REQ_SIZE 40
#define RESP_SIZE 32
#define HX_TCP_CHUNK (1u << 20)
#define OUTQ_HIGH 512      /* target stops reading requests above this many queued responses */
#define MAX_IOV 64
#define SPIN_NS 200000      /* after activity, poll this long before blocking */
#define HX_INLINE_SEND (256u * 1024u) /* bytes a submitting thread may send itself */
/* A peer that stops in the middle of a PUT's payload for stall_ns is cut
 * off: the region it was writing is busy meanwhile, and Region.close() waits
 * for it. Live peers that merely have nothing to send are never affected. */

enum { W_PUT = 1, W_GET = 2 };
enum { R_ACK = 1, R_DATA = 2 };

typedef struct tcp_op {
    uint64_t op_id;
    int remaining;
    int status;
    uint32_t nregions;
    hx_region *regions[];
} tcp_op;

typedef struct frame {
    struct frame *next;
    uint8_t hdr[REQ_SIZE];
    uint32_t hdrlen;
    const uint8_t *data;
    uint64_t datalen;
    uint64_t sent;
    /* initiator chunk */
    tcp_op *op;
    uint8_t *local;
    uint64_t len;
    uint64_t op_id;
    int opcode;
    /* target response */
    hx_region *region; /* busy until the payload is sent */
    uint8_t *owned;    /* data we allocated (the first bytes of a served conn) */
} frame;

typedef struct conn {
    hx_peer base; /* initiator conns are the Python-visible peer */
    struct conn *next_all;
    int fd;
    bool target;
    uint64_t session;
    pthread_mutex_t lock;
    frame *head, *tail, *unsent;
    uint32_t outq;
    uint32_t events;
    bool broken;
    atomic_int fail_req;    /* a failure another thread asked for */
    atomic_bool freeing;    /* Python let go of the peer */
    /* receive state (I/O thread only) */
    uint8_t rhdr[REQ_SIZE];
    uint32_t rgot;
    bool in_payload;
    uint8_t *rdst;
    uint64_t rlen, rdone;
    int rstatus;
    hx_region *rregion;
    uint64_t rop_id;
    frame *rframe;
    uint64_t last_rx_ns;
} conn;

struct hx_io {
    int payloads; /* target conns in the middle of a PUT payload (I/O thread only) */
    int epfd;
    int evfd;
    pthread_t thread;
    atomic_bool stop;
    conn *conns; /* guarded by tcp_agent.lock */
    bool stopped;
};

/* The tcp transport's state in an agent (a->state[HX_TRANSPORT_TCP]). */
typedef struct tcp_agent {
    pthread_mutex_t lock;
    struct hx_io *io;  /* the I/O thread, started with the first connection */
    uint64_t stall_ns; /* a PUT payload silent this long ends its connection */
} tcp_agent;

static tcp_agent *T(hx_agent *a) { return a->state[HX_TRANSPORT_TCP]; }

static __thread uint8_t scratch[1 << 16]; /* payloads of refused PUTs go here */

static uint64_t now_ns(void);

/* ---------- helpers ---------- */

static void put32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }

static void io_wake(struct hx_io *io)
{
    uint64_t one = 1;
    ssize_t n = write(io->evfd, &one, sizeof one);
    (void)n;
}

static void update_interest(hx_agent *a, conn *c)
{
    if (c->broken)
        return;
    uint32_t want = EPOLLRDHUP;
    if (!c->target || c->outq < OUTQ_HIGH)
        want |= EPOLLIN;
    if (c->unsent)
        want |= EPOLLOUT;
    if (want != c->events) {
        struct epoll_event ev = {.events = want, .data.ptr = c};
        epoll_ctl(T(a)->io->epfd, EPOLL_CTL_MOD, c->fd, &ev);
        c->events = want;
    }
}

static void op_piece_done(hx_agent *a, tcp_op *op, int status)
{
    if (status != HX_OK && op->status == HX_OK)
        op->status = status;
    if (--op->remaining == 0) {
        for (uint32_t i = 0; i < op->nregions; i++)
            hx_region_release(op->regions[i]);
        hx_complete(a, op->op_id, op->status);
        free(op);
    }
}

static void frame_free(hx_agent *a, frame *f, int status)
{
    if (f->op)
        op_piece_done(a, f->op, status);
    if (f->region)
        hx_region_release(f->region);
    free(f->owned);
    free(f);
}

/* Sends what can be sent without blocking, at most budget bytes. Caller holds
 * c->lock. Returns 0, or -1 when the connection is broken. */
static int flush_budget(hx_agent *a, conn *c, uint64_t budget)
{
    while (c->unsent && !c->broken && budget) {
        struct iovec iov[MAX_IOV];
        int n = 0;
        for (frame *f = c->unsent; f && n + 2 <= MAX_IOV; f = f->next) {
            uint64_t s = f->sent;
            if (s < f->hdrlen) {
                iov[n].iov_base = f->hdr + s;
                iov[n++].iov_len = f->hdrlen - s;
                s = 0;
            } else
                s -= f->hdrlen;
            if (f->datalen > s) {
                iov[n].iov_base = (void *)(f->data + s);
                iov[n++].iov_len = f->datalen - s;
            }
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n};
        ssize_t w = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            return -1;
        }
        uint64_t left = (uint64_t)w;
        budget = budget > left ? budget - left : 0;
        while (left && c->unsent) {
            frame *f = c->unsent;
            uint64_t need = f->hdrlen + f->datalen - f->sent;
            uint64_t take = left < need ? left : need;
            f->sent += take;
            left -= take;
            if (f->sent < f->hdrlen + f->datalen)
                break;
            c->unsent = f->next;
            if (c->target) {
                /* A response is done once sent; requests wait for theirs. */
                c->head = f->next;
                if (!c->head)
                    c->tail = NULL;
                c->outq--;
                frame_free(a, f, HX_OK);
            }
        }
    }
    update_interest(a, c);
    return 0;
}

static int flush_locked(hx_agent *a, conn *c)
{
    return flush_budget(a, c, UINT64_MAX);
}

static void append_locked(conn *c, frame *first, frame *last, uint32_t count)
{
    if (c->tail)
        c->tail->next = first;
    else
        c->head = first;
    c->tail = last;
    if (!c->unsent)
        c->unsent = first;
    if (c->target)
        c->outq += count;
}

/* Ends a connection: every frame fails with status. I/O thread only. */
static void conn_fail(hx_agent *a, conn *c, int status)
{
    /* A local close or give-up, asked for before the socket broke (the peer
     * may close because we did), says why better than the socket does. */
    int failed = atomic_load(&c->base.failed);
    if (failed)
        status = failed;
    pthread_mutex_lock(&c->lock);
    if (c->broken) {
        pthread_mutex_unlock(&c->lock);
        return;
    }
    c->broken = true;
    frame *f = c->head;
    c->head = c->tail = c->unsent = NULL;
    c->outq = 0;
    pthread_mutex_unlock(&c->lock);
    epoll_ctl(T(a)->io->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    shutdown(c->fd, SHUT_RDWR);
    close(c->fd);
    c->fd = -1;
    while (f) {
        frame *next = f->next;
        frame_free(a, f, status);
        f = next;
    }
    if (c->rregion) {
        hx_region_release(c->rregion);
        c->rregion = NULL;
    }
    if (c->target && c->in_payload) {
        c->in_payload = false;
        T(a)->io->payloads--;
    }
}

/* ---------- target side ---------- */

static int enqueue_response(hx_agent *a, conn *c, int kind, int status, uint64_t op_id,
                            const uint8_t *data, uint64_t len, hx_region *region)
{
    frame *f = calloc(1, sizeof *f);
    if (!f) {
        if (region)
            hx_region_release(region);
        return -2;
    }
    put32(f->hdr, WIRE_MAGIC);
    f->hdr[4] = (uint8_t)kind;
    put32(f->hdr + 8, (uint32_t)status);
    put64(f->hdr + 16, op_id);
    put64(f->hdr + 24, len);
    f->hdrlen = RESP_SIZE;
    f->data = data;
    f->datalen = len;
    f->region = region;
    pthread_mutex_lock(&c->lock);
    append_locked(c, f, f, 1);
    int rc = flush_locked(a, c);
    pthread_mutex_unlock(&c->lock);
    return rc < 0 ? -2 : 0;
}

/* A request header is complete: check it, then set up its payload or answer it. */
static int target_request(hx_agent *a, conn *c)
{
    const uint8_t *h = c->rhdr;
    if (get32(h) != WIRE_MAGIC)
        return -1;
    int op = h[4];
    uint32_t region = get32(h + 8);
    uint64_t off = get64(h + 16), len = get64(h + 24), op_id = get64(h + 32);
    if ((op != W_PUT && op != W_GET) || len == 0 || len > HX_TCP_CHUNK)
        return -1;
    uint8_t *ptr = NULL;
    hx_region *r = NULL;
    if (op == W_GET) {
        int rc = hx_region_acquire(a, region, off, len, HX_ACCESS_REMOTE_READ, &ptr, &r);
        if (rc != HX_OK)
            return enqueue_response(a, c, R_DATA, rc, op_id, NULL, 0, NULL);
        return enqueue_response(a, c, R_DATA, HX_OK, op_id, ptr, len, r);
    }
    c->rstatus = hx_region_acquire(a, region, off, len, HX_ACCESS_REMOTE_WRITE, &ptr, &r);
    c->rregion = c->rstatus == HX_OK ? r : NULL;
    c->rdst = c->rstatus == HX_OK ? ptr : NULL;
    c->rlen = len;
    c->rdone = 0;
    c->rop_id = op_id;
    c->in_payload = true;
    T(a)->io->payloads++;
    return 0;
}

static int target_payload_done(hx_agent *a, conn *c)
{
    if (c->rregion) {
        hx_region_release(c->rregion);
        c->rregion = NULL;
    }
    c->in_payload = false;
    T(a)->io->payloads--;
    return enqueue_response(a, c, R_ACK, c->rstatus, c->rop_id, NULL, 0, NULL);
}

/* ---------- initiator side ---------- */

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
    c->head = f->next;
    if (!c->head)
        c->tail = NULL;
    pthread_mutex_unlock(&c->lock);
    frame_free(a, f, status);
}

static int initiator_response(hx_agent *a, conn *c)
{
    const uint8_t *h = c->rhdr;
    if (get32(h) != WIRE_MAGIC)
        return -1;
    pthread_mutex_lock(&c->lock);
    frame *f = c->head;
    bool sent = f && f != c->unsent;
    pthread_mutex_unlock(&c->lock);
    if (!sent)
        return -1; /* an answer to nothing we asked */
    int kind = h[4];
    int status = sanitize_remote_status((int32_t)get32(h + 8));
    uint64_t op_id = get64(h + 16), len = get64(h + 24);
    if (op_id != f->op_id)
        return -1;
    if (f->opcode == HX_OP_PUT) {
        if (kind != R_ACK || len != 0)
            return -1;
        chunk_done(a, c, f, status);
        return 0;
    }
    if (kind != R_DATA || len != (status == HX_OK ? f->len : 0))
        return -1;
    if (status != HX_OK) {
        chunk_done(a, c, f, status);
        return 0;
    }
    c->rframe = f;
    c->rdst = f->local;
    c->rlen = len;
    c->rdone = 0;
    c->in_payload = true;
    return 0;
}

/* ---------- reading (I/O thread) ---------- */

/* Reads until the socket is drained. Returns -1 to fail with a protocol
 * error, -2 when the connection is gone, 0 otherwise. */
static int conn_read(hx_agent *a, conn *c)
{
    for (;;) {
        if (c->target && c->outq >= OUTQ_HIGH)
            return 0; /* back-pressure: answer first */
        ssize_t r;
        if (c->in_payload) {
            uint8_t *dst = c->rdst ? c->rdst + c->rdone : scratch;
            uint64_t want = c->rlen - c->rdone;
            if (!c->rdst && want > sizeof scratch)
                want = sizeof scratch;
            r = recv(c->fd, dst, want, MSG_DONTWAIT);
        } else {
            uint32_t size = c->target ? REQ_SIZE : RESP_SIZE;
            r = recv(c->fd, c->rhdr + c->rgot, size - c->rgot, MSG_DONTWAIT);
        }
        if (r == 0)
            return -2;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            return -2;
        }
        if (c->target)
            c->last_rx_ns = now_ns();
        if (c->in_payload) {
            c->rdone += (uint64_t)r;
            if (c->rdone < c->rlen)
                continue;
            if (c->target) {
                int rc = target_payload_done(a, c);
                if (rc < 0)
                    return rc;
            } else {
                c->in_payload = false;
                frame *f = c->rframe;
                c->rframe = NULL;
                c->rdst = NULL;
                chunk_done(a, c, f, HX_OK);
            }
            continue;
        }
        c->rgot += (uint32_t)r;
        uint32_t size = c->target ? REQ_SIZE : RESP_SIZE;
        if (c->rgot < size)
            continue;
        c->rgot = 0;
        int rc = c->target ? target_request(a, c) : initiator_response(a, c);
        if (rc < 0)
            return rc;
    }
}

/* ---------- the I/O thread ---------- */

static void conn_destroy(conn *c)
{
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* Applies failures asked for by other threads and frees what is finished. */
static void sweep(hx_agent *a)
{
    struct hx_io *io = T(a)->io;
    pthread_mutex_lock(&T(a)->lock);
    conn **pp = &io->conns;
    while (*pp) {
        conn *c = *pp;
        int req = atomic_exchange(&c->fail_req, 0);
        if (req)
            conn_fail(a, c, req);
        if (c->broken && (c->target || atomic_load(&c->freeing))) {
            *pp = c->next_all;
            conn_destroy(c);
            continue;
        }
        pp = &c->next_all;
    }
    pthread_mutex_unlock(&T(a)->lock);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void cut_stalled(hx_agent *a)
{
    uint64_t now = now_ns();
    pthread_mutex_lock(&T(a)->lock);
    for (conn *c = T(a)->io->conns; c; c = c->next_all)
        if (c->target && c->in_payload && !c->broken && now - c->last_rx_ns > T(a)->stall_ns)
            atomic_store(&c->fail_req, HX_E_PROTO);
    pthread_mutex_unlock(&T(a)->lock);
}

static void *io_main(void *arg)
{
    hx_agent *a = arg;
    struct hx_io *io = T(a)->io;
    struct epoll_event evs[64];
    uint64_t active_until = 0, next_stall_check = 0;
    while (!atomic_load(&io->stop)) {
        /* A short spin after activity saves the wake-up of a blocked thread
         * for the next frame of a burst; an idle agent blocks. */
        int timeout = now_ns() < active_until ? 0 : (io->payloads ? 1000 : -1);
        int n = epoll_wait(io->epfd, evs, 64, timeout);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (n > 0)
            active_until = now_ns() + SPIN_NS;
        else if (timeout == 0)
            sched_yield(); /* spinning: let the application's threads have the core */
        bool sweep_needed = false;
        for (int i = 0; i < n; i++) {
            conn *c = evs[i].data.ptr;
            if (!c) {
                uint64_t v;
                ssize_t r = read(io->evfd, &v, sizeof v);
                (void)r;
                sweep_needed = true;
                continue;
            }
            if (c->broken)
                continue;
            /* A failure asked for (a local close) wins over what the socket says. */
            int req = atomic_exchange(&c->fail_req, 0);
            if (req) {
                conn_fail(a, c, req);
                sweep_needed = true;
                continue;
            }
            uint32_t e = evs[i].events;
            if (e & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
                int rc = conn_read(a, c);
                if (rc < 0) {
                    conn_fail(a, c, rc == -1 ? HX_E_PROTO : HX_E_CONNLOST);
                    sweep_needed = true;
                    continue;
                }
                if (c->target) {
                    pthread_mutex_lock(&c->lock);
                    update_interest(a, c);
                    pthread_mutex_unlock(&c->lock);
                }
            }
            if (e & EPOLLOUT) {
                pthread_mutex_lock(&c->lock);
                int rc = flush_locked(a, c);
                pthread_mutex_unlock(&c->lock);
                if (rc < 0) {
                    conn_fail(a, c, HX_E_CONNLOST);
                    sweep_needed = true;
                }
            }
        }
        if (io->payloads && now_ns() >= next_stall_check) {
            cut_stalled(a);
            next_stall_check = now_ns() + 1000000000ull;
            sweep_needed = true;
        }
        if (sweep_needed)
            sweep(a);
    }
    /* Stopping: every connection fails as closed, target ones are freed. */
    pthread_mutex_lock(&T(a)->lock);
    for (conn *c = io->conns; c; c = c->next_all)
        conn_fail(a, c, HX_E_CLOSED);
    pthread_mutex_unlock(&T(a)->lock);
    sweep(a);
    return NULL;
}

static struct hx_io *io_get(hx_agent *a, int *status)
{
    pthread_mutex_lock(&T(a)->lock);
    struct hx_io *io = T(a)->io;
    if (io) {
        if (io->stopped) {
            *status = HX_E_CLOSED;
            io = NULL;
        }
        pthread_mutex_unlock(&T(a)->lock);
        return io;
    }
    *status = HX_E_SYS;
    io = calloc(1, sizeof *io);
    if (!io)
        goto fail;
    io->epfd = epoll_create1(EPOLL_CLOEXEC);
    io->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (io->epfd < 0 || io->evfd < 0)
        goto fail;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(io->epfd, EPOLL_CTL_ADD, io->evfd, &ev) < 0)
        goto fail;
    atomic_init(&io->stop, false);
    T(a)->io = io;
    if (pthread_create(&io->thread, NULL, io_main, a) != 0) {
        T(a)->io = NULL;
        goto fail;
    }
    pthread_mutex_unlock(&T(a)->lock);
    return io;
fail:
    if (io) {
        if (io->epfd >= 0)
            close(io->epfd);
        if (io->evfd >= 0)
            close(io->evfd);
        free(io);
    }
    pthread_mutex_unlock(&T(a)->lock);
    return NULL;
}

/* Stops the I/O thread, failing every tcp op with HX_E_CLOSED. */
static void tcp_shutdown(hx_agent *a)
{
    if (!T(a))
        return;
    pthread_mutex_lock(&T(a)->lock);
    struct hx_io *io = T(a)->io;
    bool join = io && !io->stopped;
    if (join)
        io->stopped = true;
    pthread_mutex_unlock(&T(a)->lock);
    if (!join)
        return;
    atomic_store(&io->stop, true);
    io_wake(io);
    pthread_join(io->thread, NULL);
}

/* Frees what the stopped I/O thread left (connections Python never freed). */
static void io_free(hx_agent *a)
{
    struct hx_io *io = T(a)->io;
    if (!io)
        return;
    conn *c = io->conns;
    while (c) {
        conn *next = c->next_all;
        if (c->fd >= 0)
            close(c->fd);
        conn_destroy(c);
        c = next;
    }
    close(io->epfd);
    close(io->evfd);
    free(io);
    T(a)->io = NULL;
}

/* ---------- connections ---------- */

static const hx_peer_ops tcp_ops;

static conn *conn_add(hx_agent *a, int fd, bool target, uint64_t session, int *status)
{
    struct hx_io *io = io_get(a, status);
    if (!io)
        return NULL;
    conn *c = calloc(1, sizeof *c);
    if (!c) {
        *status = HX_E_NOMEM;
        return NULL;
    }
    hx_peer_init(&c->base, a, &tcp_ops);
    pthread_mutex_init(&c->lock, NULL);
    c->fd = fd;
    c->target = target;
    c->session = session;
    atomic_init(&c->fail_req, 0);
    atomic_init(&c->freeing, false);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    c->events = EPOLLIN | EPOLLRDHUP;
    pthread_mutex_lock(&T(a)->lock);
    if (io->stopped) {
        pthread_mutex_unlock(&T(a)->lock);
        conn_destroy(c);
        *status = HX_E_CLOSED;
        return NULL;
    }
    c->next_all = io->conns;
    io->conns = c;
    /* Added to epoll last: from here on the I/O thread may use it. */
    struct epoll_event ev = {.events = c->events, .data.ptr = c};
    if (epoll_ctl(io->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        io->conns = c->next_all;
        pthread_mutex_unlock(&T(a)->lock);
        conn_destroy(c);
        *status = HX_E_SYS;
        return NULL;
    }
    pthread_mutex_unlock(&T(a)->lock);
    *status = HX_OK;
    return c;
}

hx_peer *hx_tcp_connect_fd(hx_agent *a, int fd, int *status)
{
    conn *c = conn_add(a, fd, false, 0, status);
    if (!c) {
        close(fd);
        return NULL;
    }
    return &c->base;
}

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
    conn *c = conn_add(a, fd, true, session, &status);
    if (!c) {
        close(fd);
        free(f ? f->owned : NULL);
        free(f);
        return status;
    }
    if (f) {
        pthread_mutex_lock(&c->lock);
        append_locked(c, f, f, 1);
        int rc = flush_locked(a, c);
        pthread_mutex_unlock(&c->lock);
        if (rc < 0) {
            atomic_store(&c->fail_req, HX_E_CONNLOST);
            io_wake(T(a)->io);
        }
    }
    return HX_OK;
}

void hx_tcp_drop_session(hx_agent *a, uint64_t session)
{
    pthread_mutex_lock(&T(a)->lock);
    struct hx_io *io = T(a)->io;
    bool any = false;
    if (io && !io->stopped)
        for (conn *c = io->conns; c; c = c->next_all)
            if (c->target && c->session == session) {
                atomic_store(&c->fail_req, HX_E_CONNLOST);
                any = true;
            }
    pthread_mutex_unlock(&T(a)->lock);
    if (any)
        io_wake(io);
}

static int tcp_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
{
    conn *c = (conn *)p;
    hx_agent *a = p->agent;
    tcp_op *op = calloc(1, sizeof *op + n * sizeof(hx_region *));
    if (!op)
        return HX_E_NOMEM;
    op->op_id = op_id;
    frame *first = NULL, *last = NULL;
    int count = 0, rc = HX_OK;
    for (uint32_t i = 0; i < n && rc == HX_OK; i++) {
        uint8_t *local;
        rc = hx_region_acquire(a, sges[i].local_region, sges[i].local_off, sges[i].len, 0,
                               &local, &op->regions[op->nregions]);
        if (rc != HX_OK)
            break;
        op->nregions++;
        for (uint64_t off = 0; off < sges[i].len; off += HX_TCP_CHUNK) {
            uint64_t len = sges[i].len - off;
            if (len > HX_TCP_CHUNK)
                len = HX_TCP_CHUNK;
            frame *f = calloc(1, sizeof *f);
            if (!f) {
                rc = HX_E_NOMEM;
                break;
            }
            put32(f->hdr, WIRE_MAGIC);
            f->hdr[4] = opcode == HX_OP_PUT ? W_PUT : W_GET;
            put32(f->hdr + 8, sges[i].remote_region);
            put64(f->hdr + 16, sges[i].remote_off + off);
            put64(f->hdr + 24, len);
            put64(f->hdr + 32, op_id);
            f->hdrlen = REQ_SIZE;
            f->op = op;
            f->op_id = op_id;
            f->opcode = opcode;
            f->local = local + off;
            f->len = len;
            if (opcode == HX_OP_PUT) {
                f->data = local + off;
                f->datalen = len;
            }
            if (last)
                last->next = f;
            else
                first = f;
            last = f;
            count++;
        }
    }
    if (rc == HX_OK) {
        op->remaining = count;
        pthread_mutex_lock(&c->lock);
        if (c->broken) {
            rc = HX_E_CONNLOST;
        } else {
            append_locked(c, first, last, count);
            /* Small ops go out on this thread; the I/O thread streams the
             * rest, so the caller's event loop never waits on a big send. */
            if (flush_budget(a, c, HX_INLINE_SEND) < 0) {
                /* The I/O thread fails this op with the rest. */
                atomic_store(&c->fail_req, HX_E_CONNLOST);
                io_wake(T(a)->io);
            }
        }
        pthread_mutex_unlock(&c->lock);
        if (rc == HX_OK)
            return HX_POSTED;
    }
    while (first) {
        frame *next = first->next;
        free(first);
        first = next;
    }
    for (uint32_t i = 0; i < op->nregions; i++)
        hx_region_release(op->regions[i]);
    free(op);
    return rc;
}

static void tcp_fail(hx_peer *p, int status)
{
    conn *c = (conn *)p;
    int expected = 0;
    atomic_compare_exchange_strong(&c->fail_req, &expected, status);
    io_wake(T(p->agent)->io);
}

static void tcp_destroy(hx_peer *p)
{
    conn *c = (conn *)p;
    hx_agent *a = p->agent;
    pthread_mutex_lock(&T(a)->lock);
    struct hx_io *io = T(a)->io;
    if (io->stopped) {
        /* No I/O thread any more: the conn is ours to unlink and free. */
        for (conn **pp = &io->conns; *pp; pp = &(*pp)->next_all)
            if (*pp == c) {
                *pp = c->next_all;
                break;
            }
        pthread_mutex_unlock(&T(a)->lock);
        if (c->fd >= 0)
            close(c->fd);
        conn_destroy(c);
        return;
    }
    atomic_store(&c->freeing, true);
    pthread_mutex_unlock(&T(a)->lock);
    io_wake(io);
}

static const hx_peer_ops tcp_ops = {tcp_post, tcp_fail, tcp_destroy};

static int tcp_init(hx_agent *a)
{
    tcp_agent *t = calloc(1, sizeof *t);
    if (!t)
        return HX_E_NOMEM;
    pthread_mutex_init(&t->lock, NULL);
    t->stall_ns = 10ull * 1000000000ull;
    a->state[HX_TRANSPORT_TCP] = t;
    return HX_OK;
}

static void tcp_free(hx_agent *a)
{
    tcp_agent *t = T(a);
    if (!t)
        return;
    io_free(a);
    pthread_mutex_destroy(&t->lock);
    free(t);
    a->state[HX_TRANSPORT_TCP] = NULL;
}

const hx_transport hx_tcp_transport = {"tcp", tcp_init, tcp_shutdown, tcp_free};

void hx_agent_set_stall(hx_agent *a, uint64_t ns)
{
    T(a)->stall_ns = ns;
}
