/* The transports the agent knows, in the order it calls their hooks (see
 * hx_transport in internal.h): each one's slot in a->state is its index. */
#include "internal.h"

const hx_transport *const hx_transports[HX_NTRANSPORTS] = {
    [HX_TRANSPORT_LOOPBACK] = &hx_loopback_transport,
    [HX_TRANSPORT_SHM] = &hx_shm_transport,
    [HX_TRANSPORT_TCP] = &hx_tcp_transport,
    [HX_TRANSPORT_VERBS] = &hx_verbs_transport,
};
