/* Same-host peers: the target does nothing at all.
 *
 * A region the target allocated (memfd) is mapped here once, from the fd the
 * target passed over a unix socket, and ops are plain copies into it. A
 * region over the target's own memory is reached with process_vm_writev/readv
 * at the address the target itself reported. Either way the remote ranges and
 * rights live in this peer's registry, filled only from what the target said,
 * and every op is checked against it before a byte moves.
 */
#include "internal.h"
#include "shm/bell.h"
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

typedef struct {
    hx_peer base;
    hx_registry maps;
    int pid;
    bell_out bell; /* the target's doorbell, once attached */
} shm_peer;

static int shm_post(hx_peer *p, int opcode, uint64_t op_id, const hx_sge *sges, uint32_t n)
{
    shm_peer *s = (shm_peer *)p;
    /* Every sge names one remote region, all of one kind (Python routes them). */
    hx_region *r = NULL;
    uint8_t *ptr;
    int rc = hx_reg_acquire(&s->maps, sges[0].remote_region, NULL, 0, 0, 0, &ptr, &r);
    if (rc != HX_OK)
        return rc;
    int pid = r->kind == HX_MEM_CMA ? s->pid : 0;
    hx_region_release(r);
    return hx_copy_post(p, &s->maps, pid, opcode, op_id, sges, n);
}

/* Python sends a note only once the ops it follows completed, so never with a dep. */
static int shm_note(hx_peer *p, uint64_t op_id, uint64_t dep, const uint8_t *data, uint32_t len, int flags)
{
    shm_peer *s = (shm_peer *)p;
    (void)op_id;
    (void)flags; /* a doorbell has no answer to poll for */
    if (!s->bell.h || dep)
        return HX_E_INVAL;
    return bell_out_ring(&s->bell, data, len);
}

static void shm_fail(hx_peer *p, int status) { hx_pool_fail_peer(p->agent, p->id, status); }

static void unmap_all(shm_peer *s)
{
    for (int i = 0; i < HX_REGION_BUCKETS; i++)
        for (hx_region *r = s->maps.buckets[i]; r; r = r->next)
            if (r->kind == HX_MEM_DIRECT && r->len)
                munmap(r->base, r->len);
    hx_reg_destroy(&s->maps);
}

static void shm_destroy(hx_peer *p)
{
    shm_peer *s = (shm_peer *)p;
    unmap_all(s);
    bell_out_free(&s->bell);
    free(s);
}

static const hx_peer_ops shm_ops = {.post = shm_post,
                                    .note = shm_note,
                                    .fail = shm_fail,
                                    .destroy = shm_destroy,
                                    .transport = HX_TRANSPORT_SHM};

/* Per agent: the doorbells it serves (bell.c). Each peer holds its mappings;
 * copies run on the pool. */
const hx_transport hx_shm_transport = {.name = "shm",
                                       .init = bell_init,
                                       .shutdown = bell_shutdown,
                                       .free = bell_free,
                                       .move_notes = bell_move,
                                       .notes_held = bell_held,
                                       .notes_quiet = bell_quiet};

hx_peer *hx_shm_new(hx_agent *a, int pid, int *status)
{
    shm_peer *s = calloc(1, sizeof *s);
    if (!s) {
        *status = HX_E_NOMEM;
        return NULL;
    }
    hx_peer_init(&s->base, a, &shm_ops);
    hx_reg_init(&s->maps);
    s->pid = pid;
    *status = HX_OK;
    return &s->base;
}

int hx_shm_map(hx_peer *p, uint32_t region, int fd, uint64_t size, uint32_t access)
{
    shm_peer *s = (shm_peer *)p;
    /* A target that could shrink the file could make our copies fault
     * (SIGBUS): map only memfds sealed against shrinking. */
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
        return HX_E_ACCESS;
    off_t end = lseek(fd, 0, SEEK_END);
    if (end < 0 || (uint64_t)end < size)
        return HX_E_BOUNDS;
    if (size == 0)
        return hx_reg_add(&s->maps, region, NULL, 0, access, HX_MEM_DIRECT, 0);
    int prot = PROT_READ | ((access & HX_ACCESS_REMOTE_WRITE) ? PROT_WRITE : 0);
    void *m = mmap(NULL, size, prot, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m == MAP_FAILED)
        return errno == EACCES ? HX_E_ACCESS : HX_E_SYS;
    int rc = hx_reg_add(&s->maps, region, m, size, access, HX_MEM_DIRECT, 0);
    if (rc != HX_OK)
        munmap(m, size);
    return rc;
}

int hx_shm_bell(hx_peer *p, int ring_fd, int sock_fd)
{
    return bell_out_attach(&((shm_peer *)p)->bell, ring_fd, sock_fd);
}

int hx_test_shm_forge(hx_peer *p, int64_t seq_skew, uint32_t len, int64_t tail_step)
{
    shm_peer *s = (shm_peer *)p;
    return s->bell.h ? bell_out_forge(&s->bell, seq_skew, len, tail_step) : HX_E_INVAL;
}

int hx_shm_attach(hx_peer *p, uint32_t region, uint64_t addr, uint64_t size, uint32_t access)
{
    shm_peer *s = (shm_peer *)p;
    return hx_reg_add(&s->maps, region, (uint8_t *)(uintptr_t)addr, size, access, HX_MEM_CMA, 0);
}

int hx_shm_forget(hx_peer *p, uint32_t region, int wait)
{
    shm_peer *s = (shm_peer *)p;
    uint8_t *base;
    uint64_t len;
    pthread_mutex_lock(&s->maps.lock);
    hx_region *r = hx_reg_find_locked(&s->maps, region);
    int kind = r ? r->kind : HX_MEM_CMA;
    pthread_mutex_unlock(&s->maps.lock);
    int rc = hx_reg_remove(&s->maps, region, wait, &base, &len);
    if (rc == HX_OK && kind == HX_MEM_DIRECT && len)
        munmap(base, len);
    return rc;
}

int hx_cma_probe(int pid, uint64_t addr, uint8_t *out, uint32_t len)
{
    struct iovec local = {out, len}, remote = {(void *)(uintptr_t)addr, len};
    ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0)
        return -errno;
    return n == (ssize_t)len ? 0 : -EIO;
}
