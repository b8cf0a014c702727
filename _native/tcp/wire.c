/* The tcp data frames' headers (docs/protocol.md, "Data frames").
 *
 * request, REQ_SIZE bytes:   0 magic u32, 4 op u8 (W_*), 5 flags u8
 *                            (REQ_MORE; set by the sender's flush), 8 region u32,
 *                            16 offset u64, 24 length u64, 32 op id u64,
 *                            40 region key u64
 *                            (W_CHECK: region is the op checked, offset 0,
 *                            length that of the entries that follow;
 *                            W_NOTE: offset is the op it follows, 0 for
 *                            none; length the message's, which follows)
 * response, RESP_SIZE bytes: 0 magic u32, 4 kind u8 (R_*), 8 status i32,
 *                            16 op id u64, 24 length u64 of the data that follows
 *
 * Bytes not named are zero. No address is ever on the wire.
 */
#include "tcp.h"
#include <endian.h>
#include <string.h>

#define WIRE_MAGIC 0x50445848u /* "HXDP" little endian */

/* clang-format off */
static void put32(uint8_t *p, uint32_t v) { v = htole32(v); memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { v = htole64(v); memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }
/* clang-format on */

void tcp_put_req(uint8_t *h, const tcp_req *r)
{
    memset(h, 0, REQ_SIZE);
    put32(h, WIRE_MAGIC);
    h[4] = (uint8_t)r->op;
    put32(h + 8, r->region);
    put64(h + 16, r->off);
    put64(h + 24, r->len);
    put64(h + 32, r->op_id);
    put64(h + 40, r->key);
}

void tcp_put_resp(uint8_t *h, const tcp_resp *r)
{
    memset(h, 0, RESP_SIZE);
    put32(h, WIRE_MAGIC);
    h[4] = (uint8_t)r->kind;
    put32(h + 8, (uint32_t)r->status);
    put64(h + 16, r->op_id);
    put64(h + 24, r->len);
}

int tcp_get_req(const uint8_t *h, tcp_req *r)
{
    if (get32(h) != WIRE_MAGIC)
        return HX_E_PROTO;
    r->op = h[4];
    r->region = get32(h + 8);
    r->off = get64(h + 16);
    r->len = get64(h + 24);
    r->op_id = get64(h + 32);
    r->key = get64(h + 40);
    switch (r->op) {
    case W_PUT:
    case W_GET:
        return r->len == 0 || r->len > HX_TCP_CHUNK ? HX_E_PROTO : HX_OK;
    case W_CHECK:
        if (r->len == 0 || r->len > HX_TCP_CHUNK || r->len % CHECK_ENTRY)
            return HX_E_PROTO;
        return r->region == W_PUT || r->region == W_GET ? HX_OK : HX_E_PROTO;
    case W_NOTE:
        return r->len > HX_NOTE_MAX ? HX_E_PROTO : HX_OK;
    case W_PING:
        return r->len != 0 ? HX_E_PROTO : HX_OK;
    default:
        return HX_E_PROTO;
    }
}

int tcp_get_resp(const uint8_t *h, tcp_resp *r)
{
    if (get32(h) != WIRE_MAGIC)
        return HX_E_PROTO;
    r->kind = h[4];
    r->status = (int32_t)get32(h + 8);
    r->op_id = get64(h + 16);
    r->len = get64(h + 24);
    return HX_OK;
}
