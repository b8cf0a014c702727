/* Native baselines for `python -m aiohixl bench`: the physical limits that
 * aiohixl's results are divided by, timed in C. Used by the bench only; not
 * part of the library.
 *
 * Every call runs with the GIL released (cffi API mode), measures for at
 * least `seconds`, and reports GB/s as 1e9 bytes/s, like the rest of the
 * bench. On failure a call returns -1 and leaves errno and a short `where`
 * in its result. */
#ifndef AIOHIXL_BASELINES_H
#define AIOHIXL_BASELINES_H

#include <stdint.h>

/* CDEF-BEGIN */
typedef struct {
    double gbps;      /* median over the batches' rates */
    double best_gbps; /* the fastest batch */
    double seconds;   /* time inside the timed batches */
    uint64_t copies;  /* whole copies timed */
    int pieces;       /* threads that shared each copy */
    int err;          /* errno of the failure, or 0 */
    const char *where;
} hb_copy_result;

typedef struct {
    double gbps;        /* the whole run: bytes sent / time until the receiver had them all */
    double best_gbps;   /* the receiver's fastest interval (the first, slow start, left out) */
    double median_gbps; /* the receiver's median interval */
    int intervals;      /* intervals the two above are taken from */
    double seconds;
    uint64_t bytes;
    int err;
    const char *where;
} hb_stream_result;

typedef struct {
    double median_us;
    double p99_us;
    double mean_us;
    uint64_t ops;
    int err;
    const char *where;
} hb_rtt_result;

/* Every buffer is 2 MiB-aligned with transparent huge pages asked for (the
 * best case for a copy: process_vm_writev ran twice as fast here with them)
 * and faulted in before it is timed.
 *
 * memcpy of `size` bytes between two such buffers. With
 * threads > 1 each copy is cut as aiohixl's copy engine cuts it (one share
 * per thread, at least min_piece bytes, 4 KiB multiples) and the threads
 * meet at a barrier after every copy, as a put completes when its last
 * piece does. stream: copy with the copy engine's streaming stores
 * (hx_copy_stream, its way for ops of HX_STREAM_MIN and more) instead of
 * glibc's memcpy, which streams only a single call above its own threshold.
 * memfd: both buffers are mappings of memfds instead, huge pages asked for
 * (MADV_HUGEPAGE) as aiohixl's allocate() asks: the pages a put between
 * allocated regions copies, small ones where shmem_enabled gives no huge. */
int hb_memcpy(uint64_t size, int threads, uint64_t min_piece, int stream, int memfd, double seconds,
              hb_copy_result *out);

/* The same, with process_vm_writev into a buffer of a forked child. */
int hb_process_vm_writev(uint64_t size, int threads, uint64_t min_piece, double seconds, hb_copy_result *out);

/* One tcp stream over 127.0.0.1 from this process to a forked receiver:
 * write_size-byte writes and reads, the kernel's default socket buffers. The
 * receiver also times intervals of about a fifth of the run (50-200 ms).
 * spin = 0 blocks in send and recv, as iperf3 does; spin = 1 polls on both
 * ends (MSG_DONTWAIT, sched_yield), as aiohixl's tcp I/O threads do. */
int hb_tcp_stream(uint64_t write_size, int spin, double seconds, hb_stream_result *out);

/* Round trips to a forked child over 127.0.0.1 (TCP_NODELAY): `request`
 * bytes out, 1 byte back. spin = 0 blocks in recv; spin = 1 polls with
 * MSG_DONTWAIT and sched_yield on both ends, as aiohixl's I/O threads do
 * while active. */
int hb_tcp_rtt(uint32_t request, int spin, double seconds, hb_rtt_result *out);

/* Wake-up round trips to a forked child through two eventfds, each end
 * blocked in read() until the other's write(): half of one is the native
 * one-way wake-up between two processes, the least a notification that wakes
 * a blocked target can cost. cpus = 2 pins the two ends to two CPUs (the
 * first two this thread may run on; EINVAL with fewer), so that each wake-up
 * is of a thread on another CPU; cpus = 1 pins both to the first, so that
 * each is a context switch; cpus = 0 leaves them to the scheduler, which may
 * do either. */
int hb_wake_rtt(double seconds, int cpus, hb_rtt_result *out);
/* CDEF-END */

#endif
