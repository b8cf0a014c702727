/* The completion ring and its wake fd: every transport's completions reach
 * Python through here (notifications wake it through the same fd). */
#include "internal.h"
#include <errno.h>
#include <unistd.h>

/* The agent whose hx_peer_flush runs on this thread: its caller drains the
 * ring when the flush returns, so what the flush completes here needs no
 * write to wake_fd (nor the loop's read of it). */
static __thread hx_agent *hushed;

void hx_hush(hx_agent *a) { hushed = a; }

bool hx_ring_empty(hx_agent *a)
{
    pthread_mutex_lock(&a->ring_lock);
    bool empty = a->ring_count == 0;
    pthread_mutex_unlock(&a->ring_lock);
    return empty;
}

/* Under ring_lock: a write to wake_fd is owed (it is made after the unlock). */
static bool arm(hx_agent *a)
{
    if (a->signaled)
        return false;
    a->signaled = true;
    atomic_fetch_add(&a->wake_armed, 1);
    return true;
}

static void wake_unlocked(hx_agent *a, bool wake)
{
    if (wake) {
        /* One write per batch: the reader takes everything queued meanwhile. */
        uint64_t one = 1;
        ssize_t n = write(a->wake_fd, &one, sizeof one);
        (void)n;
    }
}

void hx_wake(hx_agent *a)
{
    pthread_mutex_lock(&a->ring_lock);
    bool wake = arm(a);
    pthread_mutex_unlock(&a->ring_lock);
    wake_unlocked(a, wake);
}

void hx_complete(hx_agent *a, uint64_t op_id, int status)
{
    int err = status == HX_E_SYS ? errno : 0; /* before anything here can change it */
    pthread_mutex_lock(&a->ring_lock);
    /* Never drop a completion: the Python side admits at most ring_cap ops,
     * so this wait is a safety net, not a path. */
    while (a->ring_count == a->ring_cap)
        pthread_cond_wait(&a->ring_space, &a->ring_lock);
    uint32_t tail = (a->ring_head + a->ring_count) % a->ring_cap;
    a->ring[tail] = (hx_completion){.op_id = op_id, .status = status, .sys_errno = err};
    a->ring_count++;
    bool wake = a != hushed && arm(a);
    pthread_mutex_unlock(&a->ring_lock);
    wake_unlocked(a, wake);
}

int hx_agent_drain(hx_agent *a, hx_completion *out, int max)
{
    /* Clear the fd before taking: a push after this point re-arms it. Only
     * if a write is owed: every write to wake_fd is counted in wake_armed
     * before it is made, and every value read from it is added to wake_read,
     * so a readable fd means armed > read here (the write we would find was
     * counted before it was made). Equal: nothing to read (the read would
     * fail with EAGAIN; shm's doorbells woke the loop). A write counted but
     * not yet made when we look leaves the fd readable afterwards: the loop
     * drains again and then reads it. */
    if (atomic_load(&a->wake_armed) != atomic_load_explicit(&a->wake_read, memory_order_relaxed)) {
        uint64_t v;
        if (read(a->wake_fd, &v, sizeof v) == (ssize_t)sizeof v)
            atomic_fetch_add(&a->wake_read, v);
    }
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
        /* More than max were waiting: keep the fd readable (signaled stays
         * set: this write is owed as a writer's is). */
        atomic_fetch_add(&a->wake_armed, 1);
        uint64_t one = 1;
        ssize_t n = write(a->wake_fd, &one, sizeof one);
        (void)n;
    }
    pthread_cond_broadcast(&a->ring_space);
    pthread_mutex_unlock(&a->ring_lock);
    return taken;
}

int hx_agent_wake_fd(hx_agent *a) { return a->poll_fd; }

struct test_completion {
    hx_agent *a;
    uint64_t op_id;
    int status, err;
};

static void *test_complete_main(void *arg)
{
    struct test_completion *c = arg;
    errno = c->err;
    hx_complete(c->a, c->op_id, c->status);
    return NULL;
}

int hx_test_complete_on_thread(hx_agent *a, uint64_t op_id, int status, int err)
{
    struct test_completion c = {a, op_id, status, err};
    pthread_t t;
    if (pthread_create(&t, NULL, test_complete_main, &c))
        return HX_E_SYS;
    pthread_join(t, NULL);
    return HX_OK;
}

int hx_test_ring_unseen(hx_agent *a)
{
    pthread_mutex_lock(&a->ring_lock);
    bool unseen = a->ring_count && !a->signaled;
    pthread_mutex_unlock(&a->ring_lock);
    return unseen;
}
