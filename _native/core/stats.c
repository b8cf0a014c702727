/* The agent's counters: ops, bytes and errors per transport, notifications.
 * Each is a relaxed atomic add on the path that already runs; reading takes
 * one call and no lock (the values are each exact, not a snapshot of all). */
#include "internal.h"

void hx_stat_error(hx_agent *a, int t)
{
    if (t >= 0 && t < HX_NTRANSPORTS)
        atomic_fetch_add_explicit(&a->stats.errors[t], 1, memory_order_relaxed);
}

void hx_agent_stats(hx_agent *a, hx_stats *out)
{
    for (int t = 0; t < HX_NTRANSPORTS; t++) {
        out->transports[t].ops = atomic_load_explicit(&a->stats.ops[t], memory_order_relaxed);
        out->transports[t].bytes = atomic_load_explicit(&a->stats.bytes[t], memory_order_relaxed);
        out->transports[t].errors = atomic_load_explicit(&a->stats.errors[t], memory_order_relaxed);
    }
    out->notes_received = atomic_load_explicit(&a->stats.notes_received, memory_order_relaxed);
    out->notes_sent = atomic_load_explicit(&a->stats.notes_sent, memory_order_relaxed);
    out->notes_dropped = hx_agent_notes_dropped(a);
}

const char *hx_transport_name(int t) { return t >= 0 && t < HX_NTRANSPORTS ? hx_transports[t]->name : NULL; }
