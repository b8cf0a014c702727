/* The tcp transport: one native I/O thread per agent (epoll) serves every tcp
 * connection, in both roles.
 *
 * Initiator: an op is cut into chunks of at most HX_TCP_CHUNK bytes, each a
 * request frame (a 48-byte header, then for a PUT the payload, sent straight
 * from the source memory with sendmsg). The target answers every request in
 * order, so responses are matched to the oldest outstanding chunk: no address
 * ever comes from the wire.
 *
 * Target: each request is checked against the registry (region alive, bounds,
 * right) before a byte is placed; a PUT payload is received straight into the
 * region, and acknowledged only once it is all there. A refused PUT's payload
 * is read into a scratch buffer and dropped. A frame that breaks the protocol
 * closes that connection and no other.
 *
 * Notifications (W_NOTE) travel on the same connection, after the data of
 * the op they follow, so the target places that data first; the target queues
 * the message with the agent (holding the sender back while the queue is
 * full) and acknowledges it. Heartbeats: the initiator sends W_PING when it
 * has sent nothing for a heartbeat interval (answered R_PONG, in order), the
 * target R_ALIVE (unsolicited, skipped by the matching); a side that hears
 * nothing for the heartbeat timeout fails the connection with HX_E_SILENT,
 * unless it is itself holding the other side back. All of it on the native
 * thread: a blocked event loop stops none of it.
 *
 * Sending: a small op goes out from the posting thread at once. A put of
 * HX_HOLD_MIN..HX_HOLD_MAX posted with HX_OP_HOLD (the asyncio fast path,
 * while ops come in bursts) is only queued; the caller's hx_peer_flush sends
 * the burst together, in as few sendmsg calls as the socket takes: once the
 * burst's first op gets a waiter (gather), else once the event loop's current
 * callbacks have run. Should that loop be blocked, the
 * I/O thread sends them after HOLD_MAX_NS (the hold timer) or once an answer
 * wakes it. What is left over is the I/O thread's, which sends without the
 * connection's lock, so posting never waits on its sendmsg.
 *
 * Reading: every connection reads through a small read-ahead buffer (rbuf);
 * the rest of a large payload is received in place, the bytes after it into
 * the buffer, in one recvmsg. A target sends its answers together once the
 * socket is drained or ANSWER_BATCH bytes came in; while the last request
 * said more frames follow it (REQ_MORE, set by the initiator on every frame
 * that had another queued behind it when it went out), only once MORE_BATCH
 * bytes came in or a frame without it arrived: a burst is answered once, at
 * its end, not each time the target catches up with the sender.
 *
 * A burst flush (hx_peer_flush) that sent everything reads the connection
 * itself for up to FLUSH_POLL_NS, as the latency mode's poster does: on
 * loopback the target has mostly taken the burst by the time its sendmsg
 * returns, so the answers are there within microseconds, and the I/O
 * thread's wake-up and then the event loop's (each ~15-40 us on a VM) are
 * not paid. Python drains the completions right after the flush.
 *
 * Latency mode (busy_ns, Agent(busy_poll_us=...)): the I/O thread polls
 * busy_ns after activity before it blocks, and a thread that posted an op and
 * sent all of it reads the connection itself (rx_lock; the I/O thread stops
 * watching it for input meanwhile) until the op is answered or busy_ns pass;
 * a success it reads ends the op inline (tcp_inline_op). Off, nothing polls:
 * the I/O thread blocks whenever it has nothing to do.
 *
 * Files: wire.c (frame headers), conn.c (connections: send queue, failure,
 * lifetime), initiator.c, target.c, io.c (the I/O thread and the transport's
 * agent state). This header is private to them.
 */
#ifndef AIOHIXL_TCP_H
#define AIOHIXL_TCP_H
#include "internal.h"

#define REQ_SIZE 48
#define RESP_SIZE 32
#define HX_TCP_CHUNK (1u << 20)
#define RBUF_SIZE (16u * 1024u)     /* each connection's read-ahead buffer */
#define RDIRECT (16u * 1024u)       /* the rest of a payload at least this big is received in place */
#define OUTQ_HIGH 512               /* target stops reading requests above this many queued responses */
#define HOLD_MAX_NS 1000000         /* a held put waits at most this long for its flush */
#define ANSWER_BATCH (256u * 1024u) /* target: received bytes after which queued answers go out */
#define MORE_BATCH (1024u * 1024u)  /* the same while the initiator says more frames follow (REQ_MORE) */
#define FLUSH_POLL_NS 30000         /* hx_peer_flush: how long it reads for the burst's answers */
#define POLL_SKIP 15                /* bursts not polled for after a poll that missed its answers */

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

typedef struct conn {
    hx_peer base; /* initiator conns are the Python-visible peer */
    struct conn *next_all;
    int fd;
    bool target;
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
    bool polling;      /* a submitting thread busy-polls: the I/O thread stops watching for input */
    uint8_t poll_skip; /* bursts before hx_peer_flush polls for answers again (under lock) */
    bool tx_io;        /* the I/O thread is in a sendmsg without the lock (tcp_flush_io) */
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
    uint64_t held_since; /* the send queue was started by a held put then (0: not) */
    /* target: the notification being received, or held while the agent's
     * queue is full (reading stops meanwhile); the last refused op */
    bool rnote, note_held;
    bool reading;            /* target: answers queued while reading go out together (tcp_conn_read) */
    uint64_t rx_since_flush; /* target: bytes received since queued answers last went out */
    bool rx_short;           /* the last receive took less than it offered: the socket was drained */
    bool rmore;              /* target: the last request said more frames follow it (REQ_MORE) */
    bool tx_held;            /* target: queued answers wait for those frames (no EPOLLOUT meanwhile) */
    uint32_t note_len;
    uint64_t note_id, note_dep;
    uint64_t refused_op;
    int refused_status;
    uint8_t note_buf[HX_NOTE_MAX];
} conn;

/* The I/O thread, started with the agent's first tcp connection. */
typedef struct tcp_io {
    int payloads;       /* target conns in the middle of a PUT payload (I/O thread only) */
    atomic_int targets; /* target conns: their answers must drain, so the stall check runs */
    int epfd;
    int evfd;
    int tfd;                   /* the hold timer (tcp_hold_arm) */
    pthread_mutex_t hold_lock; /* setting the timer */
    atomic_bool hold_armed;    /* it is set, for hold_deadline */
    uint64_t hold_deadline;
    pthread_t thread;
    atomic_bool stop;
    conn *conns; /* guarded by tcp_agent.lock */
    bool stopped;
    atomic_bool note_space; /* the agent's notification queue has room again */
} tcp_io;

/* The transport's state in an agent: a->state[HX_TRANSPORT_TCP], made when
 * the agent is. A peer that stops in the middle of a PUT's payload for
 * stall_ns, or that leaves one of our answers (a GET's data) unread for
 * stall_ns, is cut off: the region the frame touches is busy meanwhile, and
 * Region.close() waits for it. Live peers that merely have nothing to send
 * are never affected. */
typedef struct tcp_agent {
    pthread_mutex_t lock; /* io, and io->conns */
    tcp_io *io;
    uint64_t stall_ns;
    uint64_t hb_interval_ns, hb_timeout_ns; /* 0: no heartbeats */
    /* Agent(busy_poll_us=...): 0, or how long the I/O thread polls after
     * activity before it blocks, and how long a submitting thread polls for
     * the answer to a small op it sent itself (the op then ends inline). */
    uint64_t busy_ns;
} tcp_agent;

static inline tcp_agent *T(hx_agent *a) { return a->state[HX_TRANSPORT_TCP]; }

uint64_t tcp_now_ns(void);

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
/* Decode a header; -1 when it breaks the protocol (magic; a request's op or length). */
int tcp_get_req(const uint8_t *h, tcp_req *r);
int tcp_get_resp(const uint8_t *h, tcp_resp *r);

/* conn.c */
conn *tcp_conn_add(hx_agent *a, int fd, bool target, uint64_t session, int *status);
void tcp_conn_destroy(conn *c);
/* Ends a connection: every frame fails with status. I/O thread only. */
void tcp_conn_fail(hx_agent *a, conn *c, int status);
void tcp_frame_free(hx_agent *a, frame *f, int status);
/* Caller holds c->lock for these three. */
void tcp_append_locked(conn *c, frame *first, frame *last, uint32_t count);
/* Busy polling: the op a submitting thread waits for (0: none); set when its
 * success was taken inline instead of through the completion ring. */
extern __thread uint64_t tcp_inline_op;
extern __thread bool tcp_inline_done;
/* Sends what can be sent without blocking, at most budget bytes. Returns 0,
 * or -1 when the connection is broken. */
int tcp_flush_budget(hx_agent *a, conn *c, uint64_t budget);
int tcp_flush_locked(hx_agent *a, conn *c);
/* The I/O thread's flush: the lock is let go while each sendmsg runs, so a
 * posting thread queues more meanwhile instead of waiting. */
int tcp_flush_io(hx_agent *a, conn *c);
void tcp_update_interest(hx_agent *a, conn *c);

/* initiator.c */
int tcp_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n);
void tcp_flush(hx_peer *p);
int tcp_note(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len);
/* Queues a heartbeat frame (either side). Caller holds c->lock. */
void tcp_beacon_locked(hx_agent *a, conn *c);
/* A response header is complete. Returns -1 to fail with a protocol error. */
int tcp_initiator_response(hx_agent *a, conn *c);
void tcp_chunk_done(hx_agent *a, conn *c, frame *f, int status);

/* target.c: a request header is complete; a PUT payload has all arrived.
 * Both return -1 to fail with a protocol error, -2 when the connection is gone. */
int tcp_target_request(hx_agent *a, conn *c);
int tcp_target_payload_done(hx_agent *a, conn *c);
/* Tries again to queue a held notification; same returns. */
int tcp_target_note_retry(hx_agent *a, conn *c);

/* io.c */
/* Reads until the socket is drained; caller holds c->rx_lock. Returns -1 to
 * fail with a protocol error, -2 when the connection is gone, 0 otherwise. */
int tcp_conn_read(hx_agent *a, conn *c);
/* The I/O thread, started on first use; NULL with *status when it cannot be. */
tcp_io *tcp_io_get(hx_agent *a, int *status);
void tcp_io_wake(tcp_io *io);
/* The backstop of held puts: unless the caller flushed them within
 * HOLD_MAX_NS, the I/O thread sends them. Arms the timer when it is idle; a
 * flush leaves it set (a system call each way costs a burst more than the
 * timer firing now and then, finding nothing old held and setting itself
 * for the oldest held put, if any). */
void tcp_hold_arm(tcp_io *io);
uint64_t tcp_now_ns(void);

#endif
