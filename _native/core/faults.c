/* Fault injection for the tests: a failure the system would rarely give
 * (out of memory, a broken epoll descriptor) made to happen on demand at a
 * named site, so the path that handles it can be tested. */
#include "internal.h"

atomic_int hx_faults[HX_NFAULTS];

void hx_test_fail_next(int site, int count)
{
    if (site >= 0 && site < HX_NFAULTS)
        atomic_store(&hx_faults[site], count > 0 ? count : 0);
}
