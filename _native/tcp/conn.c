/* tcp connections: the send queue, failure, and lifetime (added by either
 * side, destroyed by the I/O thread or, once it is stopped, by Python). */
#include "tcp.h"
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_IOV 64

void tcp_update_interest(hx_agent *a, conn *c)
{
    if (c->broken)
        return;
    uint32_t want = EPOLLRDHUP;
    if ((!c->target || c->outq < OUTQ_HIGH) && !c->note_held && !c->polling && !c->served)
        want |= EPOLLIN;
    if (c->unsent && !c->tx_held && !c->tx_self)
        want |= EPOLLOUT;
    if (want != c->events) {
        struct epoll_event ev = {.events = want, .data.ptr = c};
        epoll_ctl(T(a)->io->epfd, EPOLL_CTL_MOD, c->fd, &ev);
        c->events = want;
    }
}

__thread uint64_t tcp_inline_op;
__thread bool tcp_inline_done;

static void op_piece_done(hx_agent *a, tcp_op *op, int status)
{
    if (status != HX_OK && op->status == HX_OK)
        op->status = status;
    if (--op->remaining == 0) {
        for (uint32_t i = 0; i < op->nregions; i++)
            hx_region_release(op->regions[i]);
        if (op->status != HX_OK)
            hx_stat_error(a, HX_TRANSPORT_TCP);
        if (op->status == HX_OK && op->op_id == tcp_inline_op)
            tcp_inline_done = true; /* the busy-polling poster returns it as done inline */
        else
            hx_complete(a, op->op_id, op->status);
        free(op);
    }
}

void tcp_frame_free(hx_agent *a, frame *f, int status)
{
    if (f->op)
        op_piece_done(a, f->op, status);
    if (f->region)
        hx_region_release(f->region);
    free(f->owned);
    free(f);
}

/* A put's payload this big may go out by splice (Agent(tcp_send="splice")),
 * not sendmsg: the kernel then takes the pages themselves, and on loopback the
 * receiver's copy is the only one. The pages stay the socket's until the
 * target has read them, which is before its answer: a put's memory is not to
 * change before the put completes (docs/tcp.md). */
#define SPLICE_MIN (64u * 1024u)

/* Which costs the sending thread less depends on the host: in C, loopback,
 * 1 MiB writes over a 64 MiB span, splice ran at 3.0-3.2 GB/s against send's
 * 2.3-2.4 on one machine; on another, over an 8 MiB span, at 1.9 against
 * 4.4-4.7 (the puts' sending thread 420-480 us of CPU per MiB against 210,
 * most of it the transmit and the loopback receive run inside splice). A
 * connection timing both on its first MiBs misjudged it (splice cost a third
 * of what it did once running), so: copy, unless the user asks. */
static bool large(const conn *c, const frame *f)
{
    return !c->target && f->opcode == HX_OP_PUT && f->datalen >= SPLICE_MIN;
}

/* The payload of f still to go out from offset `at` goes by splice. */
static bool splices(const conn *c, const frame *f, uint64_t at)
{
    return c->pipe_w >= 0 && large(c, f) && f->datalen - at >= SPLICE_MIN;
}

/* The iovecs of what is unsent, from the first unsent frame on, up to a
 * payload that splices (*to_splice then); how many. */
static int unsent_iov(conn *c, struct iovec *iov, bool *to_splice)
{
    int n = 0;
    for (frame *f = c->unsent; f && n + 2 <= MAX_IOV; f = f->next) {
        uint64_t s = f->sent;
        if (!c->target && s <= REQ_FLAGS)
            f->hdr[REQ_FLAGS] = f->next ? REQ_MORE : 0; /* the byte is not out yet */
        if (s < f->hdrlen) {
            iov[n].iov_base = f->hdr + s;
            iov[n++].iov_len = f->hdrlen - s;
            s = 0;
        } else
            s -= f->hdrlen;
        if ((*to_splice = splices(c, f, s)))
            break;
        if (f->datalen > s) {
            iov[n].iov_base = (void *)(f->data + s);
            iov[n++].iov_len = f->datalen - s;
        }
    }
    return n;
}

/* The connection's pipe for splice, made at its first large put; without
 * one (no fds, no pipe of PIPE_SIZE, or MAX_PIPES in this agent already)
 * everything goes by sendmsg. A pipe of PIPE_SIZE (smaller ones cost the
 * splice path a third of its throughput) counts against the user's pipe
 * quota on the host (pipe-user-pages-soft: 64 MiB by default). */
#define PIPE_SIZE (1024u * 1024u)
#define MAX_PIPES 16

static void open_pipe(conn *c)
{
    tcp_agent *t = T(c->base.agent);
    int p[2];
    c->pipe_tried = true;
    if (atomic_fetch_add(&t->pipes, 1) >= MAX_PIPES)
        goto none;
    if (pipe2(p, O_NONBLOCK | O_CLOEXEC) < 0)
        goto none;
    if (fcntl(p[1], F_SETPIPE_SZ, (int)PIPE_SIZE) < (int)PIPE_SIZE) {
        close(p[0]);
        close(p[1]);
        goto none;
    }
    c->pipe_r = p[0];
    c->pipe_w = p[1];
    return;
none:
    atomic_fetch_sub(&t->pipes, 1);
}

static void close_pipe(conn *c)
{
    if (c->pipe_w >= 0) {
        close(c->pipe_r);
        close(c->pipe_w);
        atomic_fetch_sub(&T(c->base.agent)->pipes, 1);
    }
    c->pipe_r = c->pipe_w = -1;
    c->piped = 0;
}

/* splice into the socket, which (unlike sendmsg's MSG_NOSIGNAL) raises
 * SIGPIPE on a connection the peer reset: blocked around the call, and a
 * SIGPIPE it raised taken back, so a process that does not ignore SIGPIPE
 * learns of the loss as HX_E_CONNLOST, not by dying. */
static ssize_t splice_out(conn *c)
{
    struct sigaction now;
    if (sigaction(SIGPIPE, NULL, &now) == 0 && now.sa_handler == SIG_IGN)
        return splice(c->pipe_r, NULL, c->fd, NULL, c->piped, SPLICE_F_NONBLOCK); /* CPython's default */
    sigset_t pipe_only, old, pending;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_only, &old);
    sigpending(&pending);
    bool was_pending = sigismember(&pending, SIGPIPE);
    ssize_t k = splice(c->pipe_r, NULL, c->fd, NULL, c->piped, SPLICE_F_NONBLOCK);
    int err = errno;
    if (k < 0 && err == EPIPE && !was_pending)
        sigtimedwait(&pipe_only, NULL, &(struct timespec){0});
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = err;
    return k;
}

/* One step of sending: bytes into the socket, or -1 with errno (EAGAIN:
 * no room). What is in the pipe goes first; else the unsent payload at hand
 * enters the pipe, if it splices; else sendmsg takes what it can. *way: the
 * way this step belongs to (a header sent ahead of its spliced payload is
 * the splice's). */
static ssize_t send_step(conn *c, int *way)
{
    *way = TCP_WAY_SPLICE;
    frame *f = c->unsent;
    uint64_t at = f->sent > f->hdrlen ? f->sent - f->hdrlen : 0;
    if (!c->piped && f->sent >= f->hdrlen && splices(c, f, at)) {
        struct iovec v = {.iov_base = (void *)(f->data + at), .iov_len = f->datalen - at};
        ssize_t n = vmsplice(c->pipe_w, &v, 1, 0);
        if (n < 0) /* memory the kernel will not lend (EFAULT): sendmsg copies it, as ever */
            close_pipe(c);
        else if (n == 0)
            return errno = EAGAIN, -1; /* an empty pipe took nothing: never spin on it */
        else
            c->piped = (uint64_t)n;
    }
    if (c->piped) {
        ssize_t k = splice_out(c);
        if (k == 0)
            return errno = EAGAIN, -1; /* took nothing: wait for room, never spin */
        if (k > 0)
            c->piped -= (uint64_t)k;
        return k;
    }
    struct iovec iov[MAX_IOV];
    bool to_splice = false;
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = unsent_iov(c, iov, &to_splice)};
    if (!to_splice)
        *way = TCP_WAY_COPY;
    /* A payload spliced next joins its header in one segment (MSG_MORE: the
     * header waits in the socket for it; the splice's end pushes both). */
    return sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT | (to_splice ? MSG_MORE : 0));
}

/* A step `way` took `left` bytes: the frames they finish are sent (a
 * target's responses are done then; requests wait for their answers). Large
 * puts' bytes are counted by way (hx_tcp_send_stats). */
static void sent(hx_agent *a, conn *c, uint64_t left, int way)
{
    while (left && c->unsent) {
        frame *f = c->unsent;
        uint64_t need = f->hdrlen + f->datalen - f->sent;
        uint64_t take = left < need ? left : need;
        if (large(c, f))
            atomic_fetch_add_explicit(&T(a)->sent_by[way], take, memory_order_relaxed);
        f->sent += take;
        left -= take;
        if (f->sent < f->hdrlen + f->datalen)
            break;
        c->unsent = f->next;
        c->last_tx_ns = tcp_now_ns(); /* the next frame's turn starts now */
        if (c->target) {
            c->head = f->next;
            if (!c->head)
                c->tail = NULL;
            c->outq--;
            tcp_frame_free(a, f, HX_OK);
        }
    }
}

/* Sends what can be sent without blocking, at most budget bytes. Caller holds
 * c->lock; with unlocked, it is let go around each sendmsg (tcp_flush_io).
 * Returns HX_OK, or HX_E_CONNLOST when the connection is broken. */
static int flush(hx_agent *a, conn *c, uint64_t budget, bool unlocked)
{
    if (c->tx_io)
        return HX_OK; /* the I/O thread is sending: it goes on with what was queued meanwhile */
    while (c->unsent && !c->broken && budget) {
        if (!c->pipe_tried && T(a)->way == TCP_WAY_SPLICE && large(c, c->unsent))
            open_pipe(c);
        if (unlocked) {
            c->tx_io = true;
            pthread_mutex_unlock(&c->lock);
        }
        int way;
        ssize_t w = send_step(c, &way);
        int err = errno;
        if (unlocked) {
            pthread_mutex_lock(&c->lock);
            c->tx_io = false;
        }
        if (w < 0) {
            if (err == EINTR)
                continue;
            if (err == EAGAIN || err == EWOULDBLOCK)
                break;
            return HX_E_CONNLOST;
        }
        if (w == 0)
            break; /* nothing taken, no error: EPOLLOUT says when to go on, never spin */
        c->last_tx_ns = tcp_now_ns();
        budget = budget > (uint64_t)w ? budget - (uint64_t)w : 0;
        sent(a, c, (uint64_t)w, way);
    }
    if (!c->unsent)
        c->held_since = 0;
    tcp_update_interest(a, c);
    return HX_OK;
}

int tcp_flush_budget(hx_agent *a, conn *c, uint64_t budget) { return flush(a, c, budget, false); }

int tcp_flush_locked(hx_agent *a, conn *c) { return flush(a, c, UINT64_MAX, false); }

int tcp_flush_io(hx_agent *a, conn *c)
{
    /* Frames are only freed on this thread (answers, failures), and posting
     * threads only append while frames are unsent, so what the iovecs point
     * at stays put with the lock let go. A busy-polling thread reads answers
     * itself: an answer to a frame sent but not yet counted as sent would
     * look like one to nothing, so then the lock is held throughout. */
    return flush(a, c, UINT64_MAX, !c->target && !c->polling);
}

void tcp_append_locked(conn *c, frame *first, frame *last, uint32_t count)
{
    if (c->tail)
        c->tail->next = first;
    else
        c->head = first;
    c->tail = last;
    if (!c->unsent) {
        c->unsent = first;
        c->last_tx_ns = tcp_now_ns();
    }
    if (c->target)
        c->outq += count;
    else
        c->queued += count;
}

/* Ends a connection: every frame fails with status. I/O thread only. */
void tcp_conn_fail(hx_agent *a, conn *c, int status)
{
    /* A thread busy-polling this connection finishes first (it holds the
     * receive state for at most the busy-poll time). */
    pthread_mutex_lock(&c->rx_lock);
    /* A local close or give-up, asked for before the socket broke (the peer
     * may close because we did), says why better than the socket does. */
    int failed = 0;
    /* Recorded on the peer: later posts fail at once, and Python can ask why. */
    if (!atomic_compare_exchange_strong(&c->base.failed, &failed, status))
        status = failed;
    pthread_mutex_lock(&c->lock);
    if (c->broken) {
        pthread_mutex_unlock(&c->lock);
        pthread_mutex_unlock(&c->rx_lock);
        return;
    }
    c->broken = true;
    bool served = c->served; /* under lock: set_served leaves a broken conn as it is */
    frame *f = c->head;
    c->head = c->tail = c->unsent = NULL;
    c->outq = 0;
    pthread_mutex_unlock(&c->lock);
    epoll_ctl(T(a)->io->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    if (served) /* the event loop polls for it no more either */
        epoll_ctl(T(a)->io->serve_epfd, EPOLL_CTL_DEL, c->fd, NULL);
    if (f && c->pipe_tried) {
        /* Spliced pages may wait in the send queue: reset, which drops it,
         * before the ops fail and their memory may be reused. */
        struct linger now = {.l_onoff = 1, .l_linger = 0};
        setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &now, sizeof now);
    }
    shutdown(c->fd, SHUT_RDWR);
    close(c->fd);
    c->fd = -1;
    close_pipe(c); /* broken is set: no send reaches it again */
    while (f) {
        frame *next = f->next;
        tcp_frame_free(a, f, status);
        f = next;
    }
    if (c->rregion) {
        hx_region_release(c->rregion);
        c->rregion = NULL;
    }
    free(c->rcheck);
    c->rcheck = NULL;
    if (c->target && c->in_payload) {
        c->in_payload = false;
        T(a)->io->payloads--;
    }
    pthread_mutex_unlock(&c->rx_lock);
}

void tcp_conn_destroy(conn *c)
{
    close_pipe(c);
    pthread_mutex_destroy(&c->lock);
    pthread_mutex_destroy(&c->rx_lock);
    free(c->rbuf);
    free(c);
}

void tcp_peer_fail(hx_peer *p, int status)
{
    conn *c = (conn *)p;
    int expected = 0;
    atomic_compare_exchange_strong(&c->fail_req, &expected, status);
    tcp_io_wake(T(p->agent)->io);
}

void tcp_peer_destroy(hx_peer *p)
{
    conn *c = (conn *)p;
    hx_agent *a = p->agent;
    tcp_agent *t = T(a);
    pthread_mutex_lock(&t->lock);
    tcp_io *io = t->io;
    if (io->stopped) {
        /* No I/O thread any more: the conn is ours to unlink and free. */
        for (conn **pp = &io->conns; *pp; pp = &(*pp)->next_all)
            if (*pp == c) {
                *pp = c->next_all;
                break;
            }
        pthread_mutex_unlock(&t->lock);
        if (c->fd >= 0)
            close(c->fd);
        tcp_conn_destroy(c);
        return;
    }
    atomic_store(&c->freeing, true);
    pthread_mutex_unlock(&t->lock);
    tcp_io_wake(io);
}

conn *tcp_conn_new(hx_agent *a, int fd, const tcp_role *role, uint64_t session)
{
    conn *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    hx_peer_init(&c->base, a, role->peer_ops);
    pthread_mutex_init(&c->lock, NULL);
    pthread_mutex_init(&c->rx_lock, NULL);
    c->role = role;
    c->fd = fd;
    c->target = role->target;
    c->session = session;
    c->pipe_r = c->pipe_w = -1;
    c->rx_cap = UINT64_MAX;
    atomic_init(&c->fail_req, 0);
    atomic_init(&c->freeing, false);
    atomic_init(&c->heard_ns, 0);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); /* splice has no MSG_DONTWAIT */
    c->events = EPOLLIN | EPOLLRDHUP;
    c->last_rx_ns = c->last_tx_ns = tcp_now_ns();
    return c;
}
