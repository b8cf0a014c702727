/* The shm doorbell: notifications from a same-host initiator, written straight
 * into a ring in the target's memory (a sealed memfd the target makes per
 * session) and rung on a datagram socket whose other end the target's event
 * loop watches (inside the agent's wake fd, an epoll set). One thread wake-up
 * after the copy, where the native channel takes two.
 *
 * The initiator is not trusted: the target keeps its own head, reads each
 * record's length and sequence once and checks them, and a ring that breaks
 * the rules is read no more (its records counted as dropped, the initiator
 * told through `closed`). The initiator gets only its end of a socket pair:
 * it can wake the target, never steal the target's own wake-ups or change
 * how the target's end blocks. */
#ifndef AIOHIXL_SHM_BELL_H
#define AIOHIXL_SHM_BELL_H
#include "internal.h"

/* The shared layout. Producer and consumer fields on their own cache lines. */
typedef struct {
    _Atomic uint64_t tail; /* initiator: records published */
    char pad0[56];
    _Atomic uint64_t head;    /* target: records taken (the initiator's view of room) */
    _Atomic uint32_t waiting; /* target: drained and about to sleep, so ring the socket */
    _Atomic int32_t closed;   /* target: 0 while open, else the status later notes fail with */
    char pad1[48];
} bell_header;

typedef struct {
    _Atomic uint64_t seq; /* the record's number: the slot holds record seq, not an older lap's */
    _Atomic uint32_t len;
    uint32_t pad;
    uint8_t data[HX_NOTE_MAX];
    char pad1[48];
} bell_slot;

#define HX_BELL_BYTES (sizeof(bell_header) + HX_BELL_SLOTS * sizeof(bell_slot))

/* The initiator's half, one per shm peer. */
typedef struct {
    bell_header *h;
    bell_slot *slots;
    uint64_t tail; /* our own count: the shared one is only published */
    int fd;        /* our end of the socket pair */
} bell_out;

int bell_out_attach(bell_out *b, int ring_fd, int sock_fd);
/* HX_DONE_INLINE once the record is in the ring; HX_E_BUSY when it is full;
 * the target's closing status once it closed the ring. */
int bell_out_ring(bell_out *b, const uint8_t *data, uint32_t len);
/* Tests: hx_test_shm_forge. */
int bell_out_forge(bell_out *b, int64_t seq_skew, uint32_t len, int64_t tail_step);
void bell_out_free(bell_out *b);

/* The target's half: hooks of hx_shm_transport. */
int bell_init(hx_agent *a);
void bell_shutdown(hx_agent *a);
void bell_free(hx_agent *a);
uint32_t bell_move(hx_agent *a, bool all, uint64_t source);
/* Whether a ring holds records not yet moved (no system call). */
bool bell_held(hx_agent *a);
/* Quiet: a ring found empty is not armed (`waiting`): its initiator sends no
 * wake-up, the loop looks each turn. Not quiet: every ring is armed again,
 * and whether one already holds records is returned. */
bool bell_quiet(hx_agent *a, bool quiet);
#endif
