/* Copies where the remote end is reached by address: memmove within this
 * process, cross-memory attach (process_vm_readv/writev) into another one,
 * through a bounce buffer where the kernel's copy would alias. A leaf: the
 * copy pool and the inline path of copy.c both end here. */
#include "internal.h"
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

/* One cross-memory attach call; what it moved, or a negative status. */
static ssize_t cma_once(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len)
{
    struct iovec local, remote;
    if (opcode == HX_OP_PUT) {
        local = (struct iovec){(void *)src, len};
        remote = (struct iovec){dst, len};
        return process_vm_writev(pid, &local, 1, &remote, 1, 0);
    }
    local = (struct iovec){dst, len};
    remote = (struct iovec){(void *)src, len};
    return process_vm_readv(pid, &local, 1, &remote, 1, 0);
}

static int cma_copy(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len)
{
    /* Cross-memory attach moves at most what the kernel takes per call. */
    while (len) {
        ssize_t n = cma_once(opcode, pid, dst, src, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == ESRCH)
                return HX_E_CONNLOST; /* the target process is gone */
            if (errno == EPERM)
                return HX_E_ACCESS;
            return HX_E_REMOTE; /* EFAULT: the target's memory is not there */
        }
        if (n == 0)
            return HX_E_REMOTE;
        dst += n;
        src += n;
        len -= (uint64_t)n;
    }
    return HX_OK;
}

/* The kernel copies cross-memory attach with rep movsb, page by page. Where
 * the destination sits 1-63 bytes past the source modulo 4 KiB (a numpy
 * array's data 16 bytes into its page, written from a page-aligned region),
 * the stores alias the loads that follow them and the copy runs at a quarter
 * of its speed or less, however it is cut (docs/shm.md has the figures). Such
 * copies go through a buffer of this thread's placed 2 KiB away from both
 * ends, in pieces that stay in the cache between the two copies. */
#define HX_BOUNCE (128u * 1024u)
#define HX_PAGE 4096u

static pthread_key_t bounce_key;
static pthread_once_t bounce_once = PTHREAD_ONCE_INIT;

static void bounce_key_make(void) { (void)pthread_key_create(&bounce_key, free); }

static uint8_t *bounce_buffer(void)
{
    pthread_once(&bounce_once, bounce_key_make);
    uint8_t *b = pthread_getspecific(bounce_key);
    if (!b) {
        if (posix_memalign((void **)&b, HX_PAGE, HX_BOUNCE + HX_PAGE) != 0)
            return NULL;
        if (pthread_setspecific(bounce_key, b) != 0) {
            free(b);
            return NULL;
        }
    }
    return b;
}

static bool aliased(const uint8_t *dst, const uint8_t *src)
{
    uintptr_t d = ((uintptr_t)dst - (uintptr_t)src) & (HX_PAGE - 1);
    return d != 0 && d < 64;
}

static int cma_bounced(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len, uint8_t *buf)
{
    /* The buffer 2 KiB away from the remote end, modulo a page; then 2 KiB plus
     * the old distance away from the local one: neither copy aliases. */
    const uint8_t *far = opcode == HX_OP_PUT ? dst : src;
    uint8_t *b = buf + (((uintptr_t)far + HX_PAGE / 2) & (HX_PAGE - 1));
    while (len) {
        uint64_t n = len < HX_BOUNCE ? len : HX_BOUNCE;
        int rc;
        if (opcode == HX_OP_PUT) {
            memcpy(b, src, n);
            rc = cma_copy(opcode, pid, dst, b, n);
        } else {
            rc = cma_copy(opcode, pid, b, src, n);
            if (rc == HX_OK)
                memcpy(dst, b, n);
        }
        if (rc != HX_OK)
            return rc;
        dst += n;
        src += n;
        len -= n;
    }
    return HX_OK;
}

int hx_copy_run(int opcode, int pid, uint8_t *dst, const uint8_t *src, uint64_t len)
{
    if (!pid) {
        memmove(dst, src, len);
        return HX_OK;
    }
    if (len >= 256 && aliased(dst, src)) {
        uint8_t *buf = bounce_buffer();
        if (buf)
            return cma_bounced(opcode, pid, dst, src, len, buf);
    }
    return cma_copy(opcode, pid, dst, src, len);
}
