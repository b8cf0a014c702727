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

uint64_t tcp_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void tcp_io_wake(tcp_io *io)
{
    uint64_t one = 1;
    ssize_t n = write(io->evfd, &one, sizeof one);
    (void)n;
}

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

/* The hold timer fired: what was held longer than HOLD_MAX_NS (its event
 * loop, which was to flush it, is busy) goes out from here; the timer is set
 * again for the oldest put held for less. */
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
        /* held_since may be later than now: set by a post since now was read */
        if (c->unsent && c->held_since && (c->held_since > now || now - c->held_since < HOLD_MAX_NS)) {
            uint64_t due = c->held_since + HOLD_MAX_NS;
            next = !next || due < next ? due : next;
        } else if (c->unsent && tcp_flush_io(a, c) < 0) {
            atomic_store(&c->fail_req, HX_E_CONNLOST);
        }
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&t->lock);
    if (next) {
        pthread_mutex_lock(&io->hold_lock);
        set_hold_timer(io, next, tcp_now_ns());
        pthread_mutex_unlock(&io->hold_lock);
    }
}

/* The bytes of a payload that are now complete: hand them on. */
static int payload_done(hx_agent *a, conn *c)
{
    if (c->target)
        return tcp_target_payload_done(a, c);
    c->in_payload = false;
    frame *f = c->rframe;
    c->rframe = NULL;
    c->rdst = NULL;
    tcp_chunk_done(a, c, f, HX_OK);
    return 0;
}

/* One receive: into the read-ahead buffer, or, for the rest of a large
 * payload, straight into its place with whatever follows it (the next
 * headers) into the buffer, in one call. Returns bytes read, 0 when the
 * socket is drained, -2 when the connection is gone. */
static ssize_t receive(conn *c)
{
    if (!c->rbuf && !(c->rbuf = malloc(RBUF_SIZE)))
        return -2;
    struct iovec iov[2];
    int n = 0;
    bool direct = c->in_payload && c->rlen - c->rdone >= RDIRECT;
    uint64_t want = 0;
    if (direct) {
        want = c->rlen - c->rdone;
        if (!c->rdst && want > sizeof scratch)
            want = sizeof scratch;
        iov[n++] = (struct iovec){.iov_base = c->rdst ? c->rdst + c->rdone : scratch, .iov_len = want};
    }
    if (!direct || want == c->rlen - c->rdone)
        iov[n++] = (struct iovec){.iov_base = c->rbuf, .iov_len = RBUF_SIZE};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n};
    uint64_t offered = n == 2 ? want + RBUF_SIZE : iov[0].iov_len;
    for (;;) {
        ssize_t r = recvmsg(c->fd, &msg, MSG_DONTWAIT);
        if (r == 0)
            return -2;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -2;
        }
        c->last_rx_ns = tcp_now_ns();
        c->rx_short = (uint64_t)r < offered;
        uint64_t placed = direct ? ((uint64_t)r < want ? (uint64_t)r : want) : 0;
        c->rdone += placed;
        c->rpos = 0;
        c->rend = (uint32_t)((uint64_t)r - placed);
        return r;
    }
}

static int flush_answers(hx_agent *a, conn *c)
{
    pthread_mutex_lock(&c->lock);
    int rc = c->unsent ? tcp_flush_locked(a, c) : 0;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* Returns 1 when reading stopped for back-pressure, else as tcp_conn_read. */
static int conn_read(hx_agent *a, conn *c)
{
    uint32_t size = c->target ? REQ_SIZE : RESP_SIZE;
    for (;;) {
        if (c->in_payload && c->rdone == c->rlen) {
            int rc = payload_done(a, c);
            if (rc < 0)
                return rc;
            continue;
        }
        /* Back-pressure: answer first, or wait for room for the notification.
         * What the buffer holds meanwhile is taken when reading resumes
         * (tcp_read_held). */
        if ((c->target && c->outq >= OUTQ_HIGH) || c->note_held)
            return 1;
        if (c->rpos == c->rend) {
            /* Answers go out together once the socket is drained (a receive
             * that did not fill what it offered took all there was), so a
             * burst of requests is answered in one send and the initiator
             * woken once, not once a receive; and after ANSWER_BATCH bytes,
             * so none waits long behind new input. While more frames are
             * announced (REQ_MORE), only after MORE_BATCH bytes. */
            if (c->reading && (c->rmore ? c->rx_since_flush >= MORE_BATCH
                                        : c->rx_short || c->rx_since_flush >= ANSWER_BATCH)) {
                if (flush_answers(a, c) < 0)
                    return -2;
                c->rx_since_flush = 0;
            }
            ssize_t r = receive(c);
            if (r <= 0)
                return (int)r;
            c->rx_since_flush += (uint64_t)r;
            continue;
        }
        uint32_t avail = c->rend - c->rpos;
        if (c->in_payload) {
            uint64_t take = c->rlen - c->rdone < avail ? c->rlen - c->rdone : avail;
            if (c->rdst)
                memcpy(c->rdst + c->rdone, c->rbuf + c->rpos, take);
            c->rpos += (uint32_t)take;
            c->rdone += take;
            continue; /* done (or not) at the top */
        }
        uint32_t take = size - c->rgot < avail ? size - c->rgot : avail;
        memcpy(c->rhdr + c->rgot, c->rbuf + c->rpos, take);
        c->rpos += take;
        c->rgot += take;
        if (c->rgot < size)
            continue;
        c->rgot = 0;
        int rc = c->target ? tcp_target_request(a, c) : tcp_initiator_response(a, c);
        if (rc < 0)
            return rc;
    }
}

int tcp_conn_read(hx_agent *a, conn *c)
{
    c->reading = c->target;
    int rc = conn_read(a, c);
    c->reading = false;
    /* Drained while more frames are announced: the answers wait for them
     * (reading stopped for back-pressure sends them now). */
    c->tx_held = rc == 0 && c->target && c->rmore && c->rx_since_flush < MORE_BATCH;
    if (c->tx_held)
        return 0;
    c->rx_since_flush = 0;
    if (rc >= 0 && c->target && flush_answers(a, c) < 0)
        rc = -2;
    return rc < 0 ? rc : 0;
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
        if (holding)
            c->last_rx_ns = now;
        else if (since(now, c->last_rx_ns) > t->hb_timeout_ns)
            atomic_store(&c->fail_req, HX_E_SILENT);
        if (since(now, c->last_tx_ns) >= t->hb_interval_ns && !c->unsent)
            tcp_beacon_locked(a, c);
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&t->lock);
}

/* Reading resumes after back-pressure: what the read-ahead buffer already
 * holds is taken now (no event would say it is there). Same returns as
 * tcp_conn_read. */
static int read_held(hx_agent *a, conn *c)
{
    if (c->rpos == c->rend || c->broken)
        return 0;
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
        if (tcp_target_note_retry(a, c) < 0) {
            atomic_store(&c->fail_req, HX_E_CONNLOST);
            continue;
        }
        int rc = read_held(a, c);
        if (rc < 0) {
            atomic_store(&c->fail_req, rc == -1 ? HX_E_PROTO : HX_E_CONNLOST);
            continue;
        }
        pthread_mutex_lock(&c->lock);
        tcp_update_interest(a, c); /* reading resumes: what waits in the socket comes next */
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&t->lock);
}

static void *io_main(void *arg)
{
    hx_agent *a = arg;
    tcp_agent *t = T(a);
    tcp_io *io = t->io;
    struct epoll_event evs[64];
    uint64_t active_until = 0, next_stall_check = 0, next_beat = 0;
    /* Agent(busy_poll_us=...): poll this long after activity before
     * blocking. Off by default: on two cores a polling thread takes the core
     * the other side needs, and an idle agent must cost nothing. */
    uint64_t spin_ns = t->busy_ns;
    while (!atomic_load(&io->stop)) {
        /* In the latency mode a spin after activity saves the wake-up of a
         * blocked thread for the next frame; otherwise, and once idle, the
         * thread blocks, waking only for heartbeats and the stall check
         * while it has connections. */
        bool watch = io->payloads || atomic_load(&io->targets);
        int timeout = tcp_now_ns() < active_until ? 0 : (watch ? 1000 : -1);
        if (timeout != 0 && t->hb_interval_ns && io->conns) {
            uint64_t now = tcp_now_ns();
            int beat_ms = next_beat > now ? (int)((next_beat - now) / 1000000) + 1 : 0;
            if (timeout < 0 || beat_ms < timeout)
                timeout = beat_ms;
        }
        int n = epoll_wait(io->epfd, evs, 64, timeout);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (n > 0)
            active_until = tcp_now_ns() + spin_ns;
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
            if (evs[i].data.ptr == &io->tfd) {
                uint64_t v;
                ssize_t r = read(io->tfd, &v, sizeof v);
                (void)r;
                flush_held(a);
                sweep_needed = true; /* a failed flush asked for a failure */
                continue;
            }
            if (c->broken)
                continue;
            /* A failure asked for (a local close) wins over what the socket says. */
            int req = atomic_exchange(&c->fail_req, 0);
            if (req) {
                tcp_conn_fail(a, c, req);
                sweep_needed = true;
                continue;
            }
            uint32_t e = evs[i].events;
            if (e & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
                pthread_mutex_lock(&c->rx_lock);
                int rc = tcp_conn_read(a, c);
                pthread_mutex_unlock(&c->rx_lock);
                if (rc < 0) {
                    tcp_conn_fail(a, c, rc == -1 ? HX_E_PROTO : HX_E_CONNLOST);
                    sweep_needed = true;
                    continue;
                }
                pthread_mutex_lock(&c->lock);
                if (c->target)
                    tcp_update_interest(a, c);
                else if (c->unsent)
                    rc = tcp_flush_io(a, c); /* puts held for a flush whose event loop is busy */
                pthread_mutex_unlock(&c->lock);
                if (rc < 0) {
                    tcp_conn_fail(a, c, HX_E_CONNLOST);
                    sweep_needed = true;
                    continue;
                }
            }
            if (e & EPOLLOUT) {
                pthread_mutex_lock(&c->lock);
                int rc = tcp_flush_io(a, c);
                pthread_mutex_unlock(&c->lock);
                if (rc < 0) {
                    tcp_conn_fail(a, c, HX_E_CONNLOST);
                    sweep_needed = true;
                    continue;
                }
                if (c->target && c->outq < OUTQ_HIGH && (rc = read_held(a, c)) < 0) {
                    tcp_conn_fail(a, c, rc == -1 ? HX_E_PROTO : HX_E_CONNLOST);
                    sweep_needed = true;
                    continue;
                }
                if (c->target) {
                    pthread_mutex_lock(&c->lock);
                    tcp_update_interest(a, c);
                    pthread_mutex_unlock(&c->lock);
                }
            }
        }
        if (atomic_exchange(&io->note_space, false))
            resume_notes(a);
        if (t->hb_interval_ns && tcp_now_ns() >= next_beat) {
            heartbeat(a);
            /* a quarter interval: silence is seen within a quarter of it */
            next_beat = tcp_now_ns() + t->hb_interval_ns / 4;
            sweep_needed = true;
        }
        if (watch && tcp_now_ns() >= next_stall_check) {
            cut_stalled(a);
            next_stall_check = tcp_now_ns() + 1000000000ull;
            sweep_needed = true;
        }
        if (sweep_needed)
            sweep(a);
    }
    /* Stopping: every connection fails as closed, target ones are freed. */
    pthread_mutex_lock(&t->lock);
    for (conn *c = io->conns; c; c = c->next_all)
        tcp_conn_fail(a, c, HX_E_CLOSED);
    pthread_mutex_unlock(&t->lock);
    sweep(a);
    return NULL;
}

tcp_io *tcp_io_get(hx_agent *a, int *status)
{
    tcp_agent *t = T(a);
    pthread_mutex_lock(&t->lock);
    tcp_io *io = t->io;
    if (io) {
        if (io->stopped) {
            *status = HX_E_CLOSED;
            io = NULL;
        }
        pthread_mutex_unlock(&t->lock);
        return io;
    }
    *status = HX_E_SYS;
    io = calloc(1, sizeof *io);
    if (!io)
        goto fail;
    io->epfd = epoll_create1(EPOLL_CLOEXEC);
    io->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    io->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (io->epfd < 0 || io->evfd < 0 || io->tfd < 0)
        goto fail;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    struct epoll_event tev = {.events = EPOLLIN, .data.ptr = &io->tfd};
    if (epoll_ctl(io->epfd, EPOLL_CTL_ADD, io->evfd, &ev) < 0 ||
        epoll_ctl(io->epfd, EPOLL_CTL_ADD, io->tfd, &tev) < 0)
        goto fail;
    atomic_init(&io->hold_armed, false);
    pthread_mutex_init(&io->hold_lock, NULL);
    atomic_init(&io->stop, false);
    atomic_init(&io->targets, 0);
    t->io = io;
    if (pthread_create(&io->thread, NULL, io_main, a) != 0) {
        t->io = NULL;
        goto fail;
    }
    pthread_setname_np(io->thread, "hixl-tcp-io"); /* top -H, perf: which thread is which */
    pthread_mutex_unlock(&t->lock);
    return io;
fail:
    if (io) {
        if (io->epfd >= 0)
            close(io->epfd);
        if (io->evfd >= 0)
            close(io->evfd);
        if (io->tfd >= 0)
            close(io->tfd);
        free(io);
    }
    pthread_mutex_unlock(&t->lock);
    return NULL;
}

/* Stops the I/O thread, failing every tcp op with HX_E_CLOSED. */
static void tcp_shutdown(hx_agent *a)
{
    tcp_agent *t = T(a);
    if (!t)
        return;
    pthread_mutex_lock(&t->lock);
    tcp_io *io = t->io;
    bool join = io && !io->stopped;
    if (join)
        io->stopped = true;
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
    close(io->epfd);
    close(io->evfd);
    close(io->tfd);
    pthread_mutex_destroy(&io->hold_lock);
    free(io);
    T(a)->io = NULL;
}

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

const hx_transport hx_tcp_transport = {.name = "tcp",
                                       .init = tcp_init,
                                       .shutdown = tcp_shutdown,
                                       .free = tcp_free,
                                       .note_space = tcp_note_space};

void hx_agent_set_stall(hx_agent *a, uint64_t ns) { T(a)->stall_ns = ns; }

void hx_agent_set_busy_poll(hx_agent *a, uint32_t us) { T(a)->busy_ns = (uint64_t)us * 1000u; }

void hx_agent_set_heartbeat(hx_agent *a, uint64_t interval_ns, uint64_t timeout_ns)
{
    T(a)->hb_interval_ns = interval_ns;
    T(a)->hb_timeout_ns = timeout_ns;
}
