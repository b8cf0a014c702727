/* The tcp I/O thread (epoll): reads every connection, sends what the
 * submitting threads left, applies failures other threads asked for, cuts
 * stalled payloads. Also the transport's agent state and hooks. */
#include "tcp.h"
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static __thread uint8_t scratch[1 << 16]; /* payloads of refused PUTs go here */

/* conn_read's own results beside HX_OK (take on) and the HX_E_* failures. */
enum { READ_HELD = 1 /* stopped for back-pressure */, READ_DRAINED = 2 /* the socket has no more */ };

/* Caller holds hold_lock. A deadline later than the one set changes nothing. */
static void set_hold_timer(tcp_io *io, uint64_t deadline, uint64_t now)
{
    if (atomic_load(&io->hold_armed) && io->hold_deadline <= deadline)
        return;
    io->hold_deadline = deadline;
    atomic_store(&io->hold_armed, true);
    uint64_t in = deadline > now ? deadline - now : 1;
    struct itimerspec when = {
        .it_value = {.tv_sec = (time_t)(in / 1000000000u), .tv_nsec = (long)(in % 1000000000u)}};
    timerfd_settime(io->tfd, 0, &when, NULL);
}

void tcp_hold_arm(tcp_io *io)
{
    /* Arming wakes nobody: the I/O thread only hears of it if it fires. */
    if (atomic_load(&io->hold_armed))
        return;
    uint64_t now = tcp_now_ns();
    pthread_mutex_lock(&io->hold_lock);
    set_hold_timer(io, now + HOLD_MAX_NS, now);
    pthread_mutex_unlock(&io->hold_lock);
}

/* An answer owed to a poster that has not come for it within HOLD_MAX_NS
 * (its event loop is busy, or nobody awaits the op) is the I/O thread's to
 * read again. Caller holds c->lock. Returns when that is due (0: nothing owed). */
static uint64_t reclaim_poll(hx_agent *a, conn *c, uint64_t now)
{
    if (!c->poll_owed)
        return 0;
    if (c->poll_owed > now || now - c->poll_owed < HOLD_MAX_NS)
        return c->poll_owed + HOLD_MAX_NS;
    c->poll_owed = 0;
    c->polling = false;
    tcp_update_interest(a, c);
    return 0;
}

static void serve_all(hx_agent *a, tcp_io *io, bool quiet);

/* The hold timer fired: what was held longer than HOLD_MAX_NS (its event
 * loop, which was to flush it, is busy) goes out from here, and answers owed
 * to posters that long are read here again; the timer is set again for the
 * oldest put held (answer owed) for less. */
static void flush_held(hx_agent *a)
{
    tcp_agent *t = T(a);
    tcp_io *io = t->io;
    pthread_mutex_lock(&io->hold_lock);
    atomic_store(&io->hold_armed, false);
    pthread_mutex_unlock(&io->hold_lock);
    uint64_t now = tcp_now_ns(), next = 0;
    pthread_mutex_lock(&t->lock);
    for (conn *c = io->conns; c; c = c->next_all) {
        if (c->target || c->broken)
            continue;
        pthread_mutex_lock(&c->lock);
        uint64_t owed = reclaim_poll(a, c, now);
        next = owed && (!next || owed < next) ? owed : next;
        /* held_since may be later than now: set by a post since now was read */
        if (c->unsent && c->held_since && (c->held_since > now || now - c->held_since < HOLD_MAX_NS)) {
            uint64_t due = c->held_since + HOLD_MAX_NS;
            next = !next || due < next ? due : next;
        } else if (c->unsent && tcp_flush_io(a, c) < 0) {
            atomic_store(&c->fail_req, HX_E_CONNLOST);
        }
        pthread_mutex_unlock(&c->lock);
    }
    /* The event loop that reads the target conns (tcp_notes_quiet) has not
     * turned for HOLD_MAX_NS: it is blocked (a handler's synchronous work),
     * and its conns would be read by nobody: they are this thread's again,
     * until the loop turns again (tcp_notes_served takes them back). */
    if (atomic_load(&io->loop_serves) && !io->stopped) {
        uint64_t at = atomic_load(&io->served_ns);
        if (at <= now && now - at >= HOLD_MAX_NS)
            serve_all(a, io, false);
        else if (!next || at + HOLD_MAX_NS < next)
            next = at + HOLD_MAX_NS;
    }
    pthread_mutex_unlock(&t->lock);
    if (next) {
        pthread_mutex_lock(&io->hold_lock);
        set_hold_timer(io, next, tcp_now_ns());
        pthread_mutex_unlock(&io->hold_lock);
    }
}

/* One receive: into the read-ahead buffer, or, for the rest of a large
 * payload, straight into its place with whatever follows it (the next
 * headers) into the buffer, in one call. Returns bytes read, 0 when the
 * socket is drained, HX_E_CONNLOST when the connection is gone. */
static ssize_t receive(conn *c)
{
    if (!c->rbuf && !(c->rbuf = malloc(RBUF_SIZE)))
        return HX_E_CONNLOST;
    struct iovec iov[2];
    int n = 0;
    bool direct = c->in_payload && c->rlen - c->rdone >= RDIRECT;
    uint64_t want = 0;
    if (direct) {
        want = c->rlen - c->rdone;
        if (!c->rdst && want > sizeof scratch)
            want = sizeof scratch;
        if (want > c->rx_cap)
            want = c->rx_cap; /* the event loop's read: SERVE_MAX */
        iov[n++] = (struct iovec){.iov_base = c->rdst ? c->rdst + c->rdone : scratch, .iov_len = want};
    }
    if (!direct || want == c->rlen - c->rdone)
        iov[n++] = (struct iovec){.iov_base = c->rbuf, .iov_len = RBUF_SIZE};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n};
    uint64_t offered = n == 2 ? want + RBUF_SIZE : iov[0].iov_len;
    for (;;) {
        ssize_t r = recvmsg(c->fd, &msg, MSG_DONTWAIT);
        if (r == 0)
            return HX_E_CONNLOST;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : HX_E_CONNLOST;
        }
        c->last_rx_ns = tcp_now_ns();
        c->rx_short = (uint64_t)r < offered;
        c->rx_fresh = true;
        uint64_t placed = direct ? ((uint64_t)r < want ? (uint64_t)r : want) : 0;
        c->rdone += placed;
        c->rpos = 0;
        c->rend = (uint32_t)((uint64_t)r - placed);
        return r;
    }
}

/* The event loop's read queued a notification: the answers wait for the
 * loop's next turn (pay_owed), which comes once the task the message woke
 * has run. Sent now, their system call (7-12 us here: loopback tcp runs the
 * initiator's receive in it) would come before that task. */
static bool loop_owes(const conn *c) { return c->noted && c->rx_cap != UINT64_MAX; }

static int flush_answers(hx_agent *a, conn *c)
{
    pthread_mutex_lock(&c->lock);
    /* The event loop's read (rx_cap set) sends SERVE_MAX bytes at most: the
     * I/O thread sends the rest (a GET's data) when the socket has room. */
    int rc = !c->unsent                ? HX_OK
             : c->rx_cap != UINT64_MAX ? tcp_flush_budget(a, c, SERVE_MAX)
                                       : tcp_flush_locked(a, c);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* The read-ahead buffer is empty: send the answers that are due, then
 * receive. HX_OK when bytes came, READ_DRAINED, or the failure. */
static int refill(hx_agent *a, conn *c)
{
    /* Answers go out together once the socket is drained (a receive that did
     * not fill what it offered took all there was), so a burst of requests is
     * answered in one send and the initiator woken once, not once a receive;
     * and after ANSWER_BATCH bytes, so none waits long behind new input.
     * While more frames are announced (REQ_MORE), only after MORE_BATCH bytes. */
    if (c->reading && (c->rmore ? c->rx_since_flush >= MORE_BATCH
                                : (c->rx_short && !loop_owes(c)) || c->rx_since_flush >= ANSWER_BATCH)) {
        int rc = flush_answers(a, c);
        if (rc != HX_OK)
            return rc;
        c->rx_since_flush = 0;
    }
    /* That receive drained the socket: another would only return EAGAIN (a
     * system call per request). epoll is level-triggered: what comes later
     * is reported. */
    if (c->rx_fresh && c->rx_short)
        return READ_DRAINED;
    /* The event loop's read (tcp_notes_served) spent its budget: what is
     * left is reported to the I/O thread, which takes the conn back. */
    if (c->rx_cap == 0)
        return READ_DRAINED;
    ssize_t r = receive(c);
    if (r <= 0)
        return r == 0 ? READ_DRAINED : (int)r;
    c->rx_since_flush += (uint64_t)r;
    if (c->rx_cap != UINT64_MAX)
        c->rx_cap = (uint64_t)r < c->rx_cap ? c->rx_cap - (uint64_t)r : 0;
    return HX_OK;
}

/* Takes what the read-ahead buffer holds: payload bytes into their place, or
 * header bytes, handing a complete header to the connection's role. */
static int take_buffered(hx_agent *a, conn *c)
{
    uint32_t avail = c->rend - c->rpos;
    if (c->in_payload) {
        uint64_t take = c->rlen - c->rdone < avail ? c->rlen - c->rdone : avail;
        if (c->rdst)
            memcpy(c->rdst + c->rdone, c->rbuf + c->rpos, take);
        c->rpos += (uint32_t)take;
        c->rdone += take;
        return HX_OK; /* done (or not) at the top of conn_read */
    }
    uint32_t size = c->role->header_size;
    uint32_t take = size - c->rgot < avail ? size - c->rgot : avail;
    memcpy(c->rhdr + c->rgot, c->rbuf + c->rpos, take);
    c->rpos += take;
    c->rgot += take;
    if (c->rgot < size)
        return HX_OK;
    c->rgot = 0;
    return c->role->header(a, c);
}

/* Reads until drained (HX_OK), back-pressure (READ_HELD) or a failure. */
static int conn_read(hx_agent *a, conn *c)
{
    for (;;) {
        int rc;
        if (c->in_payload && c->rdone == c->rlen)
            rc = c->role->payload_done(a, c);
        else if ((c->target && c->outq >= OUTQ_HIGH) || c->note_held)
            return READ_HELD; /* answer first, or wait for room for the notification;
                                 what the buffer holds is taken when reading resumes (read_held) */
        else if (c->rpos == c->rend)
            rc = refill(a, c);
        else
            rc = take_buffered(a, c);
        if (rc != HX_OK)
            return rc == READ_DRAINED ? HX_OK : rc;
    }
}

int tcp_conn_read(hx_agent *a, conn *c)
{
    c->reading = c->target;
    c->rx_fresh = false;
    c->noted = false;
    int rc = conn_read(a, c);
    c->reading = false;
    /* Drained while more frames are announced: the answers wait for them
     * (reading stopped for back-pressure sends them now). */
    c->tx_held = rc == HX_OK && c->target && c->rmore && c->rx_since_flush < MORE_BATCH;
    if (c->tx_held)
        return HX_OK;
    c->rx_since_flush = 0;
    if (rc >= 0 && c->target && loop_owes(c)) {
        pthread_mutex_lock(&c->lock);
        c->tx_held = true; /* no EPOLLOUT (one armed by an earlier flush too): the loop sends them */
        tcp_update_interest(a, c);
        pthread_mutex_unlock(&c->lock);
        if (!c->owed) {
            c->owed = true;
            T(a)->io->owed++;
        }
        return HX_OK;
    }
    if (rc >= 0 && c->target)
        rc = flush_answers(a, c);
    return rc < 0 ? rc : HX_OK;
}

/* Applies failures asked for by other threads and frees what is finished. */
static void sweep(hx_agent *a)
{
    tcp_agent *t = T(a);
    tcp_io *io = t->io;
    pthread_mutex_lock(&t->lock);
    conn **pp = &io->conns;
    while (*pp) {
        conn *c = *pp;
        int req = atomic_exchange(&c->fail_req, 0);
        if (req)
            tcp_conn_fail(a, c, req);
        if (c->broken && (c->target || atomic_load(&c->freeing))) {
            *pp = c->next_all;
            if (c->target)
                atomic_fetch_sub(&io->targets, 1);
            io->owed -= c->owed;
            tcp_conn_destroy(c);
            continue;
        }
        pp = &c->next_all;
    }
    pthread_mutex_unlock(&t->lock);
}

/* How long ago `then` was; 0 when it is later than `now` (another thread,
 * a busy-polling poster or a submitting one, may stamp it after `now` was read). */
static uint64_t since(uint64_t now, uint64_t then) { return now > then ? now - then : 0; }

static void cut_stalled(hx_agent *a)
{
    tcp_agent *t = T(a);
    uint64_t now = tcp_now_ns();
    pthread_mutex_lock(&t->lock);
    for (conn *c = t->io->conns; c; c = c->next_all) {
        if (!c->target || c->broken)
            continue;
        if (c->in_payload && since(now, c->last_rx_ns) > t->stall_ns)
            atomic_store(&c->fail_req, HX_E_PROTO);
        /* Answers the peer does not read: a GET's data holds its region busy. */
        pthread_mutex_lock(&c->lock);
        bool stuck = c->unsent && since(now, c->last_tx_ns) > t->stall_ns;
        pthread_mutex_unlock(&c->lock);
        if (stuck)
            atomic_store(&c->fail_req, HX_E_PROTO);
    }
    pthread_mutex_unlock(&t->lock);
}

/* Heartbeats: a beacon where nothing was sent for an interval; a connection
 * that heard nothing for the timeout fails, unless we hold its sender back. */
static void heartbeat(hx_agent *a)
{
    tcp_agent *t = T(a);
    uint64_t now = tcp_now_ns();
    pthread_mutex_lock(&t->lock);
    for (conn *c = t->io->conns; c; c = c->next_all) {
        if (c->broken)
            continue;
        pthread_mutex_lock(&c->lock);
        bool holding = c->note_held || (c->target && c->outq >= OUTQ_HIGH);
        uint64_t heard = atomic_load_explicit(&c->heard_ns, memory_order_relaxed);
        if (holding)
            c->last_rx_ns = now;
        else if (since(now, c->last_rx_ns) > t->hb_timeout_ns && since(now, heard) > t->hb_timeout_ns)
            atomic_store(&c->fail_req, HX_E_SILENT);
        if (since(now, c->last_tx_ns) >= t->hb_interval_ns && !c->unsent)
            c->role->beacon_locked(a, c);
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&t->lock);
}

/* hx_transport.heard: the channel peer_id, or session's served connections,
 * count as heard at now_ns. The conn list is walked under the agent's lock,
 * so a conn being freed is never touched; the completion thread calling
 * this rate-limits it (verbs: cq.c). */
static void tcp_heard(hx_agent *a, uint64_t peer_id, uint64_t session, uint64_t now_ns)
{
    tcp_agent *t = T(a);
    if (!t)
        return;
    pthread_mutex_lock(&t->lock);
    for (conn *c = t->io ? t->io->conns : NULL; c; c = c->next_all)
        if (!c->broken && ((peer_id && !c->target && c->base.id == peer_id) ||
                           (session && c->target && c->session == session)))
            atomic_store_explicit(&c->heard_ns, now_ns, memory_order_relaxed);
    pthread_mutex_unlock(&t->lock);
}

/* Reading resumes after back-pressure: what the read-ahead buffer already
 * holds is taken now (no event would say it is there). Same returns as
 * tcp_conn_read. */
static int read_held(hx_agent *a, conn *c)
{
    if (c->rpos == c->rend || c->broken)
        return HX_OK;
    pthread_mutex_lock(&c->rx_lock);
    int rc = tcp_conn_read(a, c);
    pthread_mutex_unlock(&c->rx_lock);
    return rc;
}

/* The agent's notification queue has room: release held notifications. */
static void resume_notes(hx_agent *a)
{
    tcp_agent *t = T(a);
    pthread_mutex_lock(&t->lock);
    for (conn *c = t->io->conns; c; c = c->next_all) {
        if (c->broken || !c->note_held)
            continue;
        int rc = c->role->note_retry(a, c);
        if (rc == HX_OK)
            rc = read_held(a, c);
        if (rc < 0) {
            atomic_store(&c->fail_req, rc);
            continue;
        }
        pthread_mutex_lock(&c->lock);
        tcp_update_interest(a, c); /* reading resumes: what waits in the socket comes next */
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&t->lock);
}

/* What the I/O thread keeps from one round of its loop to the next. */
typedef struct {
    uint64_t spin_ns; /* Agent(busy_poll_us=...): poll this long after activity before blocking */
    uint64_t active_until, next_stall_check, next_beat;
    uint64_t served_at; /* when requests were last read */
    bool watch;         /* payloads in flight or target conns: the stall check runs */
} io_clock;

static bool has_conns(tcp_agent *t)
{
    pthread_mutex_lock(&t->lock);
    bool any = t->io->conns != NULL;
    pthread_mutex_unlock(&t->lock);
    return any;
}

/* How long epoll_wait may block, in ms (-1: until woken). In the latency
 * mode a spin after activity saves the wake-up of a blocked thread for the
 * next frame; otherwise, and once idle, the thread blocks, waking only for
 * heartbeats and the stall check while it has connections. Off by default:
 * on two cores a polling thread takes the core the other side needs, and an
 * idle agent must cost nothing. */
static int wait_timeout(tcp_agent *t, io_clock *k)
{
    k->watch = t->io->payloads || atomic_load(&t->io->targets);
    int timeout = tcp_now_ns() < k->active_until ? 0 : (k->watch ? 1000 : -1);
    if (timeout == 0 || !t->hb_interval_ns || !has_conns(t))
        return timeout;
    uint64_t now = tcp_now_ns();
    int beat_ms = k->next_beat > now ? (int)((k->next_beat - now) / 1000000) + 1 : 0;
    return timeout < 0 || beat_ms < timeout ? beat_ms : timeout;
}

/* The socket is readable (or broke): read it; an initiator's puts held for a
 * flush whose event loop is busy go out too. */
static int on_input(hx_agent *a, conn *c)
{
    pthread_mutex_lock(&c->rx_lock);
    int rc = tcp_conn_read(a, c);
    pthread_mutex_unlock(&c->rx_lock);
    if (rc != HX_OK)
        return rc;
    pthread_mutex_lock(&c->lock);
    if (c->target)
        tcp_update_interest(a, c);
    else if (c->unsent)
        rc = tcp_flush_io(a, c);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* The socket has room: send; a target reads again once its answers went. */
static int on_output(hx_agent *a, conn *c)
{
    pthread_mutex_lock(&c->lock);
    int rc = tcp_flush_io(a, c);
    pthread_mutex_unlock(&c->lock);
    if (rc != HX_OK || !c->target)
        return rc;
    if (c->outq < OUTQ_HIGH && (rc = read_held(a, c)) != HX_OK)
        return rc;
    pthread_mutex_lock(&c->lock);
    tcp_update_interest(a, c);
    pthread_mutex_unlock(&c->lock);
    return HX_OK;
}

/* One epoll event. Returns whether a sweep is due (a connection failed, or
 * a wake asked for one). */
static bool on_event(hx_agent *a, const struct epoll_event *ev)
{
    tcp_io *io = T(a)->io;
    uint64_t v;
    if (!ev->data.ptr) { /* a wake (tcp_io_wake) */
        ssize_t r = read(io->evfd, &v, sizeof v);
        (void)r;
        return true;
    }
    if (ev->data.ptr == &io->tfd) {
        ssize_t r = read(io->tfd, &v, sizeof v);
        (void)r;
        flush_held(a);
        return true; /* a failed flush asked for a failure */
    }
    conn *c = ev->data.ptr;
    if (c->broken)
        return false;
    /* A failure asked for (a local close) wins over what the socket says. */
    int rc = atomic_exchange(&c->fail_req, 0);
    if (rc == HX_OK && (ev->events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)))
        rc = on_input(a, c);
    if (rc == HX_OK && (ev->events & EPOLLOUT))
        rc = on_output(a, c);
    if (rc == HX_OK)
        return false;
    tcp_conn_fail(a, c, rc);
    return true;
}

/* Requests were read (heartbeats are not): poll serve_ns for the next while
 * they come within 5 x serve_ns of each other (waking this thread included).
 * A request to this thread blocked on another, halted, virtual CPU costs the
 * sender about 15 us and the request 20-40 more: a lone 64 KiB put took 53 us
 * instead of 22 (docs/tcp.md, "The target's poll"). A sparser stream, or an
 * idle agent, is never polled for. */
static void serve_poll(tcp_agent *t, io_clock *k)
{
    uint64_t now = tcp_now_ns();
    if (t->serve_ns && now - k->served_at <= 5 * t->serve_ns && now + t->serve_ns > k->active_until)
        k->active_until = now + t->serve_ns;
    k->served_at = now;
}

/* What is due by the clock, or asked for: held notifications, heartbeats,
 * the stall check. Returns whether a sweep is due. */
static bool periodic(hx_agent *a, io_clock *k)
{
    tcp_agent *t = T(a);
    bool sweep_needed = false;
    if (atomic_exchange(&t->io->note_space, false))
        resume_notes(a);
    if (t->hb_interval_ns && tcp_now_ns() >= k->next_beat) {
        heartbeat(a);
        /* a quarter interval: silence is seen within a quarter of it */
        k->next_beat = tcp_now_ns() + t->hb_interval_ns / 4;
        sweep_needed = true;
    }
    if (k->watch && tcp_now_ns() >= k->next_stall_check) {
        cut_stalled(a);
        k->next_stall_check = tcp_now_ns() + 1000000000ull;
        sweep_needed = true;
    }
    return sweep_needed;
}

/* The thread ends (shut down, or epoll failed with err): from now on no
 * connection is taken, and every one fails (target ones are freed). */
static void io_exit(hx_agent *a, int err)
{
    tcp_agent *t = T(a);
    pthread_mutex_lock(&t->lock);
    t->io->stopped = true;
    t->io->error = err;
    /* After a failure the connections are lost to us; err is said to
     * whoever connects next (tcp_io_add), synchronously, with its errno. */
    for (conn *c = t->io->conns; c; c = c->next_all)
        tcp_conn_fail(a, c, err ? HX_E_CONNLOST : HX_E_CLOSED);
    pthread_mutex_unlock(&t->lock);
    sweep(a);
}

static void *io_main(void *arg)
{
    hx_agent *a = arg;
    tcp_agent *t = T(a);
    tcp_io *io = t->io;
    struct epoll_event evs[64];
    io_clock k = {.spin_ns = t->busy_ns};
    int err = 0;
    while (!atomic_load(&io->stop)) {
        int timeout = wait_timeout(t, &k);
        int n = hx_fault(HX_FAULT_EPOLL_WAIT)
                    ? (errno = EBADF, -1)
                    : epoll_wait(io->epfd, evs, (int)(sizeof evs / sizeof *evs), timeout);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            err = errno; /* no event can be seen any more: the connections fail with it */
            break;
        }
        if (n > 0)
            k.active_until = tcp_now_ns() + k.spin_ns;
        else if (timeout == 0)
            sched_yield(); /* spinning: let the application's threads have the core */
        bool sweep_needed = false;
        uint64_t requests = io->requests;
        for (int i = 0; i < n; i++)
            sweep_needed |= on_event(a, &evs[i]);
        if (io->requests != requests)
            serve_poll(t, &k);
        if (periodic(a, &k) || sweep_needed)
            sweep(a);
    }
    io_exit(a, err);
    return NULL;
}

static void io_close(tcp_io *io)
{
    if (io->epfd >= 0)
        close(io->epfd);
    if (io->evfd >= 0)
        close(io->evfd);
    if (io->tfd >= 0)
        close(io->tfd);
    if (io->serve_epfd >= 0)
        close(io->serve_epfd);
    pthread_mutex_destroy(&io->hold_lock);
    free(io);
}

/* Makes the I/O state and starts the thread. Caller holds t->lock. */
static tcp_io *io_start(hx_agent *a, int *status)
{
    tcp_agent *t = T(a);
    *status = HX_E_NOMEM;
    tcp_io *io = calloc(1, sizeof *io);
    if (!io)
        return NULL;
    *status = HX_E_SYS;
    pthread_mutex_init(&io->hold_lock, NULL);
    atomic_init(&io->hold_armed, false);
    atomic_init(&io->stop, false);
    atomic_init(&io->targets, 0);
    io->epfd = epoll_create1(EPOLL_CLOEXEC);
    io->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    io->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    io->serve_epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    struct epoll_event tev = {.events = EPOLLIN, .data.ptr = &io->tfd};
    if (io->epfd < 0 || io->evfd < 0 || io->tfd < 0 || io->serve_epfd < 0 ||
        epoll_ctl(io->epfd, EPOLL_CTL_ADD, io->evfd, &ev) < 0 ||
        epoll_ctl(io->epfd, EPOLL_CTL_ADD, io->tfd, &tev) < 0) {
        io_close(io);
        return NULL;
    }
    t->io = io; /* the thread reads it */
    if (pthread_create(&io->thread, NULL, io_main, a) != 0) {
        t->io = NULL;
        io_close(io);
        return NULL;
    }
    pthread_setname_np(io->thread, "hixl-tcp-io"); /* top -H, perf: which thread is which */
    return io;
}

/* Why a stopped thread takes no connection: the agent shut down, or the
 * thread failed (HX_E_SYS, with its errno). */
static int stopped_status(tcp_io *io)
{
    errno = io->error;
    return io->error ? HX_E_SYS : HX_E_CLOSED;
}

static void set_served(hx_agent *a, conn *c, bool served);

conn *tcp_io_add(hx_agent *a, int fd, const tcp_role *role, uint64_t session, int *status)
{
    tcp_agent *t = T(a);
    pthread_mutex_lock(&t->lock);
    tcp_io *io = t->io ? t->io : io_start(a, status);
    conn *c = NULL;
    if (io && io->stopped)
        *status = stopped_status(io);
    else if (io && !(c = tcp_conn_new(a, fd, role, session)))
        *status = HX_E_NOMEM;
    else if (io) {
        c->next_all = io->conns;
        io->conns = c;
        if (role->target)
            atomic_fetch_add(&io->targets, 1);
        /* Added to epoll last: from here on the I/O thread may use it. */
        struct epoll_event ev = {.events = c->events, .data.ptr = c};
        *status = epoll_ctl(io->epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ? HX_E_SYS : HX_OK;
        if (*status != HX_OK) {
            io->conns = c->next_all;
            if (role->target)
                atomic_fetch_sub(&io->targets, 1);
            tcp_conn_destroy(c);
            c = NULL;
        } else if (role->target && atomic_load(&io->loop_serves)) {
            pthread_mutex_lock(&c->lock); /* the turning event loop reads it too */
            set_served(a, c, true);
            pthread_mutex_unlock(&c->lock);
        }
    }
    int err = errno;
    pthread_mutex_unlock(&t->lock);
    errno = err;
    /* The I/O thread may be blocked without a timeout, chosen while it had no
     * connection: it must start this one's heartbeats (and so see a peer that
     * never answers) even if no byte ever arrives on it. */
    if (c)
        tcp_io_wake(io);
    return c;
}

/* Stops the I/O thread, failing every tcp op with HX_E_CLOSED. */
static void tcp_shutdown(hx_agent *a)
{
    tcp_agent *t = T(a);
    if (!t)
        return;
    pthread_mutex_lock(&t->lock);
    tcp_io *io = t->io;
    /* A thread that failed has ended, but is joined here too. stopped is the
     * thread's own to set (io_exit): until then it frees what Python lets go,
     * from then on Python does (tcp_peer_destroy), never both at once. */
    bool join = io && !io->joined;
    if (join)
        io->joined = true;
    pthread_mutex_unlock(&t->lock);
    if (!join)
        return;
    atomic_store(&io->stop, true);
    tcp_io_wake(io);
    pthread_join(io->thread, NULL);
}

/* Frees what the stopped I/O thread left (connections Python never freed). */
static void io_free(hx_agent *a)
{
    tcp_io *io = T(a)->io;
    if (!io)
        return;
    conn *c = io->conns;
    while (c) {
        conn *next = c->next_all;
        if (c->fd >= 0)
            close(c->fd);
        tcp_conn_destroy(c);
        c = next;
    }
    io_close(io);
    T(a)->io = NULL;
}

static int tcp_init(hx_agent *a)
{
    tcp_agent *t = calloc(1, sizeof *t);
    if (!t)
        return HX_E_NOMEM;
    pthread_mutex_init(&t->lock, NULL);
    t->stall_ns = 10ull * 1000000000ull;
    t->way = TCP_WAY_COPY;
    t->serve_ns = 20000;
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

static void tcp_note_space(hx_agent *a)
{
    tcp_agent *t = T(a);
    pthread_mutex_lock(&t->lock);
    tcp_io *io = t->io && !t->io->stopped ? t->io : NULL;
    if (io) {
        atomic_store(&io->note_space, true);
        tcp_io_wake(io);
    }
    pthread_mutex_unlock(&t->lock);
}

/* Whether the event loop reads target conn c (tcp_notes_quiet): it polls
 * serve_epfd for its input, and the I/O thread stops watching for it. The
 * caller holds t->lock and c->lock. */
static void set_served(hx_agent *a, conn *c, bool served)
{
    /* A broken conn's fd is closed (or closing: tcp_conn_fail, which takes
     * it off serve_epfd if served) and its number may be another's. */
    if (c->served == served || c->broken)
        return;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(T(a)->io->serve_epfd, served ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, c->fd, &ev) != 0 && served)
        return; /* the I/O thread reads it, as before */
    c->served = served;
    tcp_update_interest(a, c); /* after: what waits is reported to the I/O thread (level-triggered) */
}

/* Sends the answers the event loop's reads held back (loop_owes), SERVE_MAX
 * bytes a conn at most: the rest goes when the socket has room (EPOLLOUT).
 * Caller holds t->lock. */
static void pay_owed(hx_agent *a, tcp_io *io)
{
    for (conn *c = io->conns; c && io->owed; c = c->next_all) {
        /* Being read by the I/O thread (input or output it was told of before the
         * conn was served): that read sends them, else a later turn does. */
        if (!c->owed || pthread_mutex_trylock(&c->rx_lock) != 0)
            continue;
        c->owed = false;
        io->owed--;
        pthread_mutex_lock(&c->lock);
        c->tx_held = false;
        int rc = c->broken || !c->unsent ? HX_OK : tcp_flush_budget(a, c, SERVE_MAX);
        tcp_update_interest(a, c);
        pthread_mutex_unlock(&c->lock);
        pthread_mutex_unlock(&c->rx_lock);
        if (rc < 0)
            tcp_peer_fail(&c->base, rc);
    }
}

/* Every target conn served (quiet) or the I/O thread's again. Caller holds t->lock. */
static void serve_all(hx_agent *a, tcp_io *io, bool quiet)
{
    if (quiet) {
        /* Should the loop stop turning without saying so (blocked), the
         * hold timer hands its conns back (flush_held). */
        atomic_store(&io->served_ns, tcp_now_ns());
        tcp_hold_arm(io);
    }
    atomic_store(&io->loop_serves, quiet);
    pay_owed(a, io);
    io->back_out = 0;
    for (conn *c = io->conns; c; c = c->next_all) {
        if (!c->target)
            continue;
        pthread_mutex_lock(&c->lock);
        c->back = false;
        set_served(a, c, quiet);
        pthread_mutex_unlock(&c->lock);
    }
}

/* Conns given back with more to read (serve_conn) are taken again once the
 * I/O thread has read what was left (no payload half read). Caller holds
 * t->lock. */
static void take_back(hx_agent *a, tcp_io *io)
{
    for (conn *c = io->conns; c && io->back_out; c = c->next_all) {
        if (!c->back || pthread_mutex_trylock(&c->rx_lock) != 0)
            continue;
        if (c->broken || !c->in_payload) {
            c->back = false;
            io->back_out--;
            pthread_mutex_lock(&c->lock);
            set_served(a, c, true);
            pthread_mutex_unlock(&c->lock);
        }
        pthread_mutex_unlock(&c->rx_lock);
    }
}

/* hx_agent_notes_quiet: while the event loop turns it reads the target
 * conns itself, so that a request wakes no thread: the I/O thread, blocked
 * on another, halted, virtual CPU, takes 25-40 us to wake here. */
static bool tcp_notes_quiet(hx_agent *a, bool quiet)
{
    tcp_agent *t = T(a);
    if (!t)
        return false;
    pthread_mutex_lock(&t->lock);
    tcp_io *io = t->io && !t->io->stopped ? t->io : NULL;
    if (io) {
        atomic_store(&io->loop_quiet, quiet);
        if (quiet || atomic_load(&io->loop_serves))
            serve_all(a, io, quiet);
    }
    pthread_mutex_unlock(&t->lock);
    return false;
}

/* Reads served conn c as the I/O thread would, SERVE_MAX bytes at most. On
 * a failure the I/O thread fails it (as a polled conn); one that had more
 * (a large payload arriving) goes back to that thread, so that it cannot
 * hold the event loop up, until that thread has read it (take_back).
 * Caller holds t->lock. */
static void serve_conn(hx_agent *a, conn *c)
{
    /* Busy: the I/O thread reads it now (a held notification retried); a
     * later turn does. broken is set under rx_lock (tcp_conn_fail). */
    if (!c->served || pthread_mutex_trylock(&c->rx_lock) != 0)
        return;
    /* A failure asked for (a dropped session, a stall) wins over what the
     * socket holds, as in on_event: the I/O thread's sweep applies it. */
    if (c->broken || atomic_load(&c->fail_req)) {
        pthread_mutex_unlock(&c->rx_lock);
        return;
    }
    c->rx_cap = SERVE_MAX;
    int rc = tcp_conn_read(a, c);
    bool more = c->rx_cap == 0;
    c->rx_cap = UINT64_MAX;
    pthread_mutex_unlock(&c->rx_lock);
    if (rc != HX_OK)
        tcp_peer_fail(&c->base, rc);
    if (rc != HX_OK || more) { /* read no more of a failed conn: the I/O thread fails it */
        if (c->owed)
            pay_owed(a, T(a)->io);
        pthread_mutex_lock(&c->lock);
        set_served(a, c, false);
        pthread_mutex_unlock(&c->lock);
    }
    if (rc == HX_OK && more) { /* taken again once the rest is read (take_back) */
        c->back = true;
        T(a)->io->back_out++;
        T(a)->io->given_back++;
    }
}

/* The event loop's turn (hx_agent_notes_ready) while it serves: the conns
 * with input are read. What they bring is queued (hx_note_push), none held
 * here: returns false. */
static bool tcp_notes_served(hx_agent *a)
{
    tcp_agent *t = T(a);
    if (!t)
        return false;
    struct epoll_event evs[16];
    pthread_mutex_lock(&t->lock); /* conns are freed under it: those reported are alive */
    tcp_io *io = t->io;
    bool serves = io && !io->stopped && atomic_load(&io->loop_quiet);
    if (serves && !atomic_load(&io->loop_serves))
        serve_all(a, io, true); /* the hold timer gave them back while the loop was held up: it turns again */
    else if (serves)
        atomic_store_explicit(&io->served_ns, tcp_now_ns(), memory_order_relaxed); /* flush_held */
    if (io && io->owed)
        pay_owed(a, io);
    if (serves && io->back_out)
        take_back(a, io);
    int n = serves ? epoll_wait(io->serve_epfd, evs, 16, 0) : 0;
    for (int i = 0; i < n; i++)
        serve_conn(a, evs[i].data.ptr);
    pthread_mutex_unlock(&t->lock);
    return false;
}

int hx_test_tcp_served(hx_agent *a, int *open, uint64_t *given_back)
{
    tcp_agent *t = T(a);
    int served = 0;
    *open = 0;
    pthread_mutex_lock(&t->lock);
    *given_back = t->io ? t->io->given_back : 0;
    for (conn *c = t->io ? t->io->conns : NULL; c; c = c->next_all) {
        if (!c->target || c->broken)
            continue;
        ++*open;
        pthread_mutex_lock(&c->lock);
        served += c->served;
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&t->lock);
    return served;
}

const hx_transport hx_tcp_transport = {.name = "tcp",
                                       .notes_quiet = tcp_notes_quiet,
                                       .notes_held = tcp_notes_served,
                                       .init = tcp_init,
                                       .shutdown = tcp_shutdown,
                                       .free = tcp_free,
                                       .note_space = tcp_note_space,
                                       .heard = tcp_heard};

void hx_agent_set_stall(hx_agent *a, uint64_t ns) { T(a)->stall_ns = ns; }

void hx_agent_set_busy_poll(hx_agent *a, uint32_t us) { T(a)->busy_ns = (uint64_t)us * 1000u; }

void hx_agent_set_serve_poll(hx_agent *a, uint32_t us) { T(a)->serve_ns = (uint64_t)us * 1000u; }

_Static_assert((int)HX_TCP_SEND_SPLICE == (int)TCP_WAY_SPLICE && (int)HX_TCP_SEND_COPY == (int)TCP_WAY_COPY,
               "one numbering");

void hx_agent_set_tcp_send(hx_agent *a, int way) { T(a)->way = (uint8_t)way; }

void hx_tcp_send_stats(hx_agent *a, uint64_t *spliced, uint64_t *copied)
{
    tcp_agent *t = T(a);
    *spliced = t ? atomic_load_explicit(&t->sent_by[TCP_WAY_SPLICE], memory_order_relaxed) : 0;
    *copied = t ? atomic_load_explicit(&t->sent_by[TCP_WAY_COPY], memory_order_relaxed) : 0;
}

void hx_agent_set_heartbeat(hx_agent *a, uint64_t interval_ns, uint64_t timeout_ns)
{
    T(a)->hb_interval_ns = interval_ns;
    T(a)->hb_timeout_ns = timeout_ns;
}
