/* Copies that bypass the cache: large same-host puts and gets.
 *
 * A copy far larger than the last-level cache gains nothing from leaving its
 * destination there, and ordinary stores read every destination line before
 * writing it. glibc's memcpy streams only a single call above its threshold
 * (48 MiB on the development VM), which the copy pool's pieces (1-6 MiB) never
 * reach: at 64 MiB the pieces copied at 0.6x one memcpy, streamed at 0.9x
 * (docs/bench-history.md, "Streaming stores"). SSE2 is in every x86-64 CPU; other
 * architectures use memcpy. */
#include "core/stream.h"
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

void hx_copy_stream(uint8_t *dst, const uint8_t *src, uint64_t len)
{
#if defined(__SSE2__)
    uint64_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (len < head + 64) {
        memcpy(dst, src, len);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    __m128i *d = (__m128i *)dst;
    const __m128i *s = (const __m128i *)src;
    for (uint64_t lines = len / 64; lines; lines--, d += 4, s += 4) {
        __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
        __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
        _mm_stream_si128(d, a);
        _mm_stream_si128(d + 1, b);
        _mm_stream_si128(d + 2, c);
        _mm_stream_si128(d + 3, e);
    }
    /* Streaming stores are weakly ordered: fence them before the op can be
     * reported done (and its notification sent) from any thread. */
    _mm_sfence();
    memcpy(d, s, len & 63);
#else
    memcpy(dst, src, len);
#endif
}
