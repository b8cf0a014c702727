/* The agent: region registry, completion ring with its wake fd, copy pool. */
#include "internal.h"
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/eventfd.h>

/* ---------- registries ---------- */

void hx_reg_init(hx_registry *reg)
{
    pthread_mutex_init(&reg->lock, NULL);
    pthread_cond_init(&reg->idle, NULL);
    memset(reg->buckets, 0, sizeof reg->buckets);
    reg->release = NULL;
    reg->release_ctx = NULL;
}

void hx_reg_destroy(hx_registry *reg)
{
    for (int i = 0; i < HX_REGION_BUCKETS; i++) {
        hx_region *r = reg->buckets[i];
        while (r) {
            hx_region *next = r->next;
            if (r->mr && reg->release)
                reg->release(reg->release_ctx, r->mr);
            free(r);
            r = next;
        }
        reg->buckets[i] = NULL;
    }
}

static hx_region **bucket_of(hx_registry *reg, uint32_t id)
{
    return &reg->buckets[id % HX_REGION_BUCKETS];
}

hx_region *hx_reg_find_locked(hx_registry *reg, uint32_t id)
{
    for (hx_region *r = *bucket_of(reg, id); r; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

int hx_reg_add(hx_registry *reg, uint32_t id, uint8_t *base, uint64_t len, uint32_t access, int kind)
{
    if (!base && len != 0)
        return HX_E_INVAL;
    if ((uintptr_t)base + len < (uintptr_t)base)
        return HX_E_INVAL;
    hx_region *r = calloc(1, sizeof *r);
    if (!r)
        return HX_E_NOMEM;
    r->reg = reg;
    r->id = id;
    r->access = access;
    r->base = base;
    r->len = len;
    r->kind = (uint8_t)kind;
    pthread_mutex_lock(&reg->lock);
    if (hx_reg_find_locked(reg, id)) {
        pthread_mutex_unlock(&reg->lock);
        free(r);
        return HX_E_INVAL;
    }
    hx_region **b = bucket_of(reg, id);
    r->next = *b;
    *b = r;
    pthread_mutex_unlock(&reg->lock);
    return HX_OK;
}

int hx_reg_remove(hx_registry *reg, uint32_t id, int wait, uint8_t **base, uint64_t *len)
{
    pthread_mutex_lock(&reg->lock);
    hx_region *r = hx_reg_find_locked(reg, id);
    if (!r) {
        pthread_mutex_unlock(&reg->lock);
        return HX_E_NOREGION;
    }
    r->removed = true;
    while (r->busy && wait)
        pthread_cond_wait(&reg->idle, &reg->lock);
    if (r->busy) {
        pthread_mutex_unlock(&reg->lock);
        return HX_E_BUSY;
    }
    for (hx_region **pp = bucket_of(reg, id); *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    pthread_mutex_unlock(&reg->lock);
    if (base)
        *base = r->base;
    if (len)
        *len = r->len;
    if (r->mr && reg->release)
        reg->release(reg->release_ctx, r->mr);
    free(r);
    return HX_OK;
}

static int check_locked(hx_region *r, uint64_t off, uint64_t len, uint32_t need)
{
    if (!r || r->removed)
        return HX_E_NOREGION;
    if ((r->access & need) != need)
        return HX_E_ACCESS;
    if (off > r->len || len > r->len - off)
        return HX_E_BOUNDS;
    return HX_OK;
}

int hx_reg_acquire(hx_registry *reg, uint32_t id, uint64_t off, uint64_t len,
                   uint32_t need, uint8_t **ptr, hx_region **out)
{
    pthread_mutex_lock(&reg->lock);
    hx_region *r = hx_reg_find_locked(reg, id);
    int rc = check_locked(r, off, len, need);
    if (rc == HX_OK) {
        r->busy++;
        *ptr = r->base + off;
        *out = r;
    }
    pthread_mutex_unlock(&reg->lock);
    return rc;
}

void hx_region_release(hx_region *r)
{
    hx_registry *reg = r->reg;
    pthread_mutex_lock(&reg->lock);
    if (--r->busy == 0 && r->removed)
        pthread_cond_broadcast(&reg->idle);
    pthread_mutex_unlock(&reg->lock);
}

/* The agent's own memory. */

int hx_region_add(hx_agent *a, uint32_t id, uint64_t addr, uint64_t len, uint32_t access)
{
    return hx_reg_add(&a->regs, id, (uint8_t *)(uintptr_t)addr, len, access, HX_MEM_DIRECT);
}

int hx_region_remove(hx_agent *a, uint32_t id, int wait)
{
    return hx_reg_remove(&a->regs, id, wait, NULL, NULL);
}

int hx_region_acquire(hx_agent *a, uint32_t id, uint64_t off, uint64_t len,
                      uint32_t need, uint8_t **ptr, hx_region **out)
{
    return hx_reg_acquire(&a->regs, id, off, len, need, ptr, out);
}

/* ---------- completion ring ---------- */

/* Pushes one entry; with must_fit false a full ring drops it. */
static void ring_push(hx_agent *a, uint64_t op_id, int status, uint32_t reserved, bool must_fit)
{
    pthread_mutex_lock(&a->ring_lock);
    /* Never drop a completion: the Python side admits at most ring_cap ops,
     * so this wait is a safety net, not a path. */
    while (a->ring_count == a->ring_cap) {
        if (!must_fit) {
            pthread_mutex_unlock(&a->ring_lock);
            return;
        }
        pthread_cond_wait(&a->ring_space, &a->ring_lock);
    }
    uint32_t tail = (a->ring_head + a->ring_count) % a->ring_cap;
    a->ring[tail] = (hx_completion){.op_id = op_id, .status = status, .reserved = reserved};
    a->ring_count++;
    bool wake = !a->signaled;
    a->signaled = true;
    pthread_mutex_unlock(&a->ring_lock);
    if (wake) {
        /* One write per batch: the reader takes everything queued meanwhile. */
        uint64_t one = 1;
        ssize_t n = write(a->wake_fd, &one, sizeof one);
        (void)n;
    }
}

void hx_complete(hx_agent *a, uint64_t op_id, int status)
{
    ring_push(a, op_id, status, 0, true);
}

void hx_notify(hx_agent *a, uint32_t imm, uint32_t len)
{
    /* Notifications are not admitted like ops: when the ring is full one is
     * dropped rather than blocking the completion thread. */
    ring_push(a, HX_NOTIFY_FLAG | imm, HX_OK, len, false);
}

int hx_agent_drain(hx_agent *a, hx_completion *out, int max)
{
    uint64_t v;
    /* Clear the fd before taking: a push after this point re-arms it. */
    ssize_t n = read(a->wake_fd, &v, sizeof v);
    (void)n;
    pthread_mutex_lock(&a->ring_lock);
    int taken = 0;
    while (taken < max && a->ring_count) {
        out[taken++] = a->ring[a->ring_head];
        a->ring_head = (a->ring_head + 1) % a->ring_cap;
        a->ring_count--;
    }
    if (a->ring_count == 0)
        a->signaled = false;
    else {
        /* More than max were waiting: keep the fd readable. */
        uint64_t one = 1;
        n = write(a->wake_fd, &one, sizeof one);
    }
    pthread_cond_broadcast(&a->ring_space);
    pthread_mutex_unlock(&a->ring_lock);
    return taken;
}

int hx_agent_wake_fd(hx_agent *a)
{
    return a->wake_fd;
}

/* ---------- copy pool ---------- */

void hx_job_release(hx_agent *a, hx_job *job)
{
    for (uint32_t i = 0; i < job->nregions; i++)
        hx_region_release(job->regions[i]);
    /* Regions are released before the completion is seen, so a region close
     * that waits on the completion never waits on a still-busy region. */
    hx_complete(a, job->op_id, atomic_load(&job->status));
    free(job);
}

static void finish_task(hx_agent *a, hx_task *t, int status)
{
    hx_job *job = t->job;
    if (status != HX_OK)
        atomic_store(&job->status, status);
    free(t);
    if (atomic_fetch_sub(&job->remaining, 1) == 1) {
        int failed = job->peer_failed ? atomic_load(job->peer_failed) : 0;
        if (failed)
            atomic_store(&job->status, failed);
        hx_job_release(a, job);
    }
}

static void *pool_main(void *arg)
{
    hx_agent *a = arg;
    pthread_mutex_lock(&a->pool_lock);
    for (;;) {
        while (!a->task_head && !a->closing)
            pthread_cond_wait(&a->pool_work, &a->pool_lock);
        hx_task *t = a->task_head;
        if (!t)
            break; /* closing and nothing queued */
        a->task_head = t->next;
        if (!a->task_head)
            a->task_tail = NULL;
        bool closing = a->closing;
        pthread_mutex_unlock(&a->pool_lock);
        if (closing)
            finish_task(a, t, HX_E_CLOSED);
        else
            hx_pool_run(a, t);
        pthread_mutex_lock(&a->pool_lock);
    }
    pthread_mutex_unlock(&a->pool_lock);
    return NULL;
}

void hx_pool_run(hx_agent *a, hx_task *t)
{
    hx_job *job = t->job;
    int failed = job->peer_failed ? atomic_load(job->peer_failed) : 0;
    if (failed)
        finish_task(a, t, failed);
    else
        finish_task(a, t, hx_copy_run(t->opcode, t->pid, t->dst, t->src, t->len));
}

void hx_pool_submit(hx_agent *a, hx_task *first, hx_task *last)
{
    pthread_mutex_lock(&a->pool_lock);
    if (a->task_tail)
        a->task_tail->next = first;
    else
        a->task_head = first;
    a->task_tail = last;
    pthread_cond_broadcast(&a->pool_work);
    pthread_mutex_unlock(&a->pool_lock);
}

void hx_pool_fail_peer(hx_agent *a, uint64_t peer_id, int status)
{
    hx_task *failed = NULL;
    pthread_mutex_lock(&a->pool_lock);
    hx_task **pp = &a->task_head;
    a->task_tail = NULL;
    while (*pp) {
        hx_task *t = *pp;
        if (t->job->peer_id == peer_id) {
            *pp = t->next;
            t->next = failed;
            failed = t;
        } else {
            a->task_tail = t;
            pp = &t->next;
        }
    }
    pthread_mutex_unlock(&a->pool_lock);
    while (failed) {
        hx_task *next = failed->next;
        finish_task(a, failed, status);
        failed = next;
    }
}

/* ---------- agent ---------- */

hx_agent *hx_agent_new(uint32_t ring_capacity, uint32_t copy_threads, int *status)
{
    *status = HX_E_INVAL;
    if (ring_capacity == 0 || copy_threads == 0 || copy_threads > 64)
        return NULL;
    *status = HX_E_NOMEM;
    hx_agent *a = calloc(1, sizeof *a);
    if (!a)
        return NULL;
    a->ring = calloc(ring_capacity, sizeof *a->ring);
    a->threads = calloc(copy_threads, sizeof *a->threads);
    if (!a->ring || !a->threads)
        goto fail;
    a->ring_cap = ring_capacity;
    a->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (a->wake_fd < 0) {
        *status = HX_E_SYS;
        goto fail;
    }
    hx_reg_init(&a->regs);
    pthread_mutex_init(&a->ring_lock, NULL);
    pthread_cond_init(&a->ring_space, NULL);
    pthread_mutex_init(&a->pool_lock, NULL);
    pthread_cond_init(&a->pool_work, NULL);
    atomic_init(&a->next_peer_id, 1);
    for (int t = 0; t < HX_NTRANSPORTS; t++) {
        int rc = hx_transports[t]->init ? hx_transports[t]->init(a) : HX_OK;
        if (rc != HX_OK) {
            *status = rc;
            hx_agent_free(a);
            return NULL;
        }
    }
    for (uint32_t i = 0; i < copy_threads; i++) {
        if (pthread_create(&a->threads[i], NULL, pool_main, a) != 0) {
            *status = HX_E_SYS;
            a->nthreads = i;
            hx_agent_shutdown(a);
            hx_agent_free(a);
            return NULL;
        }
    }
    a->nthreads = copy_threads;
    *status = HX_OK;
    return a;
fail:
    free(a->ring);
    free(a->threads);
    free(a);
    return NULL;
}

void hx_agent_shutdown(hx_agent *a)
{
    /* The transports' threads first: their ops release their regions as
     * they fail. */
    for (int t = 0; t < HX_NTRANSPORTS; t++)
        if (hx_transports[t]->shutdown)
            hx_transports[t]->shutdown(a);
    pthread_mutex_lock(&a->pool_lock);
    bool already = a->closing;
    a->closing = true;
    pthread_cond_broadcast(&a->pool_work);
    pthread_mutex_unlock(&a->pool_lock);
    if (already)
        return;
    for (uint32_t i = 0; i < a->nthreads; i++)
        pthread_join(a->threads[i], NULL);
    a->nthreads = 0;
}

void hx_agent_free(hx_agent *a)
{
    if (!a)
        return;
    hx_agent_shutdown(a);
    hx_reg_destroy(&a->regs); /* deregisters MRs: the transports are still there */
    for (int t = 0; t < HX_NTRANSPORTS; t++)
        if (hx_transports[t]->free)
            hx_transports[t]->free(a);
    close(a->wake_fd);
    free(a->ring);
    free(a->threads);
    free(a);
}

void hx_prefault(void *addr, uint64_t len, int write)
{
    long page = sysconf(_SC_PAGESIZE);
    volatile uint8_t *p = addr;
    for (uint64_t off = 0; off < len; off += (uint64_t)page) {
        if (write)
            p[off] = p[off]; /* a read-modify-write keeps the contents */
        else
            (void)p[off];
    }
}

/* ---------- peers ---------- */

void hx_peer_init(hx_peer *p, hx_agent *a, const hx_peer_ops *ops)
{
    p->ops = ops;
    p->agent = a;
    p->id = atomic_fetch_add(&a->next_peer_id, 1);
    atomic_init(&p->closed, false);
    atomic_init(&p->failed, 0);
}

int hx_peer_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
{
    if (atomic_load(&p->closed))
        return HX_E_CLOSED;
    int failed = atomic_load(&p->failed);
    if (failed)
        return failed;
    if (opcode != HX_OP_PUT && opcode != HX_OP_GET)
        return HX_E_INVAL;
    if (n == 0)
        return HX_E_INVAL;
    return p->ops->post(p, opcode, op_id, sges, n);
}

void hx_peer_close(hx_peer *p)
{
    if (atomic_exchange(&p->closed, true))
        return;
    hx_peer_fail(p, HX_E_CLOSED);
}

void hx_peer_fail(hx_peer *p, int status)
{
    if (status >= 0)
        status = HX_E_CONNLOST;
    int expected = 0;
    if (atomic_compare_exchange_strong(&p->failed, &expected, status))
        p->ops->fail(p, status);
}

int hx_peer_status(hx_peer *p)
{
    return atomic_load(&p->failed);
}

void hx_peer_free(hx_peer *p)
{
    if (!p)
        return;
    hx_peer_close(p);
    p->ops->destroy(p);
}
