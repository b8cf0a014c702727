/* The completion ring and its wake fd: every transport's completions (and
 * verbs' notifications) reach Python through here. */
#include "internal.h"
#include <unistd.h>

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

void hx_complete(hx_agent *a, uint64_t op_id, int status) { ring_push(a, op_id, status, 0, true); }

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

int hx_agent_wake_fd(hx_agent *a) { return a->wake_fd; }
