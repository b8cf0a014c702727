"""The command line: info and a bench smoke run, as a user runs them."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

from aiohixl.tools import baselines, bench
from aiohixl.tools.info import TransportStatus, transports


def test_info_reports_transports_and_reasons():
    out = subprocess.run([sys.executable, "-m", "aiohixl", "info"], capture_output=True, text=True, check=True).stdout
    assert "aiohixl 0.1.0" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert " yes " in lines["tcp"] and " yes " in lines["loopback"]
    devices = os.listdir("/sys/class/infiniband") if os.path.isdir("/sys/class/infiniband") else []
    verbs = lines["verbs"]
    unbuilt = ("rdma-core headers", "libibverbs not installed")  # nothing to ask a device with
    if " yes " in verbs:  # the device, port and GID it would use
        assert re.search(r" yes +(\S+) port \d+ GID\[\d+\] ", verbs) and verbs.split()[2] in devices, verbs
    elif devices:  # why none of them is used
        assert " no " in verbs and any(why in verbs for why in (*unbuilt, "no ACTIVE port")), verbs
    else:
        assert " no " in verbs and any(why in verbs for why in (*unbuilt, "no RDMA device")), verbs


def test_bench_refuses_unknown_transports_before_running_anything():
    proc = subprocess.run(
        [sys.executable, "-m", "aiohixl", "bench", "--quick", "--transports", "foo,tcp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "unknown 'foo': choose from loopback, shm, shm-cma, tcp, verbs" in proc.stderr, proc.stderr


def test_bench_plot_without_matplotlib_is_refused_before_running_anything(tmp_path):
    hide = "import sys; sys.modules['matplotlib'] = None"  # this interpreter has no matplotlib
    run = "from aiohixl.__main__ import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", f"{hide}; {run}", "bench", "--quick", "--transports", "loopback"]
        + ["--plot", str(tmp_path / "bench.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""  # no bench ran: it would print its tables
    assert "--plot needs matplotlib: pip install 'aiohixl[plot]'" in proc.stderr, proc.stderr


def _verbs() -> TransportStatus:
    return next(t for t in transports() if t.name == "verbs")


def test_bench_quick_writes_json(tmp_path):
    path, png = tmp_path / "bench.json", tmp_path / "bench.png"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    verbs = _verbs()
    names = "loopback,tcp" if verbs.available else "loopback,tcp,verbs"  # verbs: skipped, saying why
    proc = subprocess.run(
        [sys.executable, "-m", "aiohixl", "bench", "--quick", "--transports", names, "--json", str(path)]
        + (["--plot", str(png)] if has_matplotlib else []),
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: the quick bench takes 20-60 s, minutes on a busy machine
    )
    assert proc.returncode == 0, proc.stderr
    assert png.exists() == has_matplotlib
    data = json.loads(path.read_text())
    assert set(data["transports"]) == {"loopback", "tcp"}
    assert {name: t["path"] for name, t in data["transports"].items()} == {"loopback": "loopback", "tcp": "tcp"}
    if not verbs.available:  # not tcp's figures under "verbs (path: tcp)"
        assert data["skipped"] == {"verbs": verbs.detail}
        assert f"verbs: not measured: {verbs.detail}" in proc.stdout and "verbs (path" not in proc.stdout
    assert "vs its physical limit" in proc.stdout and "physical-limit check" in proc.stdout
    (reg,) = data["registration"].values()  # --quick: one size
    assert {"first_allocate_stall_ms", "close_stall_ms", "aclose_stall_ms"} <= set(reg)
    assert 0 <= reg["allocate_async_max_stall_cpu_ms"] <= reg["allocate_async_max_stall_ms"] + 1.0  # own work in it
    assert 0 <= reg["allocate_async_max_stall_runq_ms"] <= reg["allocate_async_max_stall_ms"] + 1.0  # runnable
    assert reg["allocate_async_max_stall_disk_faults"] >= 0
    assert reg["allocate_async_max_stall_steal_ms"] >= 0  # the host's, on the guest's CPUs
    assert "ms, waiting for a CPU" in proc.stdout and "page faults read from disk" in proc.stdout
    assert "the host's steal on the guest's CPUs" in proc.stdout
    assert "the loop's own work in it" in proc.stdout
    assert "beside await region.close()" in proc.stdout

    # Every native baseline is there and positive. Nothing is asserted about
    # their relative sizes: the machine running the tests is busy.
    b = data["baselines"]
    assert b["native"] is True and b["copy_threads"] >= 2
    assert len(b["passes"]) == 2  # before and after the transports; the limits are the better of the two
    sizes = {"64 KiB", "1 MiB", "16 MiB"}
    assert set(b["memcpy_gbps"]) == sizes and all(v > 0 for v in b["memcpy_gbps"].values())
    assert set(b["memcpy_threaded_gbps"]) == {"16 MiB"} and b["memcpy_threaded_gbps"]["16 MiB"] > 0
    # The copy engine streams from 4 MiB: so is its limit timed, single and threaded.
    assert set(b["stream_gbps"]) == set(b["stream_threaded_gbps"]) == {"16 MiB"}
    assert b["stream_gbps"]["16 MiB"] > 0 and b["stream_threaded_gbps"]["16 MiB"] > 0
    # ... and between memfd mappings, the pages a put between allocated regions copies.
    for kind in ("memcpy", "stream"):
        assert set(b[f"{kind}_memfd_threaded_gbps"]) == {"16 MiB"} and b[f"{kind}_memfd_threaded_gbps"]["16 MiB"] > 0
    assert "between memfd mappings" in proc.stdout
    assert b["shmem_enabled"] in ("always", "within_size", "advise", "never", "deny", "force", None)
    assert set(b["process_vm_writev_gbps"]) == sizes
    if "process_vm_writev 64 KiB" in b["errors"]:  # ptrace refused here: said, not measured
        assert b["process_vm_writev_gbps"]["64 KiB"] is None
    else:
        assert all(v > 0 for v in b["process_vm_writev_gbps"].values())
        assert b["process_vm_writev_threaded_gbps"]["16 MiB"] > 0
    assert 0 < b["tcp_stream_gbps"] < 1000
    for how in ("blocking", "polling"):
        assert b["tcp_stream"][how]["whole"] > 0 and 0 < b["tcp_stream"][how]["best"] <= b["tcp_stream_gbps"]
    for key in baselines.RTT_KEYS:
        rtt = b[key]
        assert 0 < rtt["median"] <= rtt["p99"] and rtt["ops"] >= 100
    assert "eventfd wake-up round trip" in proc.stdout and "one-way wake-up" in proc.stdout  # beside the notifications
    assert "the same through asyncio" in proc.stdout and "the asyncio one-way wake-up" in proc.stdout
    note = data["transports"]["tcp"]["notify"]["4 KiB"]
    assert note["beyond_over_wake"] is not None and note["beyond_over_asyncio_wake"] is not None
    assert note["beyond_over_wake_apart"] == note["beyond_put_us"] / (b["wake_rtt_apart_us"]["median"] / 2)
    assert "the same, the 2 pinned to 2 CPUs:" in proc.stdout and "the one on two CPUs" in proc.stdout
    assert note["beyond_over_wake_one_cpu"] == note["beyond_put_us"] / (b["wake_rtt_one_cpu_us"]["median"] / 2)
    assert "the same through asyncio, the 2 pinned to 1 CPU:" in proc.stdout
    assert "on one CPU: the native one-way wake-up" in proc.stdout
    # Rows whose ratio is to a limit are also timed beside it, in alternating rounds.
    for name in ("loopback", "tcp"):
        side = data["transports"][name]["notify"]["4 KiB"]["beside"]
        assert side["rounds"] >= 2 and side["put_median_us"] > 0 and side["asyncio_wake_us"] > 0
        # Loopback's message is delivered after its put; a tcp one goes one way while its put
        # is a round trip, and may come first (the ASan build's slow C: 155 against 213 us).
        assert side["put_median_us"] < side["median_us"] if name == "loopback" else side["median_us"] > 0
        assert side["over_put"] == side["median_us"] / side["put_median_us"]
        if name == "tcp":  # a target process: also timed with the two loops pinned
            assert side["pinned_one_cpu_us"] > 0 and side["native_wake_one_cpu_us"] > 0
            assert "the two loops pinned, same rounds:" in proc.stdout
        assert side["native_wake_apart_us"] > 0 and "on two CPUs" in proc.stdout
    side = data["transports"]["tcp"]["rtt_beside"]
    assert side["rtt_us"] > 0 and side["ratio"] == side["put_us"] / side["rtt_us"]
    assert "against the blocking C round trip timed beside it" in proc.stdout and "timed beside, " in proc.stdout
    off = data["transports"]["tcp"]["serve_poll_beside"]
    assert set(off["sizes"]) == {"4 KiB", "64 KiB"} and off["rounds"] >= 2 and off["ops"] > 0
    for v in off["sizes"].values():
        assert v["default_us"] > 0 and v["off_over_default"] == v["off_us"] / v["default_us"]
    assert "put to a target with serve_poll_us=0" in proc.stdout
    off = data["transports"]["tcp"]["notify"]["4 KiB"]["poll_off_beside"]
    assert off["rounds"] >= 2 and off["ops"] > 0 and off["default_us"] > 0
    assert off["off_over_default"] == off["off_us"] / off["default_us"]
    assert "to a target with notify_poll_us=0" in proc.stdout
    assert "poll_off_beside" not in data["transports"]["loopback"]["notify"]["4 KiB"]  # its own loop: no target
    awake = data["transports"]["tcp"]["notify"]["4 KiB"]["awake_target_beside"]
    assert awake["rounds"] >= 2 and awake["ops"] > 0 and awake["default_us"] > 0
    assert awake["awake_over_put"] == awake["awake_us"] / awake["awake_put_us"]
    assert "to a target whose I/O thread polls through the gaps" in proc.stdout
    assert all(row["stream_beside_gbps"] > 0 for row in data["transports"]["tcp"]["bandwidth"].values())
    assert "against the blocking stream timed in the same" in proc.stdout
    # A stream that could not be timed beside the puts is said, not left out.
    for row in data["transports"]["tcp"]["bandwidth"].values():
        row.update(stream_beside_gbps=None, stream_beside_error="[Errno 111] Connection refused")
    text = bench.render(bench.Results(**{k: data[k] for k in ("machine", "baselines", "transports")}))
    assert "the blocking stream in the same rounds: not measured ([Errno 111] Connection refused)" in text
    assert "against the blocking stream timed in the same" not in text
    if shutil.which("iperf3"):
        assert b["iperf3"]["gbps"] > 0 and isinstance(b["iperf3"]["agrees"], bool)
        assert "iperf3" in proc.stdout
    else:
        assert b["iperf3"] is None

    # Every ratio carries its physical limit and the flag.
    for name, t in data["transports"].items():
        for size, row in t["bandwidth"].items():
            assert isinstance(row["limit"]["above_limit"], bool)
            if name in ("loopback", "shm") and size == "16 MiB":  # and the put's own pages' copy
                assert row["limit"]["memfd_one_ratio"] > 0
                # ... and the put and its limits timed in the same rounds.
                assert all(v > 0 for v in row["beside"].values()) and "timed beside it" in proc.stdout
            if name == "tcp":
                assert row["limit"]["baseline"] == "tcp_stream_gbps"
            elif size == "16 MiB":  # shared by the copy threads: the faster of threaded and single
                assert row["limit"]["baseline"] in (
                    "memcpy_threaded_gbps",
                    "memcpy_gbps",
                    "stream_gbps",
                    "stream_threaded_gbps",
                )
            else:
                assert row["limit"]["baseline"] == "memcpy_gbps"
    assert isinstance(data["transports"]["tcp"]["latency"]["put 4 KiB"]["limit"]["above_limit"], bool)
    assert isinstance(data["machine"]["above_physical_limit"], int)


def test_store_errors_name_the_command_once_and_its_own_options():
    env = {k: v for k, v in os.environ.items() if k != "AIOHIXL_TOKEN"}

    def store(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "aiohixl", "store", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

    proc = store("--listen", "127.0.0.1:0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "aiohixl store: a shared token is required (--token or AIOHIXL_TOKEN)"
    proc = store("--listen", "nowhere", "--token", "t")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "aiohixl store --listen: address 'nowhere' is not 'host:port'"
