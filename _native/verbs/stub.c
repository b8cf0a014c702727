/* Built without rdma-core's headers: the verbs calls exist and fail. */
#include "internal.h"

#ifndef HX_HAVE_VERBS
/* The stubs take their arguments and ignore them. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

int hx_verbs_built(void) { return 0; }
const char *hx_verbs_error(void) { return "aiohixl was built without rdma-core headers (libibverbs-dev)"; }

int hx_verbs_open(hx_agent *a, const char *dev, int port, int gid_index, int timeout, int retry_cnt)
{
    return HX_E_SYS;
}

int hx_verbs_local(hx_agent *a, uint8_t *gid, uint16_t *lid, int *mtu) { return HX_E_SYS; }

int hx_verbs_reg(hx_agent *a, uint32_t region, int readonly, uint32_t *rkey) { return HX_E_SYS; }

hx_peer *hx_verbs_peer_new(hx_agent *a, uint32_t *qpn, uint32_t *psn, int *status)
{
    *status = HX_E_SYS;
    return NULL;
}

int hx_verbs_peer_connect(hx_peer *p, uint32_t qpn, uint32_t psn, const uint8_t *gid, uint16_t lid, int mtu)
{
    return HX_E_SYS;
}

int hx_verbs_accept(hx_agent *a, uint64_t session, uint32_t qpn, uint32_t psn, const uint8_t *gid,
                    uint16_t lid, int mtu, uint32_t *lqpn, uint32_t *lpsn)
{
    return HX_E_SYS;
}

void hx_verbs_drop_session(hx_agent *a, uint64_t session) {}

int hx_verbs_post_imm(hx_peer *p, uint64_t op_id, const hx_sge *sges, uint32_t n, uint32_t imm)
{
    return HX_E_SYS;
}

int hx_verbs_export_new(hx_agent *a, uint64_t session, uint32_t region, uint64_t off, uint64_t len,
                        uint32_t access, uint32_t *qpn, uint32_t *psn, uint64_t *addr, uint32_t *rkey)
{
    return HX_E_SYS;
}

int hx_verbs_export_connect(hx_agent *a, uint64_t session, uint32_t qpn, uint32_t psn, const uint8_t *gid,
                            uint16_t lid, int mtu)
{
    return HX_E_SYS;
}

hx_peer *hx_verbs_raw_peer_new(hx_agent *a, uint32_t *qpn, uint32_t *psn, int *status)
{
    *status = HX_E_SYS;
    return NULL;
}

/* No state, no hooks: hx_verbs_open never succeeds. */
const hx_transport hx_verbs_transport = {.name = "verbs"};

#endif
