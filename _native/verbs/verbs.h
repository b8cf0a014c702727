/* The verbs transport: RDMA over RC queue pairs (libibverbs).
 *
 * libibverbs is loaded with dlopen when an agent opens a device, so the
 * module imports, and every other transport works, on machines without it.
 *
 * One protection domain, one completion queue and one completion channel per
 * agent; one RC queue pair per peer and direction. A put is an RDMA WRITE (or
 * WRITE WITH IMM), a get an RDMA READ; an op is one chain of work requests
 * posted with one doorbell, only the last signalled. Every work request of a
 * chain carries the op in wr_id (low bit set on the last), so an error on any
 * of them is charged to its op. A native thread polls the CQ (a short spin,
 * then blocks on the completion channel) and feeds the agent's completion
 * ring. A QP in error fails every op outstanding on it: their memory is only
 * released when the flushed completions come back.
 *
 * Notifications: a message is a SEND posted on the peer's QP after the ops
 * before it (fenced, so it also waits for earlier READs), from a registered
 * ring of NOTE_SLOTS buffers; a note that finds no free slot waits in the
 * pending queue like an op that finds no room. The target keeps RQ_DEPTH
 * receives of HX_NOTE_MAX bytes posted per QP. RC ordering means a receive
 * completes only after every earlier WRITE of that QP is placed. When the
 * agent's queue is full, received messages are held in their buffers, which
 * are not reposted: once all are held the sender's NIC retries (RNR) and the
 * sender is held back. A full queue drops nothing; a message is dropped (and
 * counted: hx_note_dropped) only when it cannot be queued for want of memory
 * (cq.c), or when its session ends while it is still held (qp.c).
 *
 * Files: loader.c (dlopen, symbol table), device.c (open/close, the
 * transport's hooks), mr.c, qp.c (queue-pair states, the peer's fail and
 * destroy), raw.c (queue pairs for peers that are not aiohixl), post.c
 * (build and submit chains), cq.c (the completion thread); stub.c stands in
 * for all of them when built without rdma-core's headers (HX_HAVE_VERBS
 * undefined). This header is private to them.
 */
#ifndef AIOHIXL_VERBS_H
#define AIOHIXL_VERBS_H
#include "internal.h"

#ifdef HX_HAVE_VERBS
#include <infiniband/verbs.h>
#include <stdio.h>

#define SQ_DEPTH 512
#define RQ_DEPTH 256  /* receives posted per target QP (SENDs and WRITE WITH IMM) */
#define NOTE_SLOTS 64 /* registered send buffers per initiator QP */
/* wr_id of a receive: this bit and the slot (an op's wr_id is a pointer). */
#define RECV_TAG (1ull << 63)

/* What the last failed call on this thread says (hx_verbs_error). */
extern __thread char vb_err[256];
#define VB_FAIL(...) snprintf(vb_err, sizeof vb_err, __VA_ARGS__)

/* The libibverbs entry points we call; the data path (post, poll, notify)
 * goes through the provider's function table and needs none of them. */
typedef struct {
    void *dl;
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *);
    int (*destroy_comp_channel)(struct ibv_comp_channel *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*destroy_qp)(struct ibv_qp *);
    int (*get_cq_event)(struct ibv_comp_channel *, struct ibv_cq **, void **);
    void (*ack_cq_events)(struct ibv_cq *, unsigned int);
} ibv_api;

typedef struct vop {
    struct vop *next;
    struct vqp *qp;
    uint64_t op_id;
    int status;
    uint32_t nwr;
    int note_slot; /* a notification: its send buffer once posted, else -1 */
    uint8_t *note; /* a notification's bytes until posted (note_len of them) */
    uint32_t note_len;
    struct ibv_send_wr *wrs; /* kept until posted (pending ops) */
    struct ibv_sge *sgl;
    uint32_t nregions;
    hx_region *regions[];
} vop;

typedef struct vqp {
    hx_peer base; /* the initiator side is a peer Python posts to */
    struct vqp *next_all;
    struct ibv_qp *qp;
    bool target;
    uint64_t session;
    pthread_mutex_t lock;
    uint32_t wr_inflight; /* posted and not yet completed */
    uint32_t ops_inflight;
    vop *pending_head, *pending_tail; /* waiting for room in the send queue */
    bool broken;
    uint64_t heard_ns; /* when its completions last counted as heard (cq.c; completion thread only) */
    uint32_t lpsn;     /* our starting PSN, told to the other side */
    /* initiator: the notifications' send buffers (made on the first note) */
    uint8_t *sbuf;
    struct ibv_mr *smr;
    uint64_t note_free; /* a bit per free slot */
    /* target: the receive buffers, and the messages held in them (in order)
     * while the agent's queue is full; both under hx_verbs.lock */
    uint8_t *rbuf;
    struct ibv_mr *rmr;
    struct vheld {
        uint32_t slot, len, imm, flags;
    } held[RQ_DEPTH];
    uint32_t held_head, held_count;
    /* a raw export (raw.c): its own protection domain, holding only the
     * exported range's MR and the receive buffers, so that the raw peer's
     * QP reaches nothing else of the agent */
    struct ibv_pd *own_pd;
    struct ibv_mr *export_mr;
} vqp;

typedef struct hx_verbs {
    ibv_api api;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    int port, gid_index, mtu;
    union ibv_gid gid;
    uint16_t lid;
    uint32_t max_msg;
    int timeout, retry_cnt;
    pthread_t thread;
    bool thread_started;
    int stop_fd;
    atomic_bool stop;
    pthread_mutex_t lock; /* the QP list */
    pthread_cond_t drained;
    vqp *qps;
} hx_verbs;

/* The transport's state in an agent: a->state[HX_TRANSPORT_VERBS], made by
 * hx_verbs_open. NULL until then. */
static inline hx_verbs *V(hx_agent *a) { return a->state[HX_TRANSPORT_VERBS]; }

/* loader.c: dlopen()s libibverbs and fills the table; -1 with vb_err set. */
int vb_load_api(ibv_api *api);

/* mr.c: the registry's release hook (ctx is the hx_verbs). */
void vb_release_mr(void *ctx, void *mr);

/* qp.c */
void vb_qp_to_error(hx_verbs *v, vqp *q);
/* Destroys q's QP, then frees its buffers and q. */
void vb_qp_free(hx_verbs *v, vqp *q);
/* Posts the receive of one buffer; -1 when it fails. */
int vb_post_recv(vqp *q, uint32_t slot);
/* A QP in INIT in pd whose remote end may do what access (IBV_ACCESS_*) allows. */
struct ibv_qp *vb_create_qp(hx_verbs *v, struct ibv_pd *pd, int access);
/* RESET/INIT -> RTR -> RTS toward the remote QP. */
int vb_connect_qp(hx_verbs *v, struct ibv_qp *qp, uint32_t rqpn, uint32_t rpsn, uint32_t lpsn,
                  const uint8_t *gid, uint16_t lid, int mtu);
/* Registers and posts a target QP's receive buffers (in q's own PD if any). */
int vb_post_receives(hx_verbs *v, vqp *q);
/* A new QP (made by make_qp), listed with the agent. */
vqp *vb_vqp_new(hx_agent *a, bool target, uint64_t session, struct ibv_qp *qp);
uint32_t vb_random_psn(void);

/* post.c */
int vb_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n);
int vb_note(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len, int flags);
/* Whether op can be posted now: room in the send queue (and a send buffer). */
bool vb_fits(vqp *q, vop *op);
/* Releases op's regions and completes it with status. */
void vb_vop_finish(hx_agent *a, vop *op, int status);
/* Posts op's chain now. Caller holds q->lock and has checked there is room. */
int vb_post_chain(vqp *q, vop *op);
/* Ops that were never posted fail at once; posted ones come back flushed. */
void vb_fail_pending(hx_agent *a, vqp *q, int status);

/* cq.c: the completion thread's body (arg is the agent). */
void *vb_completion_main(void *arg);
/* The agent's queue has room: deliver held messages, repost their buffers. */
void vb_note_space(hx_agent *a);

#endif /* HX_HAVE_VERBS */
#endif
