/* The tcp transport, private to tcp/: one native I/O thread per agent (epoll)
 * serves every connection, in both roles. How it works (framing, ordering,
 * heartbeats, held bursts, busy polling): docs/tcp.md.
 *
 * Files, each calling only those after it: initiator.c and target.c (the two
 * roles), io.c (the I/O thread and the transport's agent state), conn.c
 * (connections: send queue, failure, lifetime), wire.c (frame headers). io.c
 * reaches a role only through the connection's tcp_role table.
 */
#ifndef AIOHIXL_TCP_H
#define AIOHIXL_TCP_H
#include "internal.h"
#include <time.h>
#include <unistd.h>

#define REQ_SIZE 48
#define RESP_SIZE 32
#define HX_TCP_CHUNK (1u << 20)
#define RBUF_SIZE (16u * 1024u)     /* each connection's read-ahead buffer */
#define RDIRECT (16u * 1024u)       /* the rest of a payload at least this big is received in place */
#define SERVE_MAX (256u * 1024u)    /* the event loop's read of a conn per turn (tcp_notes_served) */
#define OUTQ_HIGH 512               /* target stops reading requests above this many queued responses */
#define HOLD_MAX_NS 1000000         /* a held put waits at most this long for its flush */
#define ANSWER_BATCH (256u * 1024u) /* target: received bytes after which queued answers go out */
#define MORE_BATCH (1024u * 1024u)  /* the same while the initiator says more frames follow (REQ_MORE) */
#define FLUSH_POLL_NS 30000         /* hx_peer_flush: how long it reads for the burst's answers */
#define LONE_POLL_NS 50000          /* hx_peer_flush after HX_POSTED_POLL: how long it reads for the answer */
#define NOTE_POLL_NS 100000 /* the same for one that ends with a notification (answered after its task) */
#define POLL_SKIP 15        /* bursts (lone ops) not polled for after a poll that missed */

enum { W_PUT = 1, W_GET = 2, W_CHECK = 3, W_NOTE = 4, W_PING = 5 };
/* W_CHECK: sent before the frames of an op of more than one frame. Its
 * payload is one CHECK_ENTRY per piece of the op (region u32, 4 reserved,
 * key u64, offset u64, length u64), its region field the op checked (W_PUT or
 * W_GET). The target checks every entry before it places a byte; when one
 * fails, the check and every later frame of that op id are refused with that
 * status, so a refused op leaves the target's memory untouched. */
#define CHECK_ENTRY 32
enum { R_ACK = 1, R_DATA = 2, R_PONG = 3, R_ALIVE = 4 };
/* A request's flags byte. REQ_MORE: the initiator sends more frames right
 * behind this one (they were queued when it went out), so the target keeps
 * its answers for them (up to MORE_BATCH bytes) instead of answering each
 * time its socket runs dry in the middle of a burst. */
#define REQ_FLAGS 5
#define REQ_MORE 1u
/* Initiator frames that are no put or get (frame.opcode). */
enum { OP_NOTE = 3, OP_PING = 4 };

/* An initiator's op: done when its last chunk is answered. */
typedef struct tcp_op {
    uint64_t op_id;
    int remaining;
    int status;
    uint32_t nregions;
    hx_region *regions[];
} tcp_op;

typedef struct conn conn;

/* What a connection's role does with what is read on it, and its heartbeat:
 * tcp_initiator_role (initiator.c), tcp_target_role (target.c). The I/O
 * thread calls a role only through this table. Hooks that return int return
 * HX_OK, or the HX_E_* status the connection fails with. */
typedef struct tcp_role {
    bool target;
    uint32_t header_size; /* of what the other side sends: RESP_SIZE to an initiator, REQ_SIZE to a target */
    /* A header is complete in c->rhdr. */
    int (*header)(hx_agent *a, conn *c);
    /* The payload being received (c->in_payload) has all arrived. */
    int (*payload_done)(hx_agent *a, conn *c);
    /* The agent's notification queue has room again: a held notification is
     * queued now (NULL: the role holds none). */
    int (*note_retry)(hx_agent *a, conn *c);
    /* Queues a heartbeat frame. Caller holds c->lock. */
    void (*beacon_locked)(hx_agent *a, conn *c);
    /* What Python calls on the connection (initiator; NULL for target
     * connections, which Python never holds). */
    const hx_peer_ops *peer_ops;
} tcp_role;

extern const tcp_role tcp_initiator_role, tcp_target_role;

/* One frame on a connection's send queue: a request chunk (initiator) or a
 * response (target). */
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

struct conn {
    hx_peer base; /* initiator conns are the Python-visible peer */
    const tcp_role *role;
    struct conn *next_all;
    int fd;
    bool target; /* role->target, read on every frame */
    uint64_t session;
    pthread_mutex_t lock;
    /* rx_lock: the receive state below, and the socket's reads. Held by the
     * I/O thread while it reads, or by a submitting thread that busy-polls
     * for its own op's answer (initiator, Agent(busy_poll_us=...)). Taken
     * before lock, never after it. */
    pthread_mutex_t rx_lock;
    frame *head, *tail, *unsent;
    uint32_t outq;
    /* initiator: frames queued, and answered (in order), under lock */
    uint64_t queued, answered;
    bool polling; /* a submitting thread busy-polls: the I/O thread stops watching for input */
    bool served;  /* target: the event loop reads it while it turns (io.c, tcp_notes_quiet), as above */
    bool back;    /* target: given back to the I/O thread with more to read, to be taken again */
    /* An op went out HX_POSTED_POLL then: polling was set before its send, so
     * its answer is the poster's to read (hx_peer_flush); should that not come
     * within HOLD_MAX_NS, the hold timer hands reading back to the I/O thread.
     * 0 once a poll or another submit took over (under lock). */
    uint64_t poll_owed;
    uint8_t poll_skip; /* bursts before hx_peer_flush polls for answers again (under lock) */
    bool tx_io;        /* the I/O thread is in a sendmsg without the lock (tcp_flush_io) */
    bool tx_self;      /* the posting thread sends what it just queued: no EPOLLOUT for it yet */
    /* initiator: the pipe large puts' payloads are spliced through (conn.c),
     * -1 without one; the bytes in it, not yet in the socket (whoever sends) */
    int pipe_r, pipe_w;
    bool pipe_tried;
    uint64_t piped;
    uint32_t events;
    bool broken;
    atomic_int fail_req; /* a failure another thread asked for */
    atomic_bool freeing; /* Python let go of the peer */
    /* receive state (I/O thread only) */
    uint8_t rhdr[REQ_SIZE];
    uint32_t rgot;
    bool in_payload;
    uint8_t *rdst;
    uint64_t rlen, rdone;
    int rstatus;
    hx_region *rregion;
    uint64_t rop_id;
    uint8_t *rbuf; /* read-ahead: bytes received, not yet taken (rpos..rend) */
    uint32_t rpos, rend;
    uint8_t *rcheck;    /* a CHECK's payload being received (target) */
    uint32_t rcheck_op; /* the op it checks: W_PUT or W_GET */
    bool refusing;      /* a CHECK failed: refuse the rest of op refuse_op_id */
    uint64_t refuse_op_id;
    int refuse_status;
    frame *rframe;
    /* last_tx_ns: when bytes last went out, or the frame now at the head of
     * the send queue became the head (heartbeats; the drain stall check) */
    uint64_t last_rx_ns, last_tx_ns;
    /* when another transport last proved the peer alive (tcp_heard: its RC
     * completions); the heartbeat timeout counts from the later of the two */
    atomic_uint_fast64_t heard_ns;
    uint64_t held_since; /* the send queue was started by a held put then (0: not) */
    /* target: the notification being received, or held while the agent's
     * queue is full (reading stops meanwhile); the last refused op */
    bool rnote, note_held;
    bool reading;            /* target: answers queued while reading go out together (tcp_conn_read) */
    uint64_t rx_since_flush; /* target: bytes received since queued answers last went out */
    bool rx_short;           /* the last receive took less than it offered: the socket was drained */
    bool rx_fresh;           /* a receive happened in this tcp_conn_read (rx_short is its) */
    uint64_t rx_cap;         /* target: bytes this read may still receive (the event loop's: SERVE_MAX) */
    bool rmore;              /* target: the last request said more frames follow it (REQ_MORE) */
    bool tx_held;            /* target: queued answers wait for those frames (no EPOLLOUT meanwhile) */
    bool noted;              /* target: this read queued a notification (note_done) */
    bool owed;               /* target: the event loop sends its answers on its next turn (pay_owed) */
    uint32_t note_len;
    uint64_t note_id, note_dep;
    uint64_t refused_op;
    int refused_status;
    uint8_t note_buf[HX_NOTE_MAX];
};

/* The I/O thread, started with the agent's first tcp connection. */
typedef struct tcp_io {
    atomic_int payloads;           /* target conns in the middle of a PUT payload */
    atomic_uint_fast64_t requests; /* peers' requests read, pings aside: io.c's serve_poll */
    atomic_int targets;            /* target conns: their answers must drain, so the stall check runs */
    int epfd;
    int evfd;
    int tfd;                   /* the hold timer (tcp_hold_arm) */
    pthread_mutex_t hold_lock; /* setting the timer */
    atomic_bool hold_armed;    /* it is set, for hold_deadline */
    uint64_t hold_deadline;
    pthread_t thread;
    atomic_bool stop;
    conn *conns;  /* guarded by tcp_agent.lock */
    bool stopped; /* takes no connection any more (shut down, or the thread failed); under the lock */
    bool joined;  /* tcp_shutdown joined the thread; under the lock */
    int error;    /* the errno epoll_wait failed with (0: it did not) */
    atomic_bool note_space;         /* the agent's notification queue has room again */
    atomic_bool loop_quiet;         /* the event loop turns (tcp_notes_quiet) */
    atomic_bool loop_serves;        /* and reads target conns itself; the hold timer may give them back */
    int serve_epfd;                 /* those conns, which it polls for input on each turn */
    atomic_uint_fast64_t served_ns; /* when it last did: a loop silent for HOLD_MAX_NS gives them back */
    uint64_t given_back;            /* conns it gave back with more to read (under the agent's lock): tests */
    int back_out;                   /* of those, the ones not taken again yet (under the agent's lock) */
    int owed;                       /* served conns the loop owes answers (pay_owed; same lock) */
} tcp_io;

/* The transport's state in an agent: a->state[HX_TRANSPORT_TCP], made when
 * the agent is. A peer that stops in the middle of a PUT's payload for
 * stall_ns, or that leaves one of our answers (a GET's data) unread for
 * stall_ns, is cut off: the region the frame touches is busy meanwhile, and
 * Region.close() waits for it. Live peers that merely have nothing to send
 * are never affected. */
/* How a large put's payload leaves: spliced from its pages, or copied in by
 * sendmsg. As hixl.h's HX_TCP_SEND_*. */
enum { TCP_WAY_SPLICE = 0, TCP_WAY_COPY = 1 };

typedef struct tcp_agent {
    pthread_mutex_t lock; /* io, and io->conns */
    tcp_io *io;
    uint64_t stall_ns;
    uint64_t hb_interval_ns, hb_timeout_ns; /* 0: no heartbeats */
    /* Agent(busy_poll_us=...): 0, or how long the I/O thread polls after
     * activity before it blocks, and how long a submitting thread polls for
     * the answer to a small op it sent itself (the op then ends inline). */
    uint64_t busy_ns;
    uint64_t serve_ns; /* Agent(serve_poll_us=...): io.c's serve_poll() */
    atomic_int pipes;  /* initiator conns holding a splice pipe (conn.c: at most MAX_PIPES) */
    uint8_t way;       /* Agent(tcp_send=...): how large puts' payloads leave (TCP_WAY_*, conn.c) */
    /* large puts' bytes sent each way (TCP_WAY_SPLICE, TCP_WAY_COPY): hx_tcp_send_stats */
    atomic_uint_fast64_t sent_by[2];
} tcp_agent;

static inline tcp_agent *T(hx_agent *a) { return a->state[HX_TRANSPORT_TCP]; }

static inline uint64_t tcp_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Wakes the I/O thread (its sweep: failures asked for, conns to free). */
static inline void tcp_io_wake(tcp_io *io)
{
    uint64_t one = 1;
    ssize_t n = write(io->evfd, &one, sizeof one);
    (void)n;
}

/* wire.c: frame headers, all integers little endian. A request is magic,
 * op (W_*), region, offset, length (1..HX_TCP_CHUNK), op id and the region's
 * key (from its descriptor); a response
 * magic, kind (R_*), status, op id and the length of the data that follows. */
typedef struct {
    int op;
    uint32_t region;
    uint64_t off, len, op_id, key;
} tcp_req;

typedef struct {
    int kind;
    int32_t status;
    uint64_t op_id, len;
} tcp_resp;

void tcp_put_req(uint8_t *h, const tcp_req *r);
void tcp_put_resp(uint8_t *h, const tcp_resp *r);
/* Decode a header; HX_E_PROTO when it breaks the protocol (magic; a request's op or length). */
int tcp_get_req(const uint8_t *h, tcp_req *r);
int tcp_get_resp(const uint8_t *h, tcp_resp *r);

/* conn.c */
/* A connection of this role on fd, not yet known to the I/O thread; NULL when out of memory. */
conn *tcp_conn_new(hx_agent *a, int fd, const tcp_role *role, uint64_t session);
void tcp_conn_destroy(conn *c);
/* The peer ops of an initiator conn: a failure asked for; Python lets go. */
void tcp_peer_fail(hx_peer *p, int status);
void tcp_peer_destroy(hx_peer *p);
/* Ends a connection: every frame fails with status. I/O thread only. */
void tcp_conn_fail(hx_agent *a, conn *c, int status);
void tcp_frame_free(hx_agent *a, frame *f, int status);
/* Caller holds c->lock for this and the flushes below. */
void tcp_append_locked(conn *c, frame *first, frame *last, uint32_t count);
/* Busy polling: the op a submitting thread waits for (0: none); set when its
 * success was taken inline instead of through the completion ring. */
extern __thread uint64_t tcp_inline_op;
extern __thread bool tcp_inline_done;
/* Sends what can be sent without blocking, at most budget bytes. Returns
 * HX_OK, or HX_E_CONNLOST when the connection is broken (all three). */
int tcp_flush_budget(hx_agent *a, conn *c, uint64_t budget);
int tcp_flush_locked(hx_agent *a, conn *c);
/* The I/O thread's flush: the lock is let go while each sendmsg runs, so a
 * posting thread queues more meanwhile instead of waiting. */
int tcp_flush_io(hx_agent *a, conn *c);
void tcp_update_interest(hx_agent *a, conn *c);

/* io.c */
/* Reads until the socket is drained; caller holds c->rx_lock. Returns HX_OK,
 * or the status the connection fails with (HX_E_PROTO, HX_E_CONNLOST). */
int tcp_conn_read(hx_agent *a, conn *c);
/* A connection of this role on fd, handed to the I/O thread (started on
 * first use); NULL with *status when it cannot be (fd is the caller's then). */
conn *tcp_io_add(hx_agent *a, int fd, const tcp_role *role, uint64_t session, int *status);
/* The backstop of held puts: unless the caller flushed them within
 * HOLD_MAX_NS, the I/O thread sends them. Arms the timer when it is idle; a
 * flush leaves it set (a system call each way costs a burst more than the
 * timer firing now and then, finding nothing old held and setting itself
 * for the oldest held put, if any). */
void tcp_hold_arm(tcp_io *io);

#endif
