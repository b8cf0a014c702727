/* The shm doorbell (bell.h): the initiator's half writes records and rings;
 * the target's half moves them into the agent's notification queue when its
 * event loop drains, and before any other notification from that session
 * (its native channel's), so a sender's notifications stay in order whichever
 * way each went. */
#include "shm/bell.h"
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---- the initiator's half ---- */

int bell_out_attach(bell_out *b, int ring_fd, int sock_fd)
{
    if (b->h)
        return HX_E_INVAL;
    /* A ring the target could shrink would make our writes fault (SIGBUS). */
    int seals = fcntl(ring_fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
        return HX_E_ACCESS;
    off_t end = lseek(ring_fd, 0, SEEK_END);
    struct stat st;
    if (end < 0 || (uint64_t)end < HX_BELL_BYTES || fstat(sock_fd, &st) != 0 || !S_ISSOCK(st.st_mode))
        return HX_E_INVAL;
    void *m = mmap(NULL, HX_BELL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
    if (m == MAP_FAILED)
        return HX_E_SYS;
    int fd = fcntl(sock_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
        munmap(m, HX_BELL_BYTES);
        return HX_E_SYS;
    }
    b->h = m;
    b->slots = (bell_slot *)((uint8_t *)m + sizeof(bell_header));
    b->tail = atomic_load(&b->h->tail);
    b->fd = fd;
    return HX_OK;
}

static int publish(bell_out *b, uint64_t tail)
{
    /* seq_cst store, then seq_cst load: either the target, arming `waiting`
     * before its last look at `tail`, sees this record, or we see it armed. */
    atomic_store(&b->h->tail, tail);
    if (atomic_load(&b->h->waiting) && atomic_exchange(&b->h->waiting, 0)) {
        char one = 1;
        /* MSG_DONTWAIT whatever the target did to its socket. A full queue
         * means the target has wake-ups to read already. */
        ssize_t n = send(b->fd, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)n;
    }
    return HX_DONE_INLINE;
}

int bell_out_ring(bell_out *b, const uint8_t *data, uint32_t len)
{
    int closed = atomic_load_explicit(&b->h->closed, memory_order_acquire);
    if (closed)
        return closed == HX_E_PROTO ? HX_E_PROTO : HX_E_CONNLOST;
    uint64_t head = atomic_load_explicit(&b->h->head, memory_order_acquire);
    if (b->tail - head >= HX_BELL_SLOTS) /* full (or a head we cannot believe: also full) */
        return HX_E_BUSY;
    bell_slot *s = &b->slots[b->tail % HX_BELL_SLOTS];
    memcpy(s->data, data, len);
    atomic_store_explicit(&s->len, len, memory_order_relaxed);
    atomic_store_explicit(&s->seq, b->tail, memory_order_relaxed);
    return publish(b, ++b->tail);
}

int bell_out_forge(bell_out *b, int64_t seq_skew, uint32_t len, int64_t tail_step)
{
    bell_slot *s = &b->slots[b->tail % HX_BELL_SLOTS];
    atomic_store(&s->len, len);
    atomic_store(&s->seq, b->tail + (uint64_t)seq_skew);
    return publish(b, b->tail + (uint64_t)tail_step);
}

void bell_out_free(bell_out *b)
{
    if (!b->h)
        return;
    munmap(b->h, HX_BELL_BYTES);
    close(b->fd);
    b->h = NULL;
}

/* ---- the target's half ---- */

struct hx_bell {
    struct hx_bell *next;
    uint64_t source; /* the session's key: what its notifications say they come from */
    bell_header *h;
    bell_slot *slots;
    uint64_t head; /* ours: the shared one is only published */
    int fd;        /* our end of the socket pair, in the agent's wake set */
    bool broken;
};

typedef struct {
    pthread_mutex_t lock; /* the list, and every bell's reading */
    hx_bell *list;
    atomic_int count;
    bool quiet; /* bell_quiet: rings found empty are left unarmed (under lock) */
} bell_state;

#define S(a) ((bell_state *)(a)->state[HX_TRANSPORT_SHM])

int bell_init(hx_agent *a)
{
    bell_state *st = calloc(1, sizeof *st);
    if (!st)
        return HX_E_NOMEM;
    pthread_mutex_init(&st->lock, NULL);
    a->state[HX_TRANSPORT_SHM] = st;
    return HX_OK;
}

static void broken(hx_agent *a, hx_bell *b)
{
    b->broken = true;
    atomic_store(&b->h->closed, HX_E_PROTO);
    hx_note_dropped(a);
}

/* Moves what the ring holds into the queue (all of it with force, else as
 * far as the queue has room); the records it still holds. An emptied ring
 * is armed, unless the loop looks itself (quiet). Under st->lock. */
static uint32_t take(hx_agent *a, hx_bell *b, bool force, bool quiet)
{
    while (!b->broken) {
        uint64_t tail = atomic_load_explicit(&b->h->tail, memory_order_acquire);
        if (tail == b->head) {
            if (quiet)
                return 0;
            atomic_store(&b->h->waiting, 1);
            tail = atomic_load(&b->h->tail);
            if (tail == b->head)
                return 0;
        }
        if (tail - b->head > HX_BELL_SLOTS) {
            broken(a, b); /* a tail behind ours, or past a full ring */
            return 0;
        }
        bell_slot *s = &b->slots[b->head % HX_BELL_SLOTS];
        uint64_t seq = atomic_load_explicit(&s->seq, memory_order_relaxed);
        uint32_t len = atomic_load_explicit(&s->len, memory_order_relaxed); /* read once */
        if (seq != b->head || len > HX_NOTE_MAX) {
            broken(a, b);
            return 0;
        }
        int rc = hx_note_enqueue(a, b->source, s->data, len, force);
        if (rc == HX_E_BUSY)
            return (uint32_t)(tail - b->head);
        if (rc != HX_OK)
            hx_note_dropped(a);
        b->head++;
        atomic_store_explicit(&b->h->head, b->head, memory_order_release);
    }
    return 0;
}

/* Reads every wake-up queued on a bell's socket. Each ring is a one-byte
 * datagram: one recvmmsg takes up to a batch of them, so a bell rung once
 * costs one call, not a read and then a read that finds nothing. */
static void clear_bell(hx_bell *b)
{
    enum { BATCH = 16 };
    char buf[BATCH];
    struct iovec iov[BATCH];
    struct mmsghdr msgs[BATCH];
    memset(msgs, 0, sizeof msgs);
    for (int j = 0; j < BATCH; j++) {
        iov[j] = (struct iovec){.iov_base = &buf[j], .iov_len = 1};
        msgs[j].msg_hdr.msg_iov = &iov[j];
        msgs[j].msg_hdr.msg_iovlen = 1;
    }
    while (recvmmsg(b->fd, msgs, BATCH, MSG_DONTWAIT, NULL) == BATCH)
        ;
}

/* Reads the wake-ups of the bells that were rung (level-triggered: else the
 * loop would wake again at once); only those. One bell: its socket is read
 * at once (one call, where asking the wake set which were rung and then
 * reading it is two). A ring that lands after it leaves the fd readable, and
 * the loop drains again. Under st->lock. */
static void clear_rung(hx_agent *a, bell_state *st)
{
    if (st->list && !st->list->next) {
        clear_bell(st->list);
        return;
    }
    struct epoll_event ev[64];
    int n = epoll_wait(a->poll_fd, ev, 64, 0);
    for (int i = 0; i < n; i++)
        if (ev[i].data.ptr)
            clear_bell(ev[i].data.ptr);
}

uint32_t bell_move(hx_agent *a, bool all, uint64_t source)
{
    bell_state *st = S(a);
    if (!st || !atomic_load_explicit(&st->count, memory_order_relaxed))
        return 0;
    uint32_t held = 0;
    pthread_mutex_lock(&st->lock);
    if (all)
        clear_rung(a, st);
    for (hx_bell *b = st->list; b; b = b->next)
        if (all || b->source == source)
            held += take(a, b, false, st->quiet);
    pthread_mutex_unlock(&st->lock);
    return held;
}

bool bell_quiet(hx_agent *a, bool quiet)
{
    bell_state *st = S(a);
    if (!st)
        return false;
    bool held = false;
    pthread_mutex_lock(&st->lock);
    st->quiet = quiet;
    for (hx_bell *b = st->list; b && !quiet; b = b->next) {
        if (b->broken)
            continue;
        /* Armed, then the tail read again (seq_cst both, as in take): a
         * record published before the arm is seen here, one after it rings. */
        atomic_store(&b->h->waiting, 1);
        held |= atomic_load(&b->h->tail) != b->head;
    }
    pthread_mutex_unlock(&st->lock);
    return held;
}

bool bell_held(hx_agent *a)
{
    bell_state *st = S(a);
    if (!st || !atomic_load_explicit(&st->count, memory_order_relaxed))
        return false;
    bool held = false;
    pthread_mutex_lock(&st->lock);
    for (hx_bell *b = st->list; b && !held; b = b->next)
        held = !b->broken && atomic_load_explicit(&b->h->tail, memory_order_acquire) != b->head;
    pthread_mutex_unlock(&st->lock);
    return held;
}

hx_bell *hx_shm_bell_serve(hx_agent *a, uint64_t session, int *ring_fd, int *peer_fd, int *status)
{
    bell_state *st = S(a);
    hx_bell *b = calloc(1, sizeof *b);
    int sv[2] = {-1, -1};
    int memfd = memfd_create("aiohixl-bell", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    *status = HX_E_SYS;
    if (!st || !b || memfd < 0 || ftruncate(memfd, HX_BELL_BYTES) != 0 ||
        fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
        socketpair(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0)
        goto fail;
    void *m = mmap(NULL, HX_BELL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (m == MAP_FAILED)
        goto fail;
    b->h = m;
    b->slots = (bell_slot *)((uint8_t *)m + sizeof(bell_header));
    b->source = session;
    b->fd = sv[0];
    atomic_store(&b->h->waiting, 1);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = b};
    if (epoll_ctl(a->poll_fd, EPOLL_CTL_ADD, b->fd, &ev) != 0) {
        munmap(m, HX_BELL_BYTES);
        goto fail;
    }
    pthread_mutex_lock(&st->lock);
    b->next = st->list;
    st->list = b;
    atomic_fetch_add(&st->count, 1);
    pthread_mutex_unlock(&st->lock);
    *ring_fd = memfd;
    *peer_fd = sv[1];
    *status = HX_OK;
    return b;
fail:
    if (memfd >= 0)
        close(memfd);
    if (sv[0] >= 0) {
        close(sv[0]);
        close(sv[1]);
    }
    free(b);
    return NULL;
}

static void bell_destroy(hx_agent *a, hx_bell *b)
{
    atomic_store(&b->h->closed, HX_E_CONNLOST);
    epoll_ctl(a->poll_fd, EPOLL_CTL_DEL, b->fd, NULL);
    close(b->fd);
    munmap(b->h, HX_BELL_BYTES);
    free(b);
}

void hx_shm_bell_close(hx_agent *a, hx_bell *b)
{
    bell_state *st = S(a);
    pthread_mutex_lock(&st->lock);
    /* What the ring holds was sent: queued, past the queue's bound if need be
     * (by at most a ring's worth), not lost with the session. */
    uint64_t before = b->head;
    take(a, b, true, false);
    bool moved = b->head != before;
    for (hx_bell **pp = &st->list; *pp; pp = &(*pp)->next)
        if (*pp == b) {
            *pp = b->next;
            break;
        }
    atomic_fetch_sub(&st->count, 1);
    bell_destroy(a, b);
    pthread_mutex_unlock(&st->lock);
    if (moved)
        hx_wake(a);
}

void bell_shutdown(hx_agent *a)
{
    bell_state *st = S(a);
    if (!st)
        return;
    pthread_mutex_lock(&st->lock);
    for (hx_bell *b = st->list; b; b = b->next)
        atomic_store(&b->h->closed, HX_E_CONNLOST); /* initiators' later notes fail, not vanish */
    pthread_mutex_unlock(&st->lock);
}

void bell_free(hx_agent *a)
{
    bell_state *st = S(a);
    if (!st)
        return;
    while (st->list) {
        hx_bell *b = st->list;
        st->list = b->next;
        bell_destroy(a, b);
    }
    pthread_mutex_destroy(&st->lock);
    free(st);
    a->state[HX_TRANSPORT_SHM] = NULL;
}
