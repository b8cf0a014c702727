/* Memory registration: a region of the agent's registry gets one MR, kept
 * until the region goes (the registry's release hook drops it). */
#include "verbs.h"

#ifdef HX_HAVE_VERBS
#include <errno.h>
#include <string.h>

void vb_release_mr(void *ctx, void *mr)
{
    hx_verbs *v = ctx;
    v->api.dereg_mr(mr);
}

int hx_verbs_reg(hx_agent *a, uint32_t region, int readonly, uint32_t *rkey)
{
    hx_verbs *v = V(a);
    if (!v)
        return HX_E_INVAL;
    hx_registry *reg = &a->regs;
    pthread_mutex_lock(&reg->lock);
    hx_region *r = hx_reg_find_locked(reg, region);
    if (!r || r->removed) {
        pthread_mutex_unlock(&reg->lock);
        return HX_E_NOREGION;
    }
    if (r->mr) {
        *rkey = ((struct ibv_mr *)r->mr)->rkey;
        pthread_mutex_unlock(&reg->lock);
        return HX_OK;
    }
    int access = readonly ? 0 : IBV_ACCESS_LOCAL_WRITE;
    if (r->access & HX_ACCESS_REMOTE_WRITE)
        access |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    if (r->access & HX_ACCESS_REMOTE_READ)
        access |= IBV_ACCESS_REMOTE_READ;
    /* A zero-length region still gets an MR of one byte's worth of nothing. */
    struct ibv_mr *mr = r->len ? v->api.reg_mr(v->pd, r->base, r->len, access) : NULL;
    if (!mr) {
        pthread_mutex_unlock(&reg->lock);
        VB_FAIL("ibv_reg_mr of %llu bytes failed: %s (is the memlock limit too low?)",
                (unsigned long long)r->len, strerror(errno));
        return HX_E_SYS;
    }
    r->mr = mr;
    *rkey = mr->rkey;
    pthread_mutex_unlock(&reg->lock);
    return HX_OK;
}

#endif
