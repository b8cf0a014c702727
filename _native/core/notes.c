/* Notifications that arrived for this agent: a bounded queue that native
 * threads fill and Python drains, waking the event loop through the same fd
 * as completions. A full queue never drops a message a sender can be held
 * back for: the push fails with HX_E_BUSY, the transport stops reading from
 * that sender, and hx_agent_drain_notes tells the transports there is room. */
#include "internal.h"
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct hx_note_entry {
    struct hx_note_entry *next;
    uint64_t source;
    uint32_t imm, flags, nbytes, len;
    uint8_t data[];
} hx_note_entry;

void hx_notes_init(hx_agent *a)
{
    pthread_mutex_init(&a->note_lock, NULL);
    a->note_cap = 4096;
}

void hx_notes_free(hx_agent *a)
{
    hx_note_entry *e = a->note_head;
    while (e) {
        hx_note_entry *next = e->next;
        free(e);
        e = next;
    }
    a->note_head = a->note_tail = NULL;
    pthread_mutex_destroy(&a->note_lock);
}

/* What the transports hold outside the queue (move_notes), moved in: the
 * records they still hold. */
static uint32_t move_held(hx_agent *a, bool all, uint64_t source)
{
    uint32_t held = 0;
    for (int t = 0; t < HX_NTRANSPORTS; t++)
        if (hx_transports[t]->move_notes)
            held += hx_transports[t]->move_notes(a, all, source);
    return held;
}

static int queue(hx_agent *a, const hx_note_entry *head, const uint8_t *data, bool force)
{
    uint32_t len = head->len;
    if (len > HX_NOTE_MAX)
        return HX_E_INVAL;
    pthread_mutex_lock(&a->note_lock);
    if (a->note_count >= a->note_cap && !force) {
        a->note_blocked = true;
        pthread_mutex_unlock(&a->note_lock);
        return HX_E_BUSY;
    }
    pthread_mutex_unlock(&a->note_lock);
    hx_note_entry *e = malloc(sizeof *e + len);
    if (!e)
        return HX_E_NOMEM;
    *e = *head;
    e->next = NULL;
    if (len)
        memcpy(e->data, data, len);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    pthread_mutex_lock(&a->note_lock);
    if (a->note_tail) {
        a->note_tail->next = e;
    } else {
        a->note_head = e;
        a->note_first_ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    }
    a->note_tail = e;
    a->note_count++;
    pthread_mutex_unlock(&a->note_lock);
    atomic_fetch_add_explicit(&a->stats.notes_received, 1, memory_order_relaxed);
    return HX_OK;
}

int hx_note_enqueue(hx_agent *a, uint64_t source, const uint8_t *data, uint32_t len, bool force)
{
    return queue(a, &(hx_note_entry){.source = source, .len = len, .flags = HX_NOTE_RUNG}, data, force);
}

/* Set while the event loop's thread asks whether notifications are ready
 * (hx_agent_notes_ready): what a transport queues then needs no wake-up,
 * the loop drains next (loop_got says there is something to drain). */
static __thread bool loop_asks, loop_got;

int hx_note_push(hx_agent *a, uint64_t source, const uint8_t *data, uint32_t len, uint32_t imm,
                 uint32_t flags, uint32_t nbytes)
{
    /* The sender's doorbell records were written before this message was
     * sent: they go first, and this one waits while they cannot (the queue
     * is full: note_blocked is set, the sender resumes at note_space). */
    if (source && move_held(a, false, source))
        return HX_E_BUSY;
    hx_note_entry head = {.source = source, .imm = imm, .flags = flags, .nbytes = nbytes, .len = len};
    int rc = queue(a, &head, data, false);
    if (rc == HX_OK && loop_asks)
        loop_got = true;
    else if (rc == HX_OK)
        hx_wake(a);
    return rc;
}

void hx_note_dropped(hx_agent *a)
{
    pthread_mutex_lock(&a->note_lock);
    a->note_dropped++;
    pthread_mutex_unlock(&a->note_lock);
}

int hx_agent_drain_notes(hx_agent *a, hx_note *out, int max)
{
    move_held(a, true, 0);
    int taken = 0;
    pthread_mutex_lock(&a->note_lock);
    /* Those it leaves arrived later: a drain that takes them says the same. */
    if (max > 0 && a->note_head)
        a->note_taken_ns = a->note_first_ns;
    while (taken < max && a->note_head) {
        hx_note_entry *e = a->note_head;
        a->note_head = e->next;
        if (!a->note_head)
            a->note_tail = NULL;
        a->note_count--;
        hx_note *o = &out[taken++];
        o->source = e->source;
        o->imm = e->imm;
        o->flags = e->flags;
        o->nbytes = e->nbytes;
        o->len = e->len;
        memcpy(o->data, e->data, e->len);
        free(e);
    }
    bool blocked = a->note_blocked && taken > 0;
    if (blocked)
        a->note_blocked = false;
    pthread_mutex_unlock(&a->note_lock);
    if (blocked)
        /* Senders were held back: the transports resume reading them. */
        for (int t = 0; t < HX_NTRANSPORTS; t++)
            if (hx_transports[t]->note_space)
                hx_transports[t]->note_space(a);
    return taken;
}

int hx_agent_notes_pending(hx_agent *a)
{
    uint32_t held = move_held(a, true, 0);
    pthread_mutex_lock(&a->note_lock);
    int n = (int)(a->note_count + held);
    pthread_mutex_unlock(&a->note_lock);
    return n;
}

int hx_agent_notes_ready(hx_agent *a)
{
    pthread_mutex_lock(&a->note_lock);
    bool ready = a->note_head != NULL;
    pthread_mutex_unlock(&a->note_lock);
    loop_asks = true;
    loop_got = false;
    /* Each transport is asked even when some are ready: its hook is also the
     * loop's turn (tcp sends the answers its last read held back). */
    for (int t = 0; t < HX_NTRANSPORTS; t++)
        if (hx_transports[t]->notes_held && hx_transports[t]->notes_held(a))
            ready = true;
    ready |= loop_got;
    loop_asks = false;
    return ready;
}

int hx_agent_notes_quiet(hx_agent *a, int quiet)
{
    bool held = false;
    for (int t = 0; t < HX_NTRANSPORTS; t++)
        if (hx_transports[t]->notes_quiet)
            held |= hx_transports[t]->notes_quiet(a, quiet != 0);
    return held;
}

uint64_t hx_agent_notes_dropped(hx_agent *a)
{
    pthread_mutex_lock(&a->note_lock);
    uint64_t n = a->note_dropped;
    pthread_mutex_unlock(&a->note_lock);
    return n;
}

uint64_t hx_agent_notes_arrived(hx_agent *a)
{
    pthread_mutex_lock(&a->note_lock);
    uint64_t at = a->note_taken_ns;
    pthread_mutex_unlock(&a->note_lock);
    return at;
}

void hx_agent_set_notes(hx_agent *a, uint32_t capacity) { a->note_cap = capacity ? capacity : 1; }
