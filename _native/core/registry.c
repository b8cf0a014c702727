/* Region registries: regions by id, each with a count of the accesses in
 * progress. The agent's own memory is one; a same-host peer's mappings of
 * remote memory another. */
#include "internal.h"
#include <stdlib.h>
#include <string.h>

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

static hx_region **bucket_of(hx_registry *reg, uint32_t id) { return &reg->buckets[id % HX_REGION_BUCKETS]; }

hx_region *hx_reg_find_locked(hx_registry *reg, uint32_t id)
{
    for (hx_region *r = *bucket_of(reg, id); r; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

int hx_reg_add(hx_registry *reg, uint32_t id, uint8_t *base, uint64_t len, uint32_t access, int kind,
               uint64_t key)
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
    r->key = key;
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

static int check_locked(hx_region *r, const uint64_t *key, uint64_t off, uint64_t len, uint32_t need)
{
    if (!r || r->removed)
        return HX_E_NOREGION;
    if (key && *key != r->key)
        return HX_E_NOREGION; /* a guessed id is no region at all */
    if ((r->access & need) != need)
        return HX_E_ACCESS;
    if (off > r->len || len > r->len - off)
        return HX_E_BOUNDS;
    return HX_OK;
}

int hx_reg_acquire(hx_registry *reg, uint32_t id, const uint64_t *key, uint64_t off, uint64_t len,
                   uint32_t need, uint8_t **ptr, hx_region **out)
{
    pthread_mutex_lock(&reg->lock);
    hx_region *r = hx_reg_find_locked(reg, id);
    int rc = check_locked(r, key, off, len, need);
    if (rc == HX_OK) {
        r->busy++;
        *ptr = r->base + off;
        *out = r;
    }
    pthread_mutex_unlock(&reg->lock);
    return rc;
}

int hx_reg_check(hx_registry *reg, uint32_t id, const uint64_t *key, uint64_t off, uint64_t len,
                 uint32_t need)
{
    pthread_mutex_lock(&reg->lock);
    int rc = check_locked(hx_reg_find_locked(reg, id), key, off, len, need);
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

int hx_region_add(hx_agent *a, uint32_t id, uint64_t addr, uint64_t len, uint32_t access, uint64_t key)
{
    return hx_reg_add(&a->regs, id, (uint8_t *)(uintptr_t)addr, len, access, HX_MEM_DIRECT, key);
}

int hx_region_remove(hx_agent *a, uint32_t id, int wait)
{
    return hx_reg_remove(&a->regs, id, wait, NULL, NULL);
}

int hx_region_acquire(hx_agent *a, uint32_t id, uint64_t off, uint64_t len, uint32_t need, uint8_t **ptr,
                      hx_region **out)
{
    return hx_reg_acquire(&a->regs, id, NULL, off, len, need, ptr, out);
}
