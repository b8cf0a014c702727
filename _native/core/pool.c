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

int hx_pool_start(hx_agent *a, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        if (pthread_create(&a->threads[i], NULL, pool_main, a) != 0) {
            a->nthreads = i;
            return HX_E_SYS;
        }
        pthread_setname_np(a->threads[i], "hixl-copy"); /* top -H, perf: which thread is which */
    }
    a->nthreads = n;
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
