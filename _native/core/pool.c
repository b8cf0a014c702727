/* The copy pool: threads that run the pieces of large copies (copy.c cuts
 * them) and complete each job when its last piece is done. */
#include "core/stream.h"
#include "internal.h"
#include <stdlib.h>

static void job_release(hx_agent *a, hx_job *job)
{
    for (uint32_t i = 0; i < job->nregions; i++)
        hx_region_release(job->regions[i]);
    /* Regions are released before the completion is seen, so a region close
     * that waits on the completion never waits on a still-busy region. */
    int status = atomic_load(&job->status);
    if (status != HX_OK && job->nregions) /* a populate (no regions) is no transport's op */
        hx_stat_error(a, job->transport);
    hx_complete(a, job->op_id, status);
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
        job_release(a, job);
    }
}

/* Where a thread runs. When the pool's threads and the posting thread are at
 * least as many as the CPUs that thread may use, each pool thread owns one of
 * them: woken together while the posting thread held one CPU, two threads
 * were queued on the other, and Linux does not move a queued thread to a CPU
 * that goes idle for less than sched_migration_cost (0.5 ms: newidle
 * balance), so one thread copied all of a 16 MiB put, 1.65x as long
 * (docs/shm.md). With fewer threads than CPUs, idle CPUs are there to wake
 * them on: they keep the whole set. Advice only: refused, the thread runs
 * where it did. */
static void place(uint32_t index, uint32_t nthreads, const cpu_set_t *cpus)
{
    int n = CPU_COUNT(cpus);
    if (n == 0)
        return;
    cpu_set_t one;
    const cpu_set_t *use = cpus;
    if ((int)nthreads + 1 >= n) {
        int want = (int)(index % (uint32_t)n), seen = 0;
        CPU_ZERO(&one);
        for (int c = 0; c < CPU_SETSIZE; c++) {
            if (CPU_ISSET(c, cpus) && seen++ == want) {
                CPU_SET(c, &one);
                break;
            }
        }
        use = &one;
    }
    pthread_setaffinity_np(pthread_self(), sizeof *use, use);
}

/* Under pool_lock: the CPUs to place this thread on when they changed since
 * *gen, else NULL. */
static const cpu_set_t *moved(hx_agent *a, uint32_t *gen, cpu_set_t *out, uint32_t *nthreads)
{
    if (*gen == a->cpus_gen)
        return NULL;
    *gen = a->cpus_gen;
    *out = a->cpus;
    *nthreads = a->nthreads;
    return out;
}

static void *pool_main(void *arg)
{
    hx_agent *a = arg;
    cpu_set_t cpus;
    uint32_t gen = 0, nthreads;
    pthread_mutex_lock(&a->pool_lock);
    uint32_t index = a->started++;
    for (;;) {
        const cpu_set_t *to = moved(a, &gen, &cpus, &nthreads);
        if (to) {
            pthread_mutex_unlock(&a->pool_lock);
            place(index, nthreads, to);
            pthread_mutex_lock(&a->pool_lock);
            continue;
        }
        if (!a->task_head && !a->closing) {
            pthread_cond_wait(&a->pool_work, &a->pool_lock);
            continue;
        }
        hx_task *t = a->task_head;
        if (!t)
            break; /* closing and nothing queued */
        a->task_head = t->next;
        if (!a->task_head)
            a->task_tail = NULL;
        bool closing = a->closing;
        /* A populate starts threads that inherit this one's CPUs: all of them,
         * then this thread is placed anew. */
        bool widen = t->opcode == HX_TASK_POPULATE && gen;
        if (widen) {
            cpus = a->cpus;
            gen = 0;
        }
        pthread_mutex_unlock(&a->pool_lock);
        if (widen)
            pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
        if (closing)
            finish_task(a, t, HX_E_CLOSED);
        else
            hx_pool_run(a, t);
        pthread_mutex_lock(&a->pool_lock);
    }
    pthread_mutex_unlock(&a->pool_lock);
    return NULL;
}

int hx_pool_start(hx_agent *a, uint32_t n)
{
    pthread_mutex_lock(&a->pool_lock);
    if (sched_getaffinity(0, sizeof a->cpus, &a->cpus) == 0)
        a->cpus_gen = 1; /* else unknown: the threads stay where they start */
    a->nthreads = n;
    pthread_mutex_unlock(&a->pool_lock);
    for (uint32_t i = 0; i < n; i++) {
        if (pthread_create(&a->threads[i], NULL, pool_main, a) != 0) {
            pthread_mutex_lock(&a->pool_lock);
            a->nthreads = i;
            pthread_mutex_unlock(&a->pool_lock);
            return HX_E_SYS;
        }
        pthread_setname_np(a->threads[i], "hixl-copy"); /* top -H, perf: which thread is which */
    }
    return HX_OK;
}

void hx_pool_stop(hx_agent *a)
{
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

void hx_pool_run(hx_agent *a, hx_task *t)
{
    hx_job *job = t->job;
    int failed = job->peer_failed ? atomic_load(job->peer_failed) : 0;
    if (failed)
        finish_task(a, t, failed);
    else if (t->opcode == HX_TASK_POPULATE) {
        hx_prefault(t->dst, t->len, t->src != NULL, t->pid); /* 1 (touched page by page) is done too */
        finish_task(a, t, HX_OK);
    } else if (t->stream) {
        hx_copy_stream(t->dst, t->src, t->len);
        finish_task(a, t, HX_OK);
    } else
        finish_task(a, t, hx_copy_run(t->opcode, t->pid, t->dst, t->src, t->len));
}

/* A native thread that already runs: starting one from Python (a worker
 * thread) stalled the event loop for tens of ms, as long as the new thread
 * took to be scheduled on a busy host. */
int hx_prefault_post(hx_agent *a, uint64_t op_id, void *addr, uint64_t len, int write, int threads)
{
    hx_job *job = calloc(1, sizeof *job);
    hx_task *t = calloc(1, sizeof *t);
    if (!job || !t) {
        free(job);
        free(t);
        return HX_E_NOMEM;
    }
    job->op_id = op_id;
    atomic_init(&job->status, HX_OK);
    atomic_init(&job->remaining, 1);
    *t = (hx_task){.job = job,
                   .dst = addr,
                   .src = write ? addr : NULL,
                   .len = len,
                   .pid = threads,
                   .opcode = HX_TASK_POPULATE};
    hx_pool_submit(a, t, t);
    return HX_POSTED;
}

void hx_pool_submit(hx_agent *a, hx_task *first, hx_task *last)
{
    /* The posting thread's CPUs, which the application may have changed since. */
    cpu_set_t cpus;
    bool known = sched_getaffinity(0, sizeof cpus, &cpus) == 0;
    pthread_mutex_lock(&a->pool_lock);
    if (known && !CPU_EQUAL(&cpus, &a->cpus)) {
        a->cpus = cpus;
        a->cpus_gen++;
    }
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
