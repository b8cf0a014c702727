"""The bench's baselines: physical limits measured natively, in the same run.

The timing loops are C (``aiohixl.tools._baselines``, built from
``_native/bench/``), so what is measured is the machine, not the Python that
drives it:

- ``memcpy``: one thread, per size, between warm buffers that are 2 MiB-aligned
  with transparent huge pages asked for (the best case a page table gives a
  copy; numpy's large arrays get them too).
- ``memcpy`` threaded: each copy cut as aiohixl's copy engine cuts a large op
  (one share for each of its threads and the calling thread, at least 1 MiB
  a share), the threads meeting after every copy, as a put completes when its
  last piece does. The honest limit of a threaded put.
- streamed copy: the same two for sizes the copy engine streams (at least
  ``STREAM_MIN``), with its streaming stores (``_native/core/stream.c``)
  instead of glibc's memcpy, which streams only a single call above its own
  threshold (48 MiB on the development VM). A same-address-space put of that
  size is held to the fastest of the four.
- ``process_vm_writev``: the same two, into a buffer of another process (the
  limit of the cross-memory-attach path, ``shm-cma``).
- tcp stream: one connection over 127.0.0.1 between two processes, the
  kernel's default socket buffers; once blocking in send and recv with 128 KiB
  writes and reads (iperf3's way), once polling on both ends with 1 MiB
  writes (aiohixl's tcp I/O threads poll while active and send 1 MiB
  chunks). The receiver times intervals of 50-200 ms; the limit is the
  fastest interval after the first, of either. With ``iperf3`` installed it
  runs too, and its whole run is compared with the blocking stream's.
- tcp round trip: 4 KiB out, 1 byte back, TCP_NODELAY, between two processes;
  once blocking in recv and once polling on both ends (as aiohixl's tcp I/O
  threads poll while active). The faster of the two is the limit.
- wake-up round trip: two processes, each blocked in read() on an eventfd
  until the other writes it; half of one is the native one-way wake-up, the
  least a notification to a blocked target costs beyond its put. Timed as
  the scheduler places the two (it may run both on one CPU: a wake-up is
  then a context switch), pinned to two CPUs (each wake-up is of a
  thread on another CPU, halted if idle) and pinned to one.
- asyncio wake-up round trip: the same, with an asyncio loop in each process
  (``wake_floor``: add_reader -> future -> the awaiting task resumes), no
  aiohixl in it; half of one is the interpreter's floor under a notification
  that wakes a task awaiting ``notification()``. Timed as the scheduler
  places the two and pinned to one CPU.

Copy rates are GB/s (1e9 bytes/s) over batches of whole copies (at least
1 ms, at least five of them), the clock read only between batches. The
figure a result is divided by is the fastest batch, the limit the machine
showed; the median batch is kept beside it ("medians"). The bench measures
every baseline twice, before and after aiohixl's transports, and divides by
the better pass (``combine``).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

KiB, MiB = 1 << 10, 1 << 20

# How aiohixl's copy engine cuts a copy (_native/copy.c, hx_copy_post): one
# share for each of Agent(copy_threads=None)'s threads (min(4, CPUs)) and the
# calling thread, at least HX_COPY_PIECE_MIN (_native/internal.h) a share.
COPY_THREADS = min(4, os.cpu_count() or 1) + 1
COPY_PIECE_MIN = 1 * MiB
STREAM_MIN = 4 * MiB  # HX_STREAM_MIN, _native/core/stream.h
STREAM_WRITE = 128 * KiB  # iperf3's default
STREAM_WRITE_POLLING = 1 * MiB  # HX_TCP_CHUNK, _native/tcp.c
RTT_REQUEST = 4 * KiB
# A result faster than a physical limit of its kind by more than this is
# flagged: the baseline, not aiohixl, is what is likely wrong.
FLAG_ABOVE = 1.05
IPERF3_TOLERANCE = 0.20


def _native() -> Any:
    try:
        return importlib.import_module("aiohixl.tools._baselines")
    except ImportError as exc:  # an install from before the module existed
        raise SystemExit(
            f"the bench's native baselines are not built ({exc}): reinstall aiohixl (pip install -e .)"
        ) from exc


def pieces(size: int, threads: int = COPY_THREADS) -> int:
    """How many threads share a copy of `size` bytes in aiohixl's copy engine."""
    piece = max(size // max(threads, 1) + 1, COPY_PIECE_MIN)
    piece = (piece + 4095) & ~4095
    return -(-size // piece)


def _error(res: Any, ffi: Any, what: str) -> str:
    where = ffi.string(res.where).decode() if res.where != ffi.NULL else "?"
    return f"{what}: {where}: {os.strerror(res.err) if res.err else 'failed'}"


def shmem_thp() -> str | None:
    """The kernel's huge-page policy for shmem (memfds): its chosen word, None where unreadable."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            words = f.read().split()
    except OSError:
        return None
    return next((w.strip("[]") for w in words if w.startswith("[")), None)


def copy_gbps(kind: str, size: int, threads: int, seconds: float, memfd: bool = False) -> tuple[float, float]:
    """(fastest, median) batch rate. kind: "memcpy", "stream" (the copy engine's
    streaming copy) or "process_vm_writev"; threads=1 copies on one thread. memfd: between
    memfd mappings (an allocated region's pages), not anonymous memory with huge pages."""
    m = _native()
    res = m.ffi.new("hb_copy_result *")
    if kind == "process_vm_writev":
        rc = m.lib.hb_process_vm_writev(size, threads, COPY_PIECE_MIN, seconds, res)
    else:
        rc = m.lib.hb_memcpy(size, threads, COPY_PIECE_MIN, int(kind == "stream"), int(memfd), seconds, res)
    if rc != 0:
        raise OSError(res.err, _error(res, m.ffi, kind))
    return res.best_gbps, res.gbps


def tcp_stream(seconds: float, spin: bool = False, write_size: int = STREAM_WRITE) -> dict[str, float]:
    """whole: the run, as iperf3 counts it; best and median: the receiver's
    intervals after the first."""
    m = _native()
    res = m.ffi.new("hb_stream_result *")
    if m.lib.hb_tcp_stream(write_size, int(spin), seconds, res) != 0:
        raise OSError(res.err, _error(res, m.ffi, "tcp stream"))
    if res.intervals < 1:  # too short to cut: the whole run is all there is
        return {"whole": res.gbps, "best": res.gbps, "median": res.gbps}
    return {"whole": res.gbps, "best": res.best_gbps, "median": res.median_gbps}


def tcp_rtt_us(seconds: float, spin: bool, request: int = RTT_REQUEST) -> dict[str, float]:
    m = _native()
    res = m.ffi.new("hb_rtt_result *")
    if m.lib.hb_tcp_rtt(request, int(spin), seconds, res) != 0:
        raise OSError(res.err, _error(res, m.ffi, "tcp round trip"))
    return {"median": res.median_us, "p99": res.p99_us, "mean": res.mean_us, "ops": res.ops}


_PLACED = {None: "", 1: " on one CPU", 2: " on two CPUs"}


def wake_rtt_us(seconds: float, cpus: int | None = None) -> dict[str, float]:
    """An eventfd wake-up round trip between two blocked processes; one way is half of it.
    ``cpus``: 2 pins the two to two CPUs, so that each wake-up is of a thread on another CPU;
    1 pins both to one, so that each is a context switch; None leaves them to the scheduler,
    which may do either."""
    m = _native()
    res = m.ffi.new("hb_rtt_result *")
    if m.lib.hb_wake_rtt(seconds, cpus or 0, res) != 0:
        raise OSError(res.err, _error(res, m.ffi, "wake-up round trip" + _PLACED[cpus]))
    return {"median": res.median_us, "p99": res.p99_us, "mean": res.mean_us, "ops": res.ops}


def asyncio_wake_rtt_us(seconds: float, one_cpu: bool = False) -> dict[str, float]:
    """The same round trip through asyncio in each process (``wake_floor``: add_reader ->
    future -> the awaiting task resumes), in a fresh interpreter that imports nothing of
    aiohixl. One way is half: the interpreter's floor under a notification. ``one_cpu``: both
    processes pinned to the first CPU this one may run on."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wake_floor.py")
    cpu = [str(min(os.sched_getaffinity(0)))] if one_cpu else []
    out = subprocess.run(
        [sys.executable, script, str(seconds), *cpu], capture_output=True, text=True, timeout=60 + 4 * seconds
    )
    if out.returncode != 0:
        raise OSError(f"asyncio wake-up round trip: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout)


def one_way_asyncio_wake_us(b: dict[str, Any], key: str = "asyncio_wake_rtt_us") -> float | None:
    """Half the median asyncio wake-up round trip: the interpreter's floor under a notification
    (``asyncio_wake_rtt_one_cpu_us``: the same with the two processes on one CPU)."""
    rtt = b.get(key)
    return rtt["median"] / 2 if rtt else None


def one_way_wake_us(b: dict[str, Any], key: str = "wake_rtt_us") -> float | None:
    """Half the median wake-up round trip: the notification rows' limit (``wake_rtt_apart_us``,
    ``wake_rtt_one_cpu_us``: the same with the two processes on two CPUs, on one)."""
    rtt = b.get(key)
    return rtt["median"] / 2 if rtt else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iperf3(seconds: int = 1) -> dict[str, Any] | None:
    """iperf3's single stream over loopback, or None when it is not installed."""
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    port = _free_port()
    server = subprocess.Popen([exe, "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        data: dict[str, Any] = {}
        deadline = time.monotonic() + 5
        while True:  # until the server listens: a refused connect leaves it waiting
            proc = subprocess.run(
                [exe, "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-J"],
                capture_output=True,
                text=True,
                timeout=seconds + 30,
            )
            try:
                data = json.loads(proc.stdout)
            except ValueError:
                data = {"error": (proc.stderr or proc.stdout or "no output").strip()[:200]}
            if "error" not in data or "connect" not in data["error"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if "error" in data:
            return {"error": f"iperf3: {data['error']}"}
        return {
            "gbps": data["end"]["sum_received"]["bits_per_second"] / 8e9,
            "version": data.get("start", {}).get("version", ""),
        }
    except (OSError, subprocess.TimeoutExpired, KeyError) as exc:
        return {"error": f"iperf3: {type(exc).__name__}: {exc}"}
    finally:
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def measure(
    sizes: list[int],
    fmt: Callable[[int], str],
    copy_seconds: float,
    stream_seconds: float,
    rtt_seconds: float,
    step: Callable[[str], None] = lambda label: None,
    with_iperf3: bool = True,
) -> dict[str, Any]:
    """One pass over every baseline. A measurement that fails here
    (process_vm_writev where ptrace is refused) is None, with the reason under
    "errors"."""
    out: dict[str, Any] = {
        "native": True,
        "copy_threads": COPY_THREADS,
        "copy_piece_min": COPY_PIECE_MIN,
        "memcpy_gbps": {},
        "memcpy_threaded_gbps": {},
        "stream_gbps": {},
        "stream_threaded_gbps": {},
        "memcpy_memfd_threaded_gbps": {},
        "stream_memfd_threaded_gbps": {},
        "shmem_enabled": shmem_thp(),
        "process_vm_writev_gbps": {},
        "process_vm_writev_threaded_gbps": {},
        "medians": {},
        "errors": {},
    }

    def attempt(key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except OSError as exc:
            out["errors"][key] = str(exc.strerror or exc)
            return None

    def copies(key: str, label: str, what: str, fn: Callable[[], tuple[float, float]]) -> None:
        got = attempt(what, fn)
        out[key][label] = got[0] if got else None
        out["medians"].setdefault(key, {})[label] = got[1] if got else None

    for kind in ("memcpy", "stream", "process_vm_writev"):
        for size in sizes:
            if kind == "stream" and size < STREAM_MIN:
                continue  # the copy engine uses memcpy there
            label = fmt(size)
            copies(f"{kind}_gbps", label, f"{kind} {label}", functools.partial(copy_gbps, kind, size, 1, copy_seconds))
            # Sizes the engine copies on one thread have no threaded figure.
            if pieces(size) > 1:
                copies(
                    f"{kind}_threaded_gbps",
                    label,
                    f"{kind} threaded {label}",
                    functools.partial(copy_gbps, kind, size, COPY_THREADS, copy_seconds),
                )
                if kind != "process_vm_writev" and size >= STREAM_MIN:
                    # The put's own pages (memfd): what the limit's memory is worth.
                    copies(
                        f"{kind}_memfd_threaded_gbps",
                        label,
                        f"{kind} memfd threaded {label}",
                        functools.partial(copy_gbps, kind, size, COPY_THREADS, copy_seconds, True),
                    )
            step(f"{kind} {label}")
    # iperf3 right after the blocking stream it is compared with: a busy
    # machine drifts.
    blocking = attempt("tcp stream", lambda: tcp_stream(stream_seconds))
    out["iperf3"] = iperf3(max(1, round(stream_seconds))) if with_iperf3 else None
    if out["iperf3"] is not None and "gbps" in out["iperf3"] and blocking:
        ratio = blocking["whole"] / out["iperf3"]["gbps"]  # a whole run against a whole run, both blocking
        out["iperf3"]["native_over_iperf3"] = ratio
        out["iperf3"]["agrees"] = abs(ratio - 1) <= IPERF3_TOLERANCE
    if with_iperf3:
        step("iperf3")
    polling = attempt("tcp stream (polling)", lambda: tcp_stream(stream_seconds, True, STREAM_WRITE_POLLING))
    out["tcp_stream"] = {
        "blocking": blocking and {**blocking, "write_bytes": STREAM_WRITE},
        "polling": polling and {**polling, "write_bytes": STREAM_WRITE_POLLING},
    }
    # The limit: the fastest interval of either.
    out["tcp_stream_gbps"] = max((s["best"] for s in (blocking, polling) if s), default=None)
    step("tcp stream")
    out["tcp_rtt_request_bytes"] = RTT_REQUEST
    out["tcp_rtt_us"] = attempt("tcp round trip", lambda: tcp_rtt_us(rtt_seconds, spin=False))
    out["tcp_rtt_spin_us"] = attempt("tcp round trip (polling)", lambda: tcp_rtt_us(rtt_seconds, spin=True))
    step("tcp round trip")
    out["wake_rtt_us"] = attempt("wake-up round trip", lambda: wake_rtt_us(rtt_seconds))
    out["wake_rtt_apart_us"] = attempt("wake-up round trip on two CPUs", lambda: wake_rtt_us(rtt_seconds, cpus=2))
    out["wake_rtt_one_cpu_us"] = attempt("wake-up round trip on one CPU", lambda: wake_rtt_us(rtt_seconds, cpus=1))
    out["asyncio_wake_rtt_us"] = attempt("asyncio wake-up round trip", lambda: asyncio_wake_rtt_us(rtt_seconds))
    out["asyncio_wake_rtt_one_cpu_us"] = attempt(
        "asyncio wake-up round trip on one CPU", lambda: asyncio_wake_rtt_us(rtt_seconds, one_cpu=True)
    )
    step("wake-up round trip")
    return out


RTT_KEYS = (
    "tcp_rtt_us",
    "tcp_rtt_spin_us",
    "wake_rtt_us",
    "wake_rtt_apart_us",
    "wake_rtt_one_cpu_us",
    "asyncio_wake_rtt_us",
    "asyncio_wake_rtt_one_cpu_us",
)
COPY_KEYS = (
    "memcpy_gbps",
    "memcpy_threaded_gbps",
    "stream_gbps",
    "stream_threaded_gbps",
    "memcpy_memfd_threaded_gbps",
    "stream_memfd_threaded_gbps",
    "process_vm_writev_gbps",
    "process_vm_writev_threaded_gbps",
)


def combine(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The baselines from passes before and after the transports: each limit is
    the best any pass showed (a shared machine is slow by moments, and a limit
    caught in a slow moment would flag results measured in a fast one). The
    passes themselves are kept under "passes"; iperf3 is the first pass's,
    compared with the blocking stream run beside it."""
    first = passes[0]
    out: dict[str, Any] = {
        k: first.get(k)
        for k in ("native", "copy_threads", "copy_piece_min", "tcp_rtt_request_bytes", "iperf3", "shmem_enabled")
    }
    for key in COPY_KEYS:
        labels = dict.fromkeys(label for p in passes for label in p[key])
        out[key] = {label: max((p[key].get(label) or 0 for p in passes), default=0) or None for label in labels}
    out["tcp_stream"] = {
        how: max((p["tcp_stream"][how] for p in passes if p["tcp_stream"][how]), key=lambda v: v["best"], default=None)
        for how in ("blocking", "polling")
    }
    out["tcp_stream_gbps"] = max((p["tcp_stream_gbps"] for p in passes if p["tcp_stream_gbps"]), default=None)
    for key in RTT_KEYS:
        out[key] = min((p[key] for p in passes if p.get(key)), key=lambda v: v["median"], default=None)
    out["errors"] = {k: v for p in passes for k, v in p["errors"].items()}
    out["passes"] = passes
    return out


# ---------- which limit a result is divided by ----------


def copy_limit(b: dict[str, Any], path: str, size_label: str, size: int) -> tuple[str, float | None] | None:
    """(baseline key, GB/s) for a put of `size` over `path`, or None when no
    physical baseline here is of its kind (verbs)."""
    if path in ("loopback", "shm-memfd", "shm"):
        kind = "memcpy"
    elif path == "shm-cma":
        kind = "process_vm_writev"
    elif path == "tcp":
        return "tcp_stream_gbps", b.get("tcp_stream_gbps")
    else:
        return None
    # The copy engine streams large copies in one address space: the limit is
    # the faster of memcpy and that streamed copy (absent below STREAM_MIN).
    kinds = (kind, "stream") if kind == "memcpy" else (kind,)
    shared = pieces(size, b.get("copy_threads", COPY_THREADS)) > 1
    # Shared by the threads: the threaded copy, unless one thread did better
    # in this run (a busy machine): the limit is the faster way.
    keys = [f"{k}{suffix}_gbps" for k in kinds for suffix in ("", "_threaded") if suffix == "" or shared]
    found = [(key, b.get(key, {}).get(size_label)) for key in keys]
    return max(found, key=lambda kv: kv[1] or 0)


def rtt_limit_us(b: dict[str, Any]) -> tuple[str, float] | None:
    """The faster tcp round trip (blocking or polling): (key, median us)."""
    found = [(k, b[k]["median"]) for k in ("tcp_rtt_us", "tcp_rtt_spin_us") if b.get(k)]
    return min(found, key=lambda kv: kv[1]) if found else None


LIMIT_NAMES = {
    "memcpy_gbps": "memcpy",
    "memcpy_threaded_gbps": "memcpy x{t}",
    "stream_gbps": "streamed copy",
    "stream_threaded_gbps": "streamed copy x{t}",
    "memcpy_memfd_threaded_gbps": "memcpy x{t} between memfds",
    "stream_memfd_threaded_gbps": "streamed copy x{t} between memfds",
    "process_vm_writev_gbps": "process_vm_writev",
    "process_vm_writev_threaded_gbps": "process_vm_writev x{t}",
    "tcp_stream_gbps": "tcp stream",
    "tcp_rtt_us": "C round trip",
    "tcp_rtt_spin_us": "C round trip (polling)",
}


def limit_name(key: str, b: dict[str, Any]) -> str:
    return LIMIT_NAMES[key].format(t=b.get("copy_threads", COPY_THREADS))
