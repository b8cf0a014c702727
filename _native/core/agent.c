/* The agent's lifetime: its ring, pool, registry and transports. */
#include "internal.h"
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

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
    a->poll_fd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (a->wake_fd < 0 || a->poll_fd < 0 || epoll_ctl(a->poll_fd, EPOLL_CTL_ADD, a->wake_fd, &ev) != 0) {
        if (a->wake_fd >= 0)
            close(a->wake_fd);
        if (a->poll_fd >= 0)
            close(a->poll_fd);
        *status = HX_E_SYS;
        goto fail;
    }
    hx_reg_init(&a->regs);
    pthread_mutex_init(&a->ring_lock, NULL);
    pthread_cond_init(&a->ring_space, NULL);
    pthread_mutex_init(&a->pool_lock, NULL);
    pthread_cond_init(&a->pool_work, NULL);
    atomic_init(&a->next_peer_id, 1);
    hx_notes_init(a);
    for (int t = 0; t < HX_NTRANSPORTS; t++) {
        int rc = hx_transports[t]->init ? hx_transports[t]->init(a) : HX_OK;
        if (rc != HX_OK) {
            *status = rc;
            hx_agent_free(a);
            return NULL;
        }
    }
    if (hx_pool_start(a, copy_threads) != HX_OK) {
        *status = HX_E_SYS;
        hx_agent_free(a);
        return NULL;
    }
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
    hx_pool_stop(a);
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
    hx_notes_free(a);
    close(a->poll_fd);
    close(a->wake_fd);
    free(a->ring);
    free(a->threads);
    free(a);
}
