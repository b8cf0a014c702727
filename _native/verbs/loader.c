/* libibverbs, loaded with dlopen when an agent opens a device: the module
 * imports, and every other transport works, on machines without it. */
#include "verbs.h"

#ifdef HX_HAVE_VERBS
#include <dlfcn.h>

__thread char vb_err[256];

int hx_verbs_built(void) { return 1; }

const char *hx_verbs_error(void) { return vb_err; }

int vb_load_api(ibv_api *api)
{
    api->dl = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!api->dl) {
        VB_FAIL("libibverbs not available: %s", dlerror());
        return -1;
    }
#define SYM(field, name)                              \
    do {                                              \
        *(void **)&api->field = dlsym(api->dl, name); \
        if (!api->field) {                            \
            VB_FAIL("libibverbs lacks %s", name);     \
            return -1;                                \
        }                                             \
    } while (0)
    SYM(get_device_list, "ibv_get_device_list");
    SYM(free_device_list, "ibv_free_device_list");
    SYM(get_device_name, "ibv_get_device_name");
    SYM(open_device, "ibv_open_device");
    SYM(close_device, "ibv_close_device");
    SYM(query_port, "ibv_query_port");
    SYM(query_gid, "ibv_query_gid");
    SYM(alloc_pd, "ibv_alloc_pd");
    SYM(dealloc_pd, "ibv_dealloc_pd");
    SYM(reg_mr, "ibv_reg_mr");
    SYM(dereg_mr, "ibv_dereg_mr");
    SYM(create_comp_channel, "ibv_create_comp_channel");
    SYM(destroy_comp_channel, "ibv_destroy_comp_channel");
    SYM(create_cq, "ibv_create_cq");
    SYM(destroy_cq, "ibv_destroy_cq");
    SYM(create_qp, "ibv_create_qp");
    SYM(modify_qp, "ibv_modify_qp");
    SYM(destroy_qp, "ibv_destroy_qp");
    SYM(get_cq_event, "ibv_get_cq_event");
    SYM(ack_cq_events, "ibv_ack_cq_events");
#undef SYM
    return 0;
}

#endif
