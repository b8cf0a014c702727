/* What the native modules share with each other and not with Python. */
#ifndef AIOHIXL_INTERNAL_H
#define AIOHIXL_INTERNAL_H
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include "hixl.h"

#define HX_REGION_BUCKETS 256

typedef struct hx_region {
    struct hx_region *next; /* bucket chain */
    uint32_t id;
    uint32_t access;
    uint8_t *base;
    uint64_t len;
    uint32_t busy;          /* accesses in progress; guarded by agent->lock */
    bool removed;
} hx_region;

/* A unit of copying for the pool: one piece of one job. */
typedef struct hx_task {
    struct hx_task *next;
    struct hx_job *job;
    uint8_t *dst;
    const uint8_t *src;
    uint64_t len;
} hx_task;

/* One op on the copy pool: completes when its last task is done. */
typedef struct hx_job {
    uint64_t op_id;
    uint64_t peer_id;
    atomic_int remaining;
    atomic_int status;
    uint32_t nregions;
    hx_region *regions[]; /* acquired; released when the job ends */
} hx_job;

typedef struct hx_peer_ops {
    int (*post)(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n);
    void (*fail)(hx_peer *p, int status);
    void (*destroy)(hx_peer *p);
} hx_peer_ops;

struct hx_peer {
    const hx_peer_ops *ops;
    hx_agent *agent;
    uint64_t id;
    atomic_bool closed;
};

struct hx_agent {
    pthread_mutex_t lock;          /* registry */
    pthread_cond_t region_idle;    /* a region's busy count fell to zero */
    hx_region *buckets[HX_REGION_BUCKETS];

    /* completion ring */
    pthread_mutex_t ring_lock;
    pthread_cond_t ring_space;
    hx_completion *ring;
    uint32_t ring_cap, ring_head, ring_count;
    bool signaled;
    int wake_fd;

    /* copy pool */
    pthread_mutex_t pool_lock;
    pthread_cond_t pool_work;
    hx_task *task_head, *task_tail;
    pthread_t *threads;
    uint32_t nthreads;
    bool closing;
    atomic_uint_fast64_t next_peer_id;

    /* tcp I/O thread, started with the first tcp connection */
    pthread_mutex_t io_lock;
    struct hx_io *io;
};

/* registry.c / core.c */
int hx_region_acquire(hx_agent *a, uint32_t id, uint64_t off, uint64_t len,
                      uint32_t need, uint8_t **ptr, hx_region **out);
void hx_region_release(hx_agent *a, hx_region *r);
void hx_complete(hx_agent *a, uint64_t op_id, int status);
/* Queues a job's copies on the pool; the pool completes the job. */
void hx_pool_submit(hx_agent *a, hx_job *job, hx_task *first, hx_task *last);
void hx_pool_fail_peer(hx_agent *a, uint64_t peer_id);
void hx_job_release(hx_agent *a, hx_job *job);
void hx_peer_init(hx_peer *p, hx_agent *a, const hx_peer_ops *ops);
/* tcp.c: stops the I/O thread, failing every tcp op with HX_E_CLOSED. */
void hx_io_shutdown(hx_agent *a);
/* tcp.c: frees what the stopped I/O thread left (connections Python never freed). */
void hx_io_free(hx_agent *a);

/* Copies at or under this size run on the caller's thread: a wake-up of
 * another core costs more than the copy. */
#define HX_INLINE_COPY_MAX (64u * 1024u)
/* Large copies are cut into pieces of this size so the pool can share them. */
#define HX_COPY_PIECE (4u * 1024u * 1024u)

#endif
