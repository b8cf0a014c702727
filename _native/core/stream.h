/* memcpy with stores that bypass the cache: the copy engine's large ops, and
 * the bench's limit for them (_native/bench). No dependency on the rest. */
#ifndef HX_STREAM_H
#define HX_STREAM_H
#include <stdint.h>

/* Ops of at least this many bytes in one address space may copy this way:
 * those of more than half the last-level cache do (hx_stream_min). */
#define HX_STREAM_MIN (4u * 1024u * 1024u)

/* The least op that streams here: more than half the last-level cache of CPU
 * 0 (sysfs), src and dst then not both fitting it; at least HX_STREAM_MIN,
 * which is also the answer where the cache size is not known. */
uint64_t hx_stream_min(void);

/* dst and src must not overlap; every store is fenced when it returns. */
void hx_copy_stream(uint8_t *dst, const uint8_t *src, uint64_t len);

#endif
