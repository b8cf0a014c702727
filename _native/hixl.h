/* The native interface of aiohixl, as cffi sees it (build_ffi.py reads the
 * block between the CDEF markers). Every handle is opaque; every call is
 * made with the GIL released, so each one does its own locking. */
#ifndef AIOHIXL_HIXL_H
#define AIOHIXL_HIXL_H
#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */
typedef struct hx_agent hx_agent;
typedef struct hx_peer hx_peer;

/* Status codes shared by every call and every completion. */
enum {
    HX_OK = 0,
    HX_E_BOUNDS = -1,   /* range outside the region */
    HX_E_ACCESS = -2,   /* region lacks the right needed */
    HX_E_NOREGION = -3, /* no such region (never was, or closed) */
    HX_E_CLOSED = -4,   /* agent or peer closed locally */
    HX_E_CONNLOST = -5, /* the connection to the peer broke */
    HX_E_PROTO = -6,    /* malformed frame from the peer */
    HX_E_NOMEM = -7,
    HX_E_BUSY = -8,    /* region still in use (non-blocking remove) */
    HX_E_INVAL = -9,   /* bad argument */
    HX_E_SYS = -10,    /* a system call failed; errno tells */
    HX_E_REMOTE = -11, /* the target refused for a reason of its own */
    HX_E_SILENT = -12  /* the peer stopped answering heartbeats */
};

enum { HX_ACCESS_REMOTE_WRITE = 1, HX_ACCESS_REMOTE_READ = 2 };
enum { HX_OP_PUT = 1, HX_OP_GET = 2 };
/* Or'ed into hx_peer_post's opcode: the caller calls hx_peer_flush soon
 * (asyncio: once the loop's current callbacks have run), so a transport may
 * hold the op until then and send a burst of them together. */
enum { HX_OP_HOLD = 0x100 };
/* Or'ed in with HX_OP_HOLD: a notification (hx_peer_note) follows this op at
 * once, so a transport may hold it whatever its size and send both together. */
enum { HX_OP_NOTE_NEXT = 0x200 };
/* Or'ed into hx_peer_post's opcode: the caller calls hx_peer_flush when it
 * is about to wait for this op, so a transport may leave reading its answer
 * to that call (HX_POSTED_POLL). */
enum { HX_OP_POLL = 0x400 };
/* hx_peer_post: HX_DONE_INLINE: the op finished inline, no completion will
 * follow; HX_POSTED_HELD: posted, and held until hx_peer_flush; HX_POSTED_POLL:
 * posted with HX_OP_POLL and sent whole; its answer is left for the caller's
 * hx_peer_flush to read (for a millisecond at most, then the transport reads
 * it itself). */
enum { HX_POSTED = 0, HX_DONE_INLINE = 1, HX_POSTED_HELD = 2, HX_POSTED_POLL = 3 };

/* sys_errno: with HX_E_SYS, the errno of the failure, taken on the thread
 * that saw it (the event loop's errno is another thread's); else 0. */
typedef struct {
    uint64_t op_id;
    int32_t status;
    int32_t sys_errno;
} hx_completion;

/* A notification that arrived: from `source` (the session key of the peer
 * that sent it, 0 for this agent itself), `len` bytes of data; with
 * HX_NOTE_IMM in flags, a verbs WRITE WITH IMM of `nbytes` carrying `imm`;
 * with HX_NOTE_RUNG, read from a shm doorbell ring by the draining thread
 * (the event loop's), no native thread of this agent woken for it; with
 * HX_NOTE_SERVED, from a tcp connection that the event loop reads itself
 * while it turns (hx_agent_notes_quiet). */
enum { HX_NOTE_MAX = 4096, HX_NOTE_IMM = 1, HX_NOTE_RUNG = 2, HX_NOTE_SERVED = 4 };
typedef struct {
    uint64_t source;
    uint32_t imm;
    uint32_t flags;
    uint32_t nbytes;
    uint32_t len;
    uint8_t data[4096];
} hx_note;

/* One contiguous piece of an op: local region + offset <-> remote region + offset.
 * loopback, shm and tcp address the remote end with remote_region and
 * remote_off, and prove they were given the region with remote_key (its
 * descriptor's key, checked by the target on every access). verbs uses rkey and raddr instead, both set by
 * the initiator: the remote region's rkey and the remote virtual address of this piece (the remote NIC checks
 * both). */
typedef struct {
    uint32_t local_region;
    uint32_t remote_region;
    uint64_t local_off;
    uint64_t remote_off;
    uint64_t len;
    uint32_t rkey;
    uint64_t raddr;
    uint64_t remote_key;
} hx_sge;

hx_agent *hx_agent_new(uint32_t ring_capacity, uint32_t copy_threads, int *status);
int hx_agent_wake_fd(hx_agent *a);
/* tcp: a connection whose PUT payload stops arriving, or that stops reading
 * the answers to its requests, for ns nanoseconds is closed (default 10 s), so
 * a region it was writing or reading cannot stay busy forever. */
void hx_agent_set_stall(hx_agent *a, uint64_t ns);
/* Takes up to max completions; returns how many. Clears the wake fd first. */
int hx_agent_drain(hx_agent *a, hx_completion *out, int max);
/* For tests: completes op_id with status from a native thread of its own,
 * whose errno is err, as a transport thread that saw a system call fail. */
int hx_test_complete_on_thread(hx_agent *a, uint64_t op_id, int status, int err);
/* For tests: 1 when a completion waits in the ring with no wake owed for it
 * (one a flush left there for its caller to drain, not drained). */
int hx_test_ring_unseen(hx_agent *a);
/* Notifications: take up to max (oldest first); how many are queued; how
 * many could not be held back and were dropped; the queue's capacity (a full
 * queue holds senders back: default 4096). */
int hx_agent_drain_notes(hx_agent *a, hx_note *out, int max);
int hx_agent_notes_pending(hx_agent *a);
/* Whether a drain_notes may find any: 0 only when nothing is queued natively
 * and no transport holds any. The event loop's thread only. No system call,
 * except while quiet: tcp's target connections are read here then. */
int hx_agent_notes_ready(hx_agent *a);
/* quiet = 1: the event loop looks for notifications itself on each of its
 * turns (hx_agent_notes_ready), so senders need not wake it: shm's doorbells
 * stop asking to be rung, and the loop reads tcp's target connections (the
 * I/O thread stops watching them). quiet = 0: the doorbells ask again, the
 * I/O thread reads again; returns 1 when a ring already holds records, which
 * the caller must then drain (no ring will announce them), else 0. */
int hx_agent_notes_quiet(hx_agent *a, int quiet);
uint64_t hx_agent_notes_dropped(hx_agent *a);
/* When the queue last went from empty to holding a notification, as of the
 * last drain_notes that took any (CLOCK_MONOTONIC ns, time.monotonic_ns()'s
 * clock; 0: none taken yet): the arrival of the oldest it took, or earlier
 * when a drain before it left some. */
uint64_t hx_agent_notes_arrived(hx_agent *a);
void hx_agent_set_notes(hx_agent *a, uint32_t capacity);
/* tcp: every interval_ns each connection is pinged by its native side; one
 * that hears nothing for timeout_ns fails with HX_E_SILENT. */
void hx_agent_set_heartbeat(hx_agent *a, uint64_t interval_ns, uint64_t timeout_ns);
/* tcp latency mode (0: off, the default): the I/O thread polls us
 * microseconds after activity before it blocks, and a thread that posts a
 * small op and sends all of it itself polls up to us microseconds for the
 * answer, so the op can end inline (HX_DONE_INLINE) with no thread woken.
 * Set before the first tcp connection. */
void hx_agent_set_busy_poll(hx_agent *a, uint32_t us);
/* tcp: after reading peers' requests the I/O thread polls us microseconds
 * (20 by default, 0: never) for the next before it blocks, while they come
 * within 5 x us of each other: a request to a blocked thread pays for waking
 * it, and an idle agent still costs nothing. Set before the first tcp
 * connection. */
void hx_agent_set_serve_poll(hx_agent *a, uint32_t us);
/* tcp: how a put's payload of 64 KiB or more leaves: copied in by sendmsg
 * (the default) or spliced from its pages (docs/tcp.md, "Sending"). Set
 * before the first tcp connection. */
enum { HX_TCP_SEND_SPLICE = 0, HX_TCP_SEND_COPY = 1 };
void hx_agent_set_tcp_send(hx_agent *a, int way);
/* tcp: bytes of such puts' frames sent by splice and by copy so far. */
void hx_tcp_send_stats(hx_agent *a, uint64_t *spliced, uint64_t *copied);
/* Tests: whether the answers on the way on tcp peer p are left for the
 * poster to read (HX_POSTED_POLL), not the I/O thread. */
int hx_test_tcp_poll_owed(hx_peer *p);
/* Tests: how many tcp target connections the event loop reads itself now
 * (hx_agent_notes_quiet), how many target connections are open, and how
 * many times it gave one back with more to read (a large payload). */
int hx_test_tcp_served(hx_agent *a, int *open, uint64_t *given_back);
/* Stops accepting work, fails queued work with HX_E_CLOSED, waits for work
 * already touching memory, joins native threads. Safe to call twice. */
void hx_agent_shutdown(hx_agent *a);
void hx_agent_free(hx_agent *a);

/* key: the region's secret, in its descriptor; a peer's access (tcp request,
 * loopback op) must carry it. */
int hx_region_add(hx_agent *a, uint32_t id, uint64_t addr, uint64_t len, uint32_t access, uint64_t key);
/* Withdraws a region: no new access starts; with wait != 0 blocks until the
 * accesses in progress end, else returns HX_E_BUSY while any is in progress
 * (the region stays withdrawn either way). */
int hx_region_remove(hx_agent *a, uint32_t id, int wait);

hx_peer *hx_loopback_new(hx_agent *a, int *status);
int hx_peer_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n);
/* hx_peer_post of one piece addressed by region and offset (loopback, shm,
 * tcp): the scalars of one hx_sge, without building one (the hot path of a
 * single put or get from Python). */
int hx_peer_post1(hx_peer *p, int opcode, uint64_t op_id, uint32_t local_region, uint64_t local_off,
                  uint32_t remote_region, uint64_t remote_off, uint64_t len, uint64_t remote_key);
/* Sends the ops hx_peer_post held (HX_POSTED_HELD). After one that came back
 * HX_POSTED_POLL, with nothing held, it reads that op's answer for a while
 * (tcp; into the completion ring): call it just before the thread would block.
 * The caller drains the ring (hx_agent_drain) once it returns: what it
 * completed on this thread is not signalled on the wake fd. */
void hx_peer_flush(hx_peer *p);
/* hx_peer_flush by a caller about to wait for op_id, which hx_peer_post
 * called HX_POSTED_POLL. HX_DONE_INLINE: op_id succeeded on this thread,
 * no completion follows, and the ring holds nothing and no notification
 * may wait (the caller has nothing to drain). Else HX_POSTED: the caller
 * drains the ring, where op_id's completion is or will be. */
int hx_peer_await(hx_peer *p, uint64_t op_id);
/* Fails the peer's queued ops with HX_E_CLOSED; ops already copying finish. */
void hx_peer_close(hx_peer *p);
/* Fails every op outstanding on the peer with status (e.g. HX_E_CONNLOST when
 * the control plane saw the peer die); later posts fail the same way. */
void hx_peer_fail(hx_peer *p, int status);
/* A notification of len <= HX_NOTE_MAX bytes for the peer's agent, delivered
 * after the op dep (0: none) placed every byte, and not at all if it failed;
 * the op op_id completes once it is queued there. HX_E_BUSY: the local queue
 * (loopback) is full, try again after draining; HX_E_INVAL: this transport
 * carries none. flags: HX_OP_POLL, as for hx_peer_post (HX_POSTED_POLL: the
 * caller's hx_peer_await reads its answer, and those of the ops it follows). */
int hx_peer_note(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len, int flags);
/* A put of one piece (hx_peer_post1's scalars) and a notification of len
 * bytes behind it as one op, op_id: it completes once the message is queued
 * at the target, or fails as the put did (the message is then dropped). One
 * call, and nothing held for a flush. flags: HX_OP_POLL, as for hx_peer_post.
 * HX_E_INVAL: the transport has no such op (only tcp has). */
int hx_peer_put_note(hx_peer *p, int flags, uint64_t op_id, uint32_t local_region, uint64_t local_off,
                     uint32_t remote_region, uint64_t remote_off, uint64_t len, uint64_t remote_key,
                     const uint8_t *data, uint32_t dlen);
/* 0 while the peer works, else the status its ops now fail with. */
int hx_peer_status(hx_peer *p);
/* p's successful completions prove the remote end of channel alive (verbs: an
 * RC completion needs the remote QP): from now on they count as heard on
 * channel's connection, as a byte read there does, for its heartbeat timeout.
 * A peer that completes nothing and sends nothing still goes silent. */
void hx_peer_heard_with(hx_peer *p, hx_peer *channel);
void hx_peer_free(hx_peer *p);

/* tcp transport. Both take ownership of fd (a connected stream socket).
 * connect: this side initiates ops over fd. serve: this side is the target
 * of the ops arriving on fd; first/first_len are sent before anything else. */
hx_peer *hx_tcp_connect_fd(hx_agent *a, int fd, int *status);
int hx_tcp_serve_fd(hx_agent *a, int fd, uint64_t session, const uint8_t *first, uint32_t first_len);
/* Closes every served connection of a session (its control connection ended). */
void hx_tcp_drop_session(hx_agent *a, uint64_t session);
/* 1 while a served connection of the session is up, 0 once all have ended
 * (closed, or silent past the heartbeat timeout), -1 if it never had one. */
int hx_tcp_session_alive(hx_agent *a, uint64_t session);

/* Same-host peer (process pid). map: a memfd region of the peer, mapped here
 * (the fd is not kept). attach: a range of the peer's address space, reached
 * with cross-memory attach. forget: withdraws either; with wait != 0 blocks
 * until no op uses it. probe: reads len bytes at addr of pid (0 or -errno). */
hx_peer *hx_shm_new(hx_agent *a, int pid, int *status);
int hx_shm_map(hx_peer *p, uint32_t region, int fd, uint64_t size, uint32_t access);
int hx_shm_attach(hx_peer *p, uint32_t region, uint64_t addr, uint64_t size, uint32_t access);
int hx_shm_forget(hx_peer *p, uint32_t region, int wait);
int hx_cma_probe(int pid, uint64_t addr, uint8_t *out, uint32_t len);
/* The shm doorbell (shm/bell.h). serve (target): a ring for a session's
 * notifications, its memfd in *ring_fd and the initiator's end of its socket
 * pair in *peer_fd, both for the caller to pass on and close. close: ends it
 * (session over); what the ring still holds is queued first. bell
 * (initiator): from now on hx_peer_note on this peer writes the target's ring
 * (HX_DONE_INLINE), HX_E_BUSY while it is full. Tests: forge writes a record
 * at the next slot, its seq that slot's plus seq_skew and its len, and
 * publishes the tail moved by tail_step, as a hostile initiator could. */
typedef struct hx_bell hx_bell;
hx_bell *hx_shm_bell_serve(hx_agent *a, uint64_t session, int *ring_fd, int *peer_fd, int *status);
void hx_shm_bell_close(hx_agent *a, hx_bell *b);
int hx_shm_bell(hx_peer *p, int ring_fd, int sock_fd);
enum { HX_BELL_SLOTS = 128 }; /* records a doorbell ring holds */
int hx_test_shm_forge(hx_peer *p, int64_t seq_skew, uint32_t len, int64_t tail_step);

/* verbs transport (libibverbs loaded at run time). open: device by name ("" for
 * the first), port, GID index, QP ack timeout exponent and retry count; on
 * failure hx_verbs_error() says why. reg: registers region's memory, gives
 * the rkey. Posts address the remote end with an sge's rkey and raddr.
 * peer_new/peer_connect: the initiator's QP; accept: the target's QP for a
 * session. */
int hx_verbs_open(hx_agent *a, const char *dev, int port, int gid_index, int timeout, int retry_cnt);
const char *hx_verbs_error(void);
int hx_verbs_built(void); /* 1 when compiled with rdma-core's headers */
int hx_verbs_local(hx_agent *a, uint8_t *gid, uint16_t *lid, int *mtu);
int hx_verbs_reg(hx_agent *a, uint32_t region, int readonly, uint32_t *rkey);
hx_peer *hx_verbs_peer_new(hx_agent *a, uint32_t *qpn, uint32_t *psn, int *status);
int hx_verbs_peer_connect(hx_peer *p, uint32_t qpn, uint32_t psn, const uint8_t *gid, uint16_t lid, int mtu);
int hx_verbs_accept(hx_agent *a, uint64_t session, uint32_t qpn, uint32_t psn, const uint8_t *gid,
                    uint16_t lid, int mtu, uint32_t *lqpn, uint32_t *lpsn);
void hx_verbs_drop_session(hx_agent *a, uint64_t session);
int hx_verbs_post_imm(hx_peer *p, uint64_t op_id, const hx_sge *sges, uint32_t n, uint32_t imm);
/* Raw RC peers (not aiohixl). export_new: a target QP, in a PD of its own, with
 * one MR over [off, off+len) of region granting access (HX_ACCESS_*) and no
 * more; gives the QP's number and PSN and the MR's address and rkey; the QP
 * is dropped with hx_verbs_drop_session(session). export_connect: to RTS
 * toward the raw peer's QP, receives posted. raw_peer_new: an initiator QP
 * that grants its remote end nothing; connected by hx_verbs_peer_connect. */
int hx_verbs_export_new(hx_agent *a, uint64_t session, uint32_t region, uint64_t off, uint64_t len,
                        uint32_t access, uint32_t *qpn, uint32_t *psn, uint64_t *addr, uint32_t *rkey);
int hx_verbs_export_connect(hx_agent *a, uint64_t session, uint32_t qpn, uint32_t psn, const uint8_t *gid,
                            uint16_t lid, int mtu);
hx_peer *hx_verbs_raw_peer_new(hx_agent *a, uint32_t *qpn, uint32_t *psn, int *status);

/* Faults every page in (and asks for huge pages) so later copies do not pay
 * page faults: the kernel's bulk populate over up to `threads` threads, else
 * page by page (returns 1 then, 0 when the bulk populate did it). Blocks. */
int hx_prefault(void *addr, uint64_t len, int write, int threads);
/* hx_prefault on one of the agent's copy threads, completed through the ring
 * as op_id (HX_OK; HX_E_CLOSED if the agent shut down before it started).
 * The memory must stay mapped until that completion: the thread touches it
 * until then. HX_POSTED, or HX_E_NOMEM with nothing started. */
int hx_prefault_post(hx_agent *a, uint64_t op_id, void *addr, uint64_t len, int write, int threads);
/* Drops the page-table entries of a shared mapping about to be unmapped, a
 * piece at a time (MADV_DONTNEED; its pages stay in the file). Blocks. */
void hx_unpopulate(void *addr, uint64_t len);
/* Counters kept natively per agent (relaxed atomics, one add per post and
 * per failure), read in one call. transports[t], t in the order of
 * hx_transport_name(t): ops posted through this agent's peers of that
 * transport, their bytes (the sum of the sges' lengths) and errors (posts
 * refused natively plus ops that completed with a failure). Notifications:
 * queued here (received), accepted for sending by this agent's peers (sent),
 * and dropped (hx_agent_notes_dropped). */
enum { HX_STATS_TRANSPORTS = 4 };
typedef struct {
    uint64_t ops;
    uint64_t bytes;
    uint64_t errors;
} hx_transport_stats;
typedef struct {
    hx_transport_stats transports[4];
    uint64_t notes_received;
    uint64_t notes_sent;
    uint64_t notes_dropped;
} hx_stats;
void hx_agent_stats(hx_agent *a, hx_stats *out);
/* "loopback", "shm", "tcp", "verbs" for t in [0, HX_STATS_TRANSPORTS); NULL past it. */
const char *hx_transport_name(int t);

/* Tests only: the next `count` passes through a fault site fail as the system
 * call there could (0 disarms). Process-wide. COPY_JOB: the heap copy of the
 * bookkeeping of a copy for the pool (out of memory); EPOLL_WAIT: the tcp I/O
 * thread's wait (EBADF). */
enum { HX_FAULT_COPY_JOB = 0, HX_FAULT_EPOLL_WAIT = 1, HX_NFAULTS = 2 };
void hx_test_fail_next(int site, int count);
/* CDEF-END */

#endif
