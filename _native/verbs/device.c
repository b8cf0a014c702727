/* The device: open (PD, completion channel, CQ, completion thread), the
 * port's address, and the transport's shutdown and free. */
#include "verbs.h"

#ifdef HX_HAVE_VERBS
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

/* Opens the device named `dev` (the first one when NULL or empty) into v->ctx. */
static int open_device(hx_verbs *v, const char *dev)
{
    int num = 0;
    struct ibv_device **list = v->api.get_device_list(&num);
    struct ibv_device *chosen = NULL;
    for (int i = 0; list && i < num && !chosen; i++)
        if (!dev || !*dev || strcmp(v->api.get_device_name(list[i]), dev) == 0)
            chosen = list[i];
    if (!chosen) {
        if (!list || num == 0)
            VB_FAIL("no RDMA device");
        else
            VB_FAIL("no RDMA device named %s", dev);
    } else {
        v->ctx = v->api.open_device(chosen);
        if (!v->ctx)
            VB_FAIL("ibv_open_device failed: %s", strerror(errno));
    }
    if (list)
        v->api.free_device_list(list);
    return v->ctx ? 0 : -1;
}

/* The port's state, limits and address: what a peer's QP is built against. */
static int query_port(hx_verbs *v, int port, int gid_index)
{
    struct ibv_port_attr pa;
    memset(&pa, 0, sizeof pa);
    if (v->api.query_port(v->ctx, (uint8_t)port, &pa)) {
        VB_FAIL("ibv_query_port(%d) failed: %s", port, strerror(errno));
        return -1;
    }
    if (pa.state != IBV_PORT_ACTIVE) {
        VB_FAIL("port %d is not active (state %d)", port, pa.state);
        return -1;
    }
    v->max_msg = 1u << 30;
    if (pa.max_msg_sz && pa.max_msg_sz < v->max_msg)
        v->max_msg = pa.max_msg_sz;
    v->port = port;
    v->gid_index = gid_index;
    v->mtu = pa.active_mtu;
    v->lid = pa.lid;
    if (v->api.query_gid(v->ctx, (uint8_t)port, gid_index, &v->gid)) {
        VB_FAIL("ibv_query_gid(%d) failed: %s", gid_index, strerror(errno));
        return -1;
    }
    return 0;
}

/* The protection domain, and the CQ with its completion channel and the thread's stop fd. */
static int open_queues(hx_verbs *v)
{
    v->pd = v->api.alloc_pd(v->ctx);
    v->ch = v->pd ? v->api.create_comp_channel(v->ctx) : NULL;
    v->cq = v->ch ? v->api.create_cq(v->ctx, 4 * SQ_DEPTH, NULL, v->ch, 0) : NULL;
    if (!v->cq) {
        VB_FAIL("creating the protection domain, completion channel or CQ failed: %s", strerror(errno));
        return -1;
    }
    fcntl(v->ch->fd, F_SETFL, fcntl(v->ch->fd, F_GETFL) | O_NONBLOCK);
    v->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (v->stop_fd < 0) {
        VB_FAIL("eventfd failed: %s", strerror(errno));
        return -1;
    }
    return 0;
}

static void free_unstarted(hx_verbs *v)
{
    if (v->cq)
        v->api.destroy_cq(v->cq);
    if (v->ch)
        v->api.destroy_comp_channel(v->ch);
    if (v->pd)
        v->api.dealloc_pd(v->pd);
    if (v->ctx)
        v->api.close_device(v->ctx);
    if (v->stop_fd >= 0)
        close(v->stop_fd);
    if (v->api.dl)
        dlclose(v->api.dl);
    free(v);
}

int hx_verbs_open(hx_agent *a, const char *dev, int port, int gid_index, int timeout, int retry_cnt)
{
    if (V(a))
        return HX_OK;
    hx_verbs *v = calloc(1, sizeof *v);
    if (!v)
        return HX_E_NOMEM;
    v->stop_fd = -1;
    v->timeout = timeout;
    v->retry_cnt = retry_cnt;
    if (vb_load_api(&v->api) < 0 || open_device(v, dev) < 0 || query_port(v, port, gid_index) < 0 ||
        open_queues(v) < 0) {
        free_unstarted(v);
        return HX_E_SYS;
    }
    pthread_mutex_init(&v->lock, NULL);
    pthread_cond_init(&v->drained, NULL);
    atomic_init(&v->stop, false);
    a->state[HX_TRANSPORT_VERBS] = v;
    a->regs.release = vb_release_mr;
    a->regs.release_ctx = v;
    if (pthread_create(&v->thread, NULL, vb_completion_main, a) != 0) {
        VB_FAIL("cannot start the completion thread");
        a->state[HX_TRANSPORT_VERBS] = NULL;
        a->regs.release = NULL;
        pthread_cond_destroy(&v->drained);
        pthread_mutex_destroy(&v->lock);
        free_unstarted(v);
        return HX_E_SYS;
    }
    v->thread_started = true;
    pthread_setname_np(v->thread, "hixl-verbs-cq");
    return HX_OK;
}

int hx_verbs_local(hx_agent *a, uint8_t *gid, uint16_t *lid, int *mtu)
{
    hx_verbs *v = V(a);
    if (!v)
        return HX_E_INVAL;
    memcpy(gid, v->gid.raw, 16);
    *lid = v->lid;
    *mtu = v->mtu;
    return HX_OK;
}

/* Every QP to error; wait (bounded) for the flushed completions, so no op's
 * memory is released while the NIC may still touch it; stop the thread. */
static void verbs_shutdown(hx_agent *a)
{
    hx_verbs *v = V(a);
    if (!v || !v->thread_started)
        return;
    pthread_mutex_lock(&v->lock);
    for (vqp *q = v->qps; q; q = q->next_all) {
        int expected = 0;
        atomic_compare_exchange_strong(&q->base.failed, &expected, HX_E_CLOSED);
        pthread_mutex_lock(&q->lock);
        q->broken = true;
        pthread_mutex_unlock(&q->lock);
        vb_qp_to_error(v, q);
    }
    vqp *all = v->qps;
    pthread_mutex_unlock(&v->lock);
    for (vqp *q = all; q; q = q->next_all)
        vb_fail_pending(a, q, HX_E_CLOSED);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 5;
    for (vqp *q = all; q; q = q->next_all) {
        pthread_mutex_lock(&q->lock);
        while (q->ops_inflight) {
            /* drained is signalled under q->lock by the completion thread */
            if (pthread_cond_timedwait(&v->drained, &q->lock, &deadline) == ETIMEDOUT)
                break;
        }
        pthread_mutex_unlock(&q->lock);
    }
    atomic_store(&v->stop, true);
    uint64_t one = 1;
    ssize_t w = write(v->stop_fd, &one, sizeof one);
    (void)w;
    pthread_join(v->thread, NULL);
    v->thread_started = false;
}

static void verbs_free(hx_agent *a)
{
    hx_verbs *v = V(a);
    if (!v)
        return;
    verbs_shutdown(a);
    vqp *q = v->qps;
    while (q) {
        vqp *next = q->next_all;
        vb_qp_free(v, q);
        q = next;
    }
    v->qps = NULL;
    /* MRs go with the regions (hx_reg_destroy), before this is called. */
    v->api.destroy_cq(v->cq);
    v->api.destroy_comp_channel(v->ch);
    v->api.dealloc_pd(v->pd);
    v->api.close_device(v->ctx);
    close(v->stop_fd);
    dlclose(v->api.dl);
    free(v);
    a->state[HX_TRANSPORT_VERBS] = NULL;
}

const hx_transport hx_verbs_transport = {
    .name = "verbs", .shutdown = verbs_shutdown, .free = verbs_free, .note_space = vb_note_space};

#endif
