/* memcpy with stores that bypass the cache: the copy engine's large ops, and
 * the bench's limit for them (_native/bench). No dependency on the rest. */
#ifndef HX_STREAM_H
#define HX_STREAM_H
#include <stdint.h>

/* Ops of at least this many bytes in one address space copy this way: src and
 * dst no longer fit the last-level cache (8 MiB on the development VM). */
#define HX_STREAM_MIN (4u * 1024u * 1024u)

/* dst and src must not overlap; every store is fenced when it returns. */
void hx_copy_stream(uint8_t *dst, const uint8_t *src, uint64_t len);

#endif
