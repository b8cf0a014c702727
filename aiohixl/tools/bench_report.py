"""The bench's results, and how they read: the record ``--json`` writes, the ratios to the
physical limits (``annotate``), the printed report (``render``) and the plot.

A recorded run (``--json``) renders again as it printed: ``render(Results(**json.load(f)))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohixl

from . import baselines

KiB, MiB = 1 << 10, 1 << 20
ROUNDS = 4  # one at a time over N and N in flight alternate this many times
REG_ROUNDS = 3  # registration figures: the best of this many rounds
INLINE_PATHS = ("loopback", "shm-memfd", "shm-cma")  # same-host ops up to 1 MiB end as they are posted


@dataclass
class Results:
    machine: dict[str, Any] = field(default_factory=dict)
    baselines: dict[str, Any] = field(default_factory=dict)
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)
    registration: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # transport -> why it was not measured


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def size_of(label: str) -> int:
    n, unit = label.split()
    return int(n) * (MiB if unit == "MiB" else KiB)


def render_peers(r: Results) -> list[str]:
    """Peers beside the aiohixl path they compare with; ratios > 1 mean aiohixl is better."""
    lines = ["", "peers (two processes, host DRAM, one write at a time, target bytes verified):"]
    sizes = list(next(iter(r.transports.values()))["bandwidth"]) if r.transports else []
    head = f"  {'':<22}{'4 KiB lat':>11}{'64 KiB lat':>12}" + "".join(f"{s:>10}" for s in sizes)
    lines.append(head + "  idle CPU  verified")
    for label, p in r.peers.items():
        ours_name = p["compare_with"]
        ours = r.transports.get(ours_name)
        if "error" in p:
            lines.append(f"  {label:<22} not run: {' '.join(p['error'])}")
            continue
        lat = p["latency_us"]
        row = f"  {label:<22}{lat['4096']['median']:>8.1f} us{lat['65536']['median']:>9.1f} us"
        row += "".join(f"{p['bandwidth_gbps'][str(size_of(s))]:>10.2f}" for s in sizes)
        lines.append(
            row
            + f"  {p.get('idle_cpu_pct', float('nan')):6.1f}%  {p['verified']}"
            + (f"  ({p['exit']})" if "exit" in p else "")
        )
        if ours is None:
            continue
        olat = ours["latency"]
        lat4, lat64 = olat["put 4 KiB"]["median_us"], olat["put 64 KiB"]["median_us"]
        row = f"  {'aiohixl ' + ours_name:<22}{lat4:>8.1f} us{lat64:>9.1f} us"
        row += "".join(f"{ours['bandwidth'][s]['one_gbps']:>10.2f}" for s in sizes)
        idle = r.machine.get("idle", {}).get("initiator_pct", float("nan"))
        lines.append(row + f"  {idle:6.1f}%  {ours.get('verified')}")
        row = (
            f"  {'  aiohixl advantage':<22}{lat['4096']['median'] / olat['put 4 KiB']['median_us']:>9.2f}x"
            f"{lat['65536']['median'] / olat['put 64 KiB']['median_us']:>10.2f}x"
        )
        row += "".join(
            f"{ours['bandwidth'][s]['one_gbps'] / p['bandwidth_gbps'][str(size_of(s))]:>9.2f}x" for s in sizes
        )
        lines.append(row)
        busy = next((k for k in olat if k.startswith("put 4 KiB, busy_poll_us=")), None)
        if busy:
            b4 = olat[busy]["median_us"]
            label = "aiohixl " + ours_name + ", " + busy.split(", ")[1]
            lines.append(f"  {label:<22}{b4:>8.1f} us  (advantage {lat['4096']['median'] / b4:.2f}x at 4 KiB)")
    return lines


def plot(r: Results, path: str) -> None:
    """Bandwidth by size for every path (and peer), and 4 KiB latency, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, lat) = plt.subplots(1, 2, figsize=(13, 5))
    b = r.baselines
    sizes = list(b["memcpy_gbps"])
    xs = [size_of(s) for s in sizes]
    for kind, key, style in (("shm-memfd", "memcpy", "k--"), ("shm-cma", "process_vm_writev", "k-.")):
        # Each size's limit, as the ratios use it: one thread, or the faster
        # of one and all where the copy engine shares the copy.
        ys = [(baselines.copy_limit(b, kind, s, x) or (None, None))[1] for s, x in zip(sizes, xs, strict=True)]
        if any(ys):
            bw.plot(xs, [y or float("nan") for y in ys], style, label=f"{key} (baseline, the limit at each size)")
    if b.get("tcp_stream_gbps"):
        bw.axhline(b["tcp_stream_gbps"], color="grey", linestyle=":", label="tcp stream (baseline)")
    names, values = [], []
    for name, t in r.transports.items():
        bw.plot(xs, [t["bandwidth"][s]["one_gbps"] for s in sizes], "o-", label=f"aiohixl {name}")
        names.append(f"aiohixl {name}")
        values.append(t["latency"]["put 4 KiB"]["median_us"])
    for label, p in r.peers.items():
        if "error" in p:
            continue
        bw.plot(xs, [p["bandwidth_gbps"][str(x)] for x in xs], "s:", label=label)
        names.append(label)
        values.append(p["latency_us"]["4096"]["median"])
    bw.set_xscale("log", base=2)
    bw.set_xticks(xs, sizes)
    bw.set_ylabel("GB/s, one awaited put at a time")
    bw.set_title("bandwidth")
    bw.legend(fontsize=8)
    lat.barh(names, values)
    lat.set_xscale("log")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    lat.xaxis.set_major_formatter(ScalarFormatter())
    lat.xaxis.set_minor_formatter(NullFormatter())
    lat.set_xlabel("median us, awaited 4 KiB put (log scale)")
    lat.set_title("latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def annotate(r: Results) -> int:
    """Each bandwidth row (and the tcp 4 KiB put's latency) gets the physical
    limit of its kind, the ratios to it and ``above_limit``: a result more than
    5% beyond the limit says the baseline is wrong. Returns how many are."""
    b, flagged = r.baselines, 0
    for t in r.transports.values():
        for size, row in t["bandwidth"].items():
            found = baselines.copy_limit(b, t["path"], size, size_of(size))
            if found is None or not found[1]:
                row["limit"] = {"baseline": found[0] if found else None, "gbps": None, "above_limit": False}
                continue
            key, gbps = found
            one, many = row["one_gbps"] / gbps, row["inflight_gbps"] / gbps
            above = max(one, many) > baselines.FLAG_ABOVE
            flagged += above
            row["limit"] = {
                "baseline": key,
                "gbps": gbps,
                "one_ratio": one,
                "inflight_ratio": many,
                "above_limit": above,
            }
            # Between allocated regions the put copies memfd pages: the faster of the same copies
            # between memfds parts the limit's memory (anonymous, huge pages) from the engine.
            same = [(k, b.get(k, {}).get(size)) for k in ("memcpy_memfd_threaded_gbps", "stream_memfd_threaded_gbps")]
            key_memfd, memfd = max(same, key=lambda kv: kv[1] or 0)
            if memfd and t["path"] in ("loopback", "shm-memfd"):
                row["limit"]["memfd_baseline"] = key_memfd
                row["limit"]["memfd_gbps"] = memfd
                row["limit"]["memfd_one_ratio"] = row["one_gbps"] / memfd
        lat = t["latency"].get(f"put {fmt_size(baselines.RTT_REQUEST)}")
        rtt = baselines.rtt_limit_us(b)
        if t["path"] == "tcp" and lat and rtt:
            # A put is a request and its acknowledgement: one round trip at least.
            time_ratio = lat["median_us"] / rtt[1]
            above = time_ratio * baselines.FLAG_ABOVE < 1
            flagged += above
            lat["limit"] = {"baseline": rtt[0], "us": rtt[1], "time_ratio": time_ratio, "above_limit": above}
        wake, floor = baselines.one_way_wake_us(b), baselines.one_way_asyncio_wake_us(b)
        apart = baselines.one_way_wake_us(b, "wake_rtt_apart_us")
        one = baselines.one_way_wake_us(b, "wake_rtt_one_cpu_us")
        for row in t.get("notify", {}).values():
            # put + k x each one-way wake-up: what the message adds to its put, in wake-ups.
            beyond = row["median_us"] - row["put_median_us"]
            row["beyond_put_us"] = beyond
            row["beyond_over_wake"] = beyond / wake if wake else None
            row["beyond_over_wake_apart"] = beyond / apart if apart else None
            row["beyond_over_wake_one_cpu"] = beyond / one if one else None
            row["beyond_over_asyncio_wake"] = beyond / floor if floor else None
    return flagged


FLAG = "(!) above the physical limit: check the baseline"


def _flag(x: float) -> str:
    if x <= baselines.FLAG_ABOVE:
        return f"{x:.2f}x"
    return (f"{x:.3f}x" if round(x, 2) <= baselines.FLAG_ABOVE else f"{x:.2f}x") + " (!)"


def render_baselines(b: dict[str, Any]) -> list[str]:
    def num(v: float | None, width: int) -> str:
        return f"{v:>{width}.2f}" if v else f"{'-':>{width}}"

    t = b["copy_threads"]
    lines = [
        "baselines (timed in C, GB/s = 1e9 bytes/s; the better of two passes, before and after the transports;",
        "copies: the fastest of >= 5 batches of >= 1 ms):",
        f"  {'':>7}  {'memcpy':>8}{f'memcpy x{t}':>12}{'streamed':>10}{f'x{t}':>6}"
        f"{'process_vm_writev':>20}{f'x{t}':>6}",
    ]
    for size, gbps in b["memcpy_gbps"].items():
        lines.append(
            f"  {size:>7}  {num(gbps, 8)}{num(b['memcpy_threaded_gbps'].get(size), 12)}"
            f"{num(b.get('stream_gbps', {}).get(size), 10)}{num(b.get('stream_threaded_gbps', {}).get(size), 6)}"
            f"{num(b['process_vm_writev_gbps'].get(size), 20)}"
            f"{num(b['process_vm_writev_threaded_gbps'].get(size), 6)}"
        )
    lines.append(
        f"  (x{t}: each copy cut as the copy engine cuts a put, over its {t - 1} threads and the caller,"
        f" >= {b['copy_piece_min'] // MiB} MiB a share; - : one share, as above; streamed: the copy engine's"
        " streaming stores, its way from 4 MiB in one address space)"
    )
    memfd = {k: b.get(f"{k}_memfd_threaded_gbps") or {} for k in ("memcpy", "stream")}
    if any(v for m in memfd.values() for v in m.values()):
        lines.append(
            f"  x{t} between memfd mappings (an allocate()d region's pages, huge ones asked for as it asks;"
            f" shmem_enabled: {b.get('shmem_enabled') or 'unknown'}): "
            + "; ".join(
                f"{'memcpy' if k == 'memcpy' else 'streamed'} " + ", ".join(f"{s} {v:.2f}" for s, v in m.items() if v)
                for k, m in memfd.items()
                if any(m.values())
            )
        )
    for how, v in b["tcp_stream"].items():
        label = f"  tcp stream, 2 processes, {how}" + (f", {fmt_size(v['write_bytes'])} writes:" if v else ":")
        lines.append(
            label.ljust(52)
            + (f"{v['best']:6.2f} GB/s fastest interval, {v['whole']:.2f} whole run" if v else "not measured")
        )
    ip = b.get("iperf3")
    if ip is None:
        lines.append("  iperf3: not installed (apt-get install iperf3 to cross-check the tcp stream)")
    elif "error" in ip:
        lines.append(f"  iperf3: {ip['error']}")
    else:
        line = f"  iperf3 {ip.get('version', '').replace('iperf ', '')} single stream:".ljust(52)
        line += f"{ip['gbps']:6.2f} GB/s whole run"
        if "agrees" in ip:
            line += f"  (the blocking stream beside it / iperf3 = {ip['native_over_iperf3']:.2f}: " + (
                "agree within 20%)" if ip["agrees"] else "differ by more than 20%: the baseline is suspect)"
            )
        lines.append(line)
    for key, how in (("tcp_rtt_us", "blocking"), ("tcp_rtt_spin_us", "polling")):
        v = b.get(key)
        lines.append(
            f"  tcp round trip, {b['tcp_rtt_request_bytes'] // KiB} KiB + 1-byte reply, {how}:".ljust(52)
            + (f"{v['median']:7.1f} us median {v['p99']:8.1f} us p99" if v else "not measured")
        )
    v = b.get("wake_rtt_us")
    lines.append(
        "  eventfd wake-up round trip, 2 processes, blocking:".ljust(52)
        + (f"{v['median']:7.1f} us median {v['p99']:8.1f} us p99 (one way: half)" if v else "not measured")
    )
    v = b.get("wake_rtt_apart_us")
    lines.append(
        "  the same, the 2 pinned to 2 CPUs:".ljust(52)
        + (f"{v['median']:7.1f} us median {v['p99']:8.1f} us p99 (one way: half)" if v else "not measured")
    )
    v = b.get("wake_rtt_one_cpu_us")
    lines.append(
        "  the same, the 2 pinned to 1 CPU:".ljust(52)
        + (f"{v['median']:7.1f} us median {v['p99']:8.1f} us p99 (one way: half)" if v else "not measured")
    )
    v = b.get("asyncio_wake_rtt_us")
    lines.append(
        "  the same through asyncio (add_reader -> future -> task):".ljust(52)
        + (f"{v['median']:7.1f} us median {v['p99']:8.1f} us p99 (one way: half)" if v else "not measured")
    )
    v = b.get("asyncio_wake_rtt_one_cpu_us")
    lines.append(
        "  the same through asyncio, the 2 pinned to 1 CPU:".ljust(52)
        + (f"{v['median']:7.1f} us median {v['p99']:8.1f} us p99 (one way: half)" if v else "not measured")
    )
    for key, why in b.get("errors", {}).items():
        lines.append(f"  {key}: not measured: {why}")
    return lines


def render(r: Results) -> str:
    b = r.baselines
    lines = [
        f"aiohixl {aiohixl.__version__} bench  ({r.machine.get('cpus')} CPUs, Python {r.machine.get('python')})",
        "",
    ]
    lines += render_baselines(b)
    if r.registration:
        lines += _registration(r.registration)
    flagged = 0
    for name, t in r.transports.items():
        lines += ["", f"{name} (path: {t['path']}):"]
        for part in (_latency, _bandwidth):
            more, n = part(t, b)
            lines += more
            flagged += n
        lines += _gather(t) + _tcp_stream(t, b)
        s = t["small_ops"]
        lines.append(
            f"  4 KiB puts/s (best of {ROUNDS} rounds): gather {s['gather_ops_per_s']:,.0f}"
            f"   put_many {s['put_many_ops_per_s']:,.0f}"
        )
        lines += _notify(t, b)
    for name, why in r.skipped.items():
        lines += ["", f"{name}: not measured: {why}"]
    if r.transports:
        lines += [
            "",
            f"physical-limit check: {flagged} result(s) above 1.05x their limit, flagged (!) above"
            if flagged
            else "physical-limit check: no result above 1.05x its physical limit",
        ]
    if r.peers:
        lines += render_peers(r)
    if "idle" in r.machine:
        i = r.machine["idle"]
        lines += [
            "",
            f"idle connected agents (busy_poll_us=0) over {i['seconds']:.0f} s: initiator {i['initiator_pct']:.2f}% "
            f"of a core, target {i['target_pct']:.2f}%",
        ]
    return "\n".join(lines)


def _registration(registration: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "registration (GiB/s; limit: the kernel's bulk populate of the same size, one thread;"
        f" each the best of {REG_ROUNDS} rounds, the stall the worst):",
    ]
    for size, v in registration.items():
        alloc, memfd = v["allocate_gibps"], v["populate_memfd_gibps"]
        reg, anon = v["register_gibps"], v["populate_anon_gibps"]
        lines.append(
            f"  {size:>7}  allocate {alloc:5.2f} ({alloc / memfd:.2f}x memfd populate {memfd:.2f})"
            f"   register {reg:5.2f} ({reg / anon:.2f}x anon populate {anon:.2f})"
        )
        lines.append(
            f"           allocate_async {v['allocate_async_gibps']:5.2f}"
            f" ({v['allocate_async_gibps'] / v['populate_memfd_gibps']:.2f}x), longest event-loop stall"
            f" {v['allocate_async_max_stall_ms']:.1f} ms"
            + (
                f" (the loop's own work in it {v['allocate_async_max_stall_cpu_ms']:.1f} ms,"
                f" waiting for a CPU {v['allocate_async_max_stall_runq_ms']:.1f} ms,"
                f" page faults read from disk {v['allocate_async_max_stall_disk_faults']}"
                + (
                    f", the host's steal on the guest's CPUs {v['allocate_async_max_stall_steal_ms']:.0f} ms"
                    if "allocate_async_max_stall_steal_ms" in v
                    else ""
                )
                + ")"
                if "allocate_async_max_stall_runq_ms" in v
                else ""
            )
        )
        if "first_allocate_stall_ms" in v:
            lines.append(
                "           a fresh process's first allocate_async, 1 ms asyncio.sleep probe beside it:"
                f" longest stall {v['first_allocate_stall_ms']:.1f} ms; the loop's own work in one"
                f" probe at most {v['first_allocate_stall_cpu_ms']:.1f} ms (the rest: waiting for a CPU)"
            )
        if "close_stall_ms" in v:
            lines.append(
                "           the same probe beside await region.close(): longest stall"
                f" {v['close_stall_ms']:.1f} ms (own work {v['close_stall_cpu_ms']:.1f}); beside"
                f" agent.aclose() holding one: {v['aclose_stall_ms']:.1f} ms"
                f" (own work {v['aclose_stall_cpu_ms']:.1f})"
            )
    return lines


def _latency(t: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], int]:
    """A path's latency lines, and how many of them are flagged."""
    lines, flagged = ["  latency            median      p99"], 0
    for key, v in t["latency"].items():
        extra = ""
        if "limit" in v:
            lim = v["limit"]
            extra = f"   ({lim['time_ratio']:.2f}x the time of the {baselines.limit_name(lim['baseline'], b)})"
            if lim["above_limit"]:
                extra += "  (!) faster than the physical round trip: check the baseline"
                flagged += 1
        if key.endswith("(slices per op)"):
            presliced = v.get("presliced_median_us")  # measured alongside (older JSON: the latency line)
            if presliced is None:
                presliced = t["latency"].get(key.replace(" (slices per op)", ""), {}).get("median_us")
            if presliced:
                extra = f"   ({v['median_us'] / presliced:.2f}x the presliced put, {presliced:.1f} us beside it)"
        if "busy_poll_us=" in key:
            default = t["latency"].get(key.split(",")[0])
            if default:
                extra = f"   ({v['median_us'] / default['median_us']:.2f}x the default)"
        lines.append(f"  {key:<14} {v['median_us']:8.1f} us {v['p99_us']:8.1f} us{extra}")
    side = t.get("rtt_beside")
    if side and "error" in side:
        lines.append(f"  the put beside the C round trip: not measured ({side['error']})")
    elif side:
        lines.append(
            f"  put {fmt_size(baselines.RTT_REQUEST)} against the blocking C round trip timed beside it,"
            f" {side['rounds']} alternating rounds (the best median of each):"
            f" {side['put_us']:.1f} us / {side['rtt_us']:.1f} us = {side['ratio']:.2f}x"
        )
    off = t.get("serve_poll_beside")
    if off:
        lines.append(
            f"  put to a target with serve_poll_us=0 (its I/O thread blocks after each request), against the"
            f" default, {off['rounds']} alternating rounds (the median of all {off['ops']} of each): "
            + ", ".join(
                f"{size} {v['off_us']:.1f} us against {v['default_us']:.1f} ({v['off_over_default']:.2f}x)"
                for size, v in off["sizes"].items()
            )
        )
    return lines, flagged


def _bandwidth(t: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], int]:
    """A path's bandwidth table, and how many of its rows are flagged."""
    lines = [
        "  bandwidth (put)    1 in flight    1 at a time over N   N in flight    N/1 over N   vs its physical limit"
    ]
    flagged = 0
    for size, v in t["bandwidth"].items():
        cpu = f"  target CPU {v['target_cpu_pct']:.0f}%" if "target_cpu_pct" in v else ""
        lim = v.get("limit", {})
        if lim.get("gbps"):
            vs = (
                f"{_flag(lim['one_ratio'])} / {_flag(lim['inflight_ratio'])} {baselines.limit_name(lim['baseline'], b)}"
            )
        else:
            vs = "-  (no baseline of its kind here)"
        span = v.get("one_span_gbps")
        over = f"{span:6.2f} GB/s" if span else "     -     "
        ratio = f"{v['inflight_gbps'] / span:5.2f}x" if span else "   -  "
        lines.append(
            f"  {size:>7}        {v['one_gbps']:6.2f} GB/s   {over}   {v['inflight']:>2} x "
            f"{v['inflight_gbps']:6.2f} GB/s  {ratio}     {vs}{cpu}"
        )
        beside = v.get("beside")
        if beside and beside.get("one_gbps"):
            limit = max(beside["memcpy_threaded_gbps"], beside["stream_threaded_gbps"])
            name = "memcpy" if limit == beside["memcpy_threaded_gbps"] else "streamed copy"
            lines.append(
                f"  {'':>7}        1 in flight against its limits timed beside it, {ROUNDS} alternating rounds"
                f" (the fastest of each): {beside['one_gbps']:.2f} GB/s / {name} x{b['copy_threads']}"
                f" {limit:.2f} = {beside['one_gbps'] / limit:.2f}x; the streamed copy x{b['copy_threads']} between"
                f" memfds {beside['stream_memfd_threaded_gbps']:.2f} GB/s"
                f" ({beside['one_gbps'] / beside['stream_memfd_threaded_gbps']:.2f}x)"
            )
        if lim.get("memfd_gbps"):
            lines.append(
                f"  {'':>7}        1 in flight {lim['memfd_one_ratio']:.2f}x the"
                f" {baselines.limit_name(lim['memfd_baseline'], b)} ({lim['memfd_gbps']:.2f} GB/s): the put's own pages"
            )
        if lim.get("above_limit"):
            lines.append(f"  {'':>7}        {FLAG}")
            flagged += 1
    return lines, flagged


def _gather(t: dict[str, Any]) -> list[str]:
    """Where ops end as they are posted: what gather itself leaves possible of N/1 over N."""
    floor = t.get("gather_floor_us")
    if not floor or t.get("path") not in INLINE_PATHS:
        return []
    reach = []
    for size, v in t["bandwidth"].items():
        if v["inflight"] > 1 and v.get("one_span_gbps") and size_of(size) <= MiB:
            serial = v["inflight"] * size_of(size) / (v["one_span_gbps"] * 1e3)  # us
            reach.append(f"{size} {serial / (serial + floor):.2f}x")
    lines = [
        f"  asyncio.gather itself over {t['gather_floor_n']} finished futures: {floor:.1f} us, so N/1 over N"
        f" (ops ending inline) can reach at most {', '.join(reach)}"
    ]
    # The same floor where it runs: after the copies, which leave the interpreter's caches cold.
    beside = [
        f"{size} {v['gather_bound_gbps'] / v['one_span_gbps']:.2f}x"
        f" (N in flight {v['inflight_gbps'] / v['gather_bound_gbps']:.2f}x of it)"
        for size, v in t["bandwidth"].items()
        if v.get("gather_bound_gbps") and v.get("one_span_gbps")
    ]
    if beside:
        lines.append(
            "  the bound timed beside the copies (one at a time, then gather over as many finished ops):"
            f" {', '.join(beside)}"
        )
    turn = [
        f"{size} {v['in_turn_gbps'] / v['one_span_gbps']:.2f}x"
        for size, v in t["bandwidth"].items()
        if v.get("in_turn_gbps") and v.get("one_span_gbps")
    ]
    if turn:
        lines.append(
            f"  N/1 over N with the N posted together, then each awaited in turn (no gather): {', '.join(turn)}"
        )
    return lines


def _tcp_stream(t: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """tcp's N in flight against the blocking stream (iperf3's way; the table's limit is the polling one)."""
    blocking = (b.get("tcp_stream") or {}).get("blocking")
    if t.get("path") != "tcp" or not blocking:
        return []
    vs = ", ".join(
        f"{size} {v['inflight']} x {v['inflight_gbps'] / blocking['best']:.2f}x" for size, v in t["bandwidth"].items()
    )
    lines = [f"  N in flight against the blocking stream ({blocking['best']:.2f} GB/s, iperf3's way): {vs}"]
    streamed = ", ".join(
        f"{size} {v['inflight_gbps'] / v['stream_beside_gbps']:.2f}x ({v['stream_beside_gbps']:.2f} GB/s)"
        for size, v in t["bandwidth"].items()
        if v.get("stream_beside_gbps")
    )
    if streamed:
        lines.append(f"  the same against the blocking stream timed in the same {ROUNDS} rounds: {streamed}")
    spliced = ", ".join(
        f"{size} {v['splice_gbps']:.2f} GB/s ({v['splice_gbps'] / v['inflight_gbps']:.2f}x)"
        for size, v in t["bandwidth"].items()
        if v.get("splice_gbps") and v.get("inflight_gbps")
    )
    if spliced:
        lines.append(f"  N in flight with tcp_send='splice', same rounds (x the default, copy): {spliced}")
    failed = {v["stream_beside_error"] for v in t["bandwidth"].values() if v.get("stream_beside_error")}
    if failed:
        lines.append(f"  the blocking stream in the same rounds: not measured ({'; '.join(sorted(failed))})")
    return lines


def _notify(t: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """A path's notification rows: what the message adds to its put, in native one-way wake-ups,
    and in the interpreter's floor (what any asyncio library pays to wake a task)."""
    lines: list[str] = []
    wake = baselines.one_way_wake_us(b)
    apart = baselines.one_way_wake_us(b, "wake_rtt_apart_us")
    floor = baselines.one_way_asyncio_wake_us(b)
    one = baselines.one_way_wake_us(b, "wake_rtt_one_cpu_us")
    floor_one = baselines.one_way_asyncio_wake_us(b, "asyncio_wake_rtt_one_cpu_us")
    for size, v in t.get("notify", {}).items():
        beyond = v["median_us"] - v["put_median_us"]
        limit = f"; beyond it {beyond / wake:.1f}x the native one-way wake-up {wake:.1f} us" if wake else ""
        if apart:
            limit += f" ({beyond / apart:.2f}x the one on two CPUs, {apart:.1f} us)"
        if floor:
            limit += f", {beyond / floor:.2f}x the asyncio one-way wake-up {floor:.1f} us"
        lines.append(
            f"  put(notify=) {size:>7} -> notification() at the target: median {v['median_us']:8.1f} us"
            f"  (awaited put alone {v['put_median_us']:.1f} us{limit})"
        )
        if one and floor_one:
            # Where the scheduler runs both ends on one CPU a wake-up is a context switch, and
            # the interpreter's own share is all that is left to compare with it.
            lines.append(
                f"    on one CPU: the native one-way wake-up {one:.1f} us, the asyncio one {floor_one:.1f} us"
                f" ({floor_one / one:.1f}x it, with no aiohixl); beyond the put {beyond / one:.1f}x the native one"
            )
        side = v.get("beside")
        if side and "error" in side:
            lines.append(f"    timed beside the asyncio wake-up: not measured ({side['error']})")
        elif side:
            lines.append(
                f"    timed beside, {side['rounds']} alternating rounds (the best of each):"
                f" {side['median_us']:.1f} us, the put alone {side['put_median_us']:.1f} us"
                f" ({side['over_put']:.2f}x), the asyncio one-way wake-up {side['asyncio_wake_us']:.1f} us:"
                f" beyond the put {side['beyond_over_asyncio_wake']:.2f}x it"
                + (
                    f"; the native one-way wake-up {side['native_wake_us']:.1f} us:"
                    f" {side['beyond_over_native_wake']:.2f}x it"
                    if "native_wake_us" in side
                    else ""
                )
                + (
                    f"; on two CPUs {side['native_wake_apart_us']:.1f} us:"
                    f" {side['beyond_over_native_wake_apart']:.2f}x it"
                    if "native_wake_apart_us" in side
                    else ""
                )
            )
        if side and "pinned_one_cpu_us" in side:
            two = (
                f"on two CPUs {side['pinned_two_cpus_us']:.1f} us, beyond the put"
                f" {side['pinned_two_cpus_beyond_over_native_wake']:.2f}x the native one-way wake-up there"
                f" ({side['native_wake_apart_us']:.1f} us); "
                if "pinned_two_cpus_us" in side
                else ""
            )
            lines.append(
                f"    the two loops pinned, same rounds: {two}on one CPU {side['pinned_one_cpu_us']:.1f} us,"
                f" {side['pinned_one_cpu_beyond_over_native_wake']:.2f}x the one there"
                f" ({side['native_wake_one_cpu_us']:.1f} us)"
            )
        off = v.get("poll_off_beside")
        if off:
            lines.append(
                f"    to a target with notify_poll_us=0 (its loop blocks after each), {off['rounds']} rounds"
                f" alternating with the default (medians of {off['ops']} each): {off['off_us']:.1f} us"
                f" against {off['default_us']:.1f} ({off['off_over_default']:.2f}x)"
            )
        awake = v.get("awake_target_beside")
        if awake:
            lines.append(
                f"    to a target whose I/O thread polls through the gaps (serve_poll_us={awake['serve_poll_us']}),"
                f" {awake['rounds']} rounds alternating with the default (medians of {awake['ops']} each):"
                f" {awake['awake_us']:.1f} us against {awake['default_us']:.1f}; its put alone"
                f" {awake['awake_put_us']:.1f} us ({awake['awake_over_put']:.2f}x)"
            )
    return lines
