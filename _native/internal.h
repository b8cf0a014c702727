/* What the native modules share with each other and not with Python. */
#ifndef AIOHIXL_INTERNAL_H
#define AIOHIXL_INTERNAL_H
#include "hixl.h"
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>

#define HX_REGION_BUCKETS 256

typedef struct hx_registry hx_registry;

typedef struct hx_region {
    struct hx_region *next; /* bucket chain */
    hx_registry *reg;
    uint32_t id;
    uint32_t access;
    uint8_t *base;
    uint64_t len;
    uint64_t key;  /* what a peer's access must carry (the agent's own regions) */
    uint32_t busy; /* accesses in progress; guarded by reg->lock */
    bool removed;
    uint8_t kind; /* HX_MEM_*: how the bytes are reached */
    void *mr;     /* the verbs memory registration, if any */
} hx_region;

enum {
    HX_MEM_DIRECT = 0, /* mapped in this process: memcpy */
    HX_MEM_CMA = 1     /* another process's address: process_vm_readv/writev */
};

/* Regions by id, each with a count of the accesses in progress. The agent's
 * own memory is one; a same-host peer's mappings of remote memory another. */
struct hx_registry {
    pthread_mutex_t lock;
    pthread_cond_t idle; /* some region's busy count fell to zero */
    hx_region *buckets[HX_REGION_BUCKETS];
    void (*release)(void *ctx, void *mr); /* drops a region's mr once it is idle */
    void *release_ctx;
};

/* A unit of copying for the pool: one piece of one job. With pid != 0 the
 * remote end (dst for a put, src for a get) is in process pid. A task of
 * opcode HX_TASK_POPULATE faults dst[0, len) in over up to pid threads
 * (src non-NULL: for writing), hx_prefault's work off the caller's thread. */
typedef struct hx_task {
    struct hx_task *next;
    struct hx_job *job;
    uint8_t *dst;
    const uint8_t *src;
    uint64_t len;
    int pid;
    int opcode;
    bool stream; /* a large copy in this address space: hx_copy_stream, not memmove */
} hx_task;

enum { HX_TASK_POPULATE = 16 }; /* not an hx_peer_post opcode */

/* One op on the copy pool: completes when its last task is done. */
typedef struct hx_job {
    uint64_t op_id;
    uint64_t peer_id;
    atomic_int *peer_failed; /* non-zero: the peer broke, the op fails with it */
    atomic_int remaining;
    atomic_int status;
    uint32_t nregions;
    int transport;        /* HX_TRANSPORT_* of the peer: where a failure is counted */
    hx_region *regions[]; /* acquired; released when the job ends */
} hx_job;

typedef struct hx_peer_ops {
    int (*post)(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n);
    /* A notification for the peer's agent (NULL: the transport carries none). */
    int (*note)(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len, int flags);
    void (*fail)(hx_peer *p, int status);
    void (*destroy)(hx_peer *p);
    int transport; /* HX_TRANSPORT_*: the slot of the agent's counters (hx_stats) */
    /* Sends what post held (NULL: the transport holds nothing; the opcode
     * it gets never has HX_OP_HOLD then). op_id (0: none) is the op its
     * caller is about to wait for: HX_DONE_INLINE when that op succeeded on
     * this thread and no completion follows, else HX_POSTED. */
    int (*flush)(hx_peer *p, uint64_t op_id);
    /* A put of one piece and its notification behind it as one op
     * (hx_peer_put_note; NULL: the transport has no such op). flags: HX_OP_POLL. */
    int (*post_note)(hx_peer *p, int flags, uint64_t op_id, const hx_sge *sge, const uint8_t *data,
                     uint32_t len);
} hx_peer_ops;

struct hx_peer {
    const hx_peer_ops *ops;
    hx_agent *agent;
    uint64_t id;
    atomic_bool closed;
    atomic_int failed; /* first failure status, 0 while healthy */
    /* The id of the peer (its control channel) whose remote end this peer's
     * successful completions prove alive (hx_peer_heard_with); 0: none. */
    atomic_uint_fast64_t heard_with;
};

/* A transport's part in the agent's lifetime. The agent never names a
 * transport: it walks hx_transports[] (core/transports.c), and each transport
 * keeps whatever it needs per agent in a->state[its HX_TRANSPORT_* slot],
 * which only that transport's own files read. Any hook may be NULL.
 *
 * init      from hx_agent_new, in table order. On failure the agent is freed
 *           as below, so shutdown and free must cope with a slot never set.
 * shutdown  from hx_agent_shutdown, in table order, before the copy pool
 *           stops: the transport's own threads (tcp's I/O thread, verbs'
 *           completion thread) stop and fail their ops, which release their
 *           regions as they fail. May run twice, and on an agent whose
 *           transport was never opened.
 * free      from hx_agent_free, in table order, after every shutdown and after
 *           the agent's registry is destroyed: hx_reg_destroy drops each
 *           region's MR through regs.release (verbs: ibv_dereg_mr) while the
 *           transport's state (verbs: the protection domain) still exists;
 *           only then does free tear that state down.
 */
typedef struct hx_transport {
    const char *name;
    int (*init)(hx_agent *a);
    void (*shutdown)(hx_agent *a);
    void (*free)(hx_agent *a);
    /* The notification queue has room again: resume senders held back. */
    void (*note_space)(hx_agent *a);
    /* Notifications the transport holds outside the queue (shm's doorbell
     * rings): moved into it (hx_note_enqueue) as far as it has room, every
     * sender's (all) or only source's; returns how many it still holds. */
    uint32_t (*move_notes)(hx_agent *a, bool all, uint64_t source);
    /* Whether it may hold such notifications now: no false "no" for what the
     * loop's wake fd does not announce. No system call, unless the loop reads
     * the transport itself (tcp, after notes_quiet): that read happens here,
     * and what it queues (hx_note_push) needs no wake-up: the caller drains. */
    bool (*notes_held)(hx_agent *a);
    /* hx_agent_notes_quiet: the loop looks itself (quiet), or is to be woken
     * again; returns whether it holds notifications (after !quiet: that no
     * wake-up will announce). */
    bool (*notes_quiet)(hx_agent *a, bool quiet);
    /* The remote end of the channel peer_id (0: none), or of session's
     * connections (target side; 0: none), was proved alive at now_ns by
     * another transport (hx_heard): it counts as heard, as a byte read does
     * for the heartbeat timeout. Called with no lock held; never blocks on I/O. */
    void (*heard)(hx_agent *a, uint64_t peer_id, uint64_t session, uint64_t now_ns);
} hx_transport;

/* The slots of a->state and the order of hx_transports[] (and of hx_stats). */
enum { HX_TRANSPORT_LOOPBACK, HX_TRANSPORT_SHM, HX_TRANSPORT_TCP, HX_TRANSPORT_VERBS, HX_NTRANSPORTS };
_Static_assert((int)HX_NTRANSPORTS == (int)HX_STATS_TRANSPORTS, "hx_stats has one slot per transport");
/* The cdef spells array sizes as numbers (cffi reads no constant there): they
 * must be the constants'. */
_Static_assert(sizeof(((hx_stats *)0)->transports) / sizeof(hx_transport_stats) == HX_STATS_TRANSPORTS,
               "hx_stats.transports has HX_STATS_TRANSPORTS slots");
_Static_assert(sizeof(((hx_note *)0)->data) == HX_NOTE_MAX, "hx_note.data holds HX_NOTE_MAX bytes");

/* The agent's counters (core/stats.c): relaxed atomics, never a lock. */
typedef struct hx_counters {
    atomic_uint_fast64_t ops[HX_NTRANSPORTS], bytes[HX_NTRANSPORTS], errors[HX_NTRANSPORTS];
    atomic_uint_fast64_t notes_received, notes_sent;
} hx_counters;

extern const hx_transport hx_loopback_transport, hx_shm_transport, hx_tcp_transport, hx_verbs_transport;
extern const hx_transport *const hx_transports[HX_NTRANSPORTS];

struct hx_agent {
    hx_registry regs;

    /* completion ring */
    pthread_mutex_t ring_lock;
    pthread_cond_t ring_space;
    hx_completion *ring;
    uint32_t ring_cap, ring_head, ring_count;
    bool signaled;
    /* Writes owed to wake_fd (each counted under ring_lock before it is made)
     * and the sum of the values read from it: the fd can be readable only while
     * they differ, so a drain that finds them equal skips the read. */
    atomic_uint_fast64_t wake_armed, wake_read;
    int wake_fd; /* the eventfd native threads write */
    int poll_fd; /* what the event loop watches: an epoll set of wake_fd and shm's doorbells */

    /* copy pool */
    pthread_mutex_t pool_lock;
    pthread_cond_t pool_work;
    hx_task *task_head, *task_tail;
    pthread_t *threads;
    uint32_t nthreads;
    uint32_t started;  /* threads that took their index (their CPU's) */
    cpu_set_t cpus;    /* the CPUs the posting thread may use, as last seen */
    uint32_t cpus_gen; /* bumped when they change: each thread places itself anew */
    bool closing;
    atomic_uint_fast64_t next_peer_id;

    /* notifications that arrived: core/notes.c */
    pthread_mutex_t note_lock;
    struct hx_note_entry *note_head, *note_tail;
    uint32_t note_count, note_cap;
    bool note_blocked;      /* a push was refused: someone waits for room */
    uint64_t note_first_ns; /* when the oldest note queued arrived (CLOCK_MONOTONIC) */
    uint64_t note_taken_ns; /* that time of the oldest one the last drain that took any took */
    uint64_t note_dropped;

    hx_counters stats;

    /* per-transport state, opaque here: see hx_transport */
    void *state[HX_NTRANSPORTS];
};

/* core/registry.c */
void hx_reg_init(hx_registry *reg);
void hx_reg_destroy(hx_registry *reg);
int hx_reg_add(hx_registry *reg, uint32_t id, uint8_t *base, uint64_t len, uint32_t access, int kind,
               uint64_t key);
/* Withdraws; with wait, blocks until idle. On HX_OK, base and len say what it was. */
int hx_reg_remove(hx_registry *reg, uint32_t id, int wait, uint8_t **base, uint64_t *len);
/* The region with this id, removed or not; caller holds reg->lock. */
hx_region *hx_reg_find_locked(hx_registry *reg, uint32_t id);
/* Checks liveness, the key (unless key is NULL: a local access), rights and
 * bounds, then counts an access in progress. A wrong key reads as no region. */
int hx_reg_acquire(hx_registry *reg, uint32_t id, const uint64_t *key, uint64_t off, uint64_t len,
                   uint32_t need, uint8_t **ptr, hx_region **out);
/* The same checks, nothing acquired. */
int hx_reg_check(hx_registry *reg, uint32_t id, const uint64_t *key, uint64_t off, uint64_t len,
                 uint32_t need);
/* hx_reg_acquire on the agent's own registry, for this agent's own ops (no key). */
int hx_region_acquire(hx_agent *a, uint32_t id, uint64_t off, uint64_t len, uint32_t need, uint8_t **ptr,
                      hx_region **out);
void hx_region_release(hx_region *r);

/* core/ring.c */
void hx_complete(hx_agent *a, uint64_t op_id, int status);
/* Makes the wake fd readable (once per batch). */
void hx_wake(hx_agent *a);
/* Completions of agent a on this thread from now on wake nobody (NULL: they
 * do again): hx_peer_flush's caller drains the ring once it returns. */
void hx_hush(hx_agent *a);
/* Whether the ring holds no completion. */
bool hx_ring_empty(hx_agent *a);

/* core/notes.c. push: HX_E_BUSY when the queue is full; the caller holds the
 * sender back until note_space. dropped: counts a message that arrived and
 * was never queued (verbs: out of memory, or its session ended while it was
 * held); a full queue never drops one. */
void hx_notes_init(hx_agent *a);
void hx_notes_free(hx_agent *a);
int hx_note_push(hx_agent *a, uint64_t source, const uint8_t *data, uint32_t len, uint32_t imm,
                 uint32_t flags, uint32_t nbytes);
void hx_note_dropped(hx_agent *a);
/* Queues a notification a transport held (move_notes: shm's doorbell rings,
 * so it is marked HX_NOTE_RUNG): HX_E_BUSY when the queue is full, unless
 * force; wakes no one (the caller drains, or wakes). */
int hx_note_enqueue(hx_agent *a, uint64_t source, const uint8_t *data, uint32_t len, bool force);

/* core/pool.c */
/* Starts n threads (a->threads has room for them); on failure a->nthreads
 * counts those that did start. */
int hx_pool_start(hx_agent *a, uint32_t n);
/* Fails what is queued with HX_E_CLOSED, joins the threads. Safe twice. */
void hx_pool_stop(hx_agent *a);
/* Queues a job's copies on the pool; the pool completes the job. */
void hx_pool_submit(hx_agent *a, hx_task *first, hx_task *last);
/* Runs one task on the calling thread, as a pool thread would. */
void hx_pool_run(hx_agent *a, hx_task *t);
void hx_pool_fail_peer(hx_agent *a, uint64_t peer_id, int status);

/* core/copy.c: an op whose remote memory is in `remote` (mapped here, or
 * another process's via cross-memory attach with pid): inline when small,
 * else on the pool. */
int hx_copy_post(hx_peer *p, hx_registry *remote, int pid, int opcode, uint64_t op_id, const hx_sge *sges,
                 uint32_t n);
/* core/cma.c: one copy; the remote end is in process pid when pid != 0. */
int hx_copy_run(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len);

/* core/stats.c: an op of transport t that failed (refused or completed with
 * an error); a posted op and its bytes are counted by hx_peer_post. */
void hx_stat_error(hx_agent *a, int t);
/* core/peer.c: counts a post of n sges that returned rc (also verbs' post_imm). */
void hx_stat_post(hx_peer *p, const hx_sge *sges, uint32_t n, int rc);

/* core/peer.c */
void hx_peer_init(hx_peer *p, hx_agent *a, const hx_peer_ops *ops);
/* The remote end of the channel peer_id and/or of session's connections
 * was proved alive at now_ns (a successful RC completion: the remote QP,
 * hence its process, exists): every transport's heard hook hears it. */
void hx_heard(hx_agent *a, uint64_t peer_id, uint64_t session, uint64_t now_ns);

/* core/faults.c: whether this pass through fault site `site` (HX_FAULT_*)
 * is to fail (hx_test_fail_next). One relaxed load while nothing is armed. */
extern atomic_int hx_faults[HX_NFAULTS];
static inline bool hx_fault(int site)
{
    int n = atomic_load_explicit(&hx_faults[site], memory_order_relaxed);
    while (n > 0 && !atomic_compare_exchange_weak(&hx_faults[site], &n, n - 1))
        ;
    return n > 0;
}

#endif
