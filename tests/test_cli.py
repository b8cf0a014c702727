"""The command line: info and a bench smoke run, as a user runs them."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys


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


def test_bench_quick_writes_json(tmp_path):
    path, png = tmp_path / "bench.json", tmp_path / "bench.png"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    proc = subprocess.run(
        [sys.executable, "-m", "aiohixl", "bench", "--quick", "--transports", "loopback,tcp", "--json", str(path)]
        + (["--plot", str(png)] if has_matplotlib else []),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.exists() == has_matplotlib
    data = json.loads(path.read_text())
    assert set(data["transports"]) == {"loopback", "tcp"}
    assert "vs its physical limit" in proc.stdout and "physical-limit check" in proc.stdout

    # Every native baseline is there and positive. Nothing is asserted about
    # their relative sizes: the machine running the tests is busy.
    b = data["baselines"]
    assert b["native"] is True and b["copy_threads"] >= 2
    assert len(b["passes"]) == 2  # before and after the transports; the limits are the better of the two
    sizes = {"64 KiB", "1 MiB", "16 MiB"}
    assert set(b["memcpy_gbps"]) == sizes and all(v > 0 for v in b["memcpy_gbps"].values())
    assert set(b["memcpy_threaded_gbps"]) == {"16 MiB"} and b["memcpy_threaded_gbps"]["16 MiB"] > 0
    assert set(b["process_vm_writev_gbps"]) == sizes
    if "process_vm_writev 64 KiB" in b["errors"]:  # ptrace refused here: said, not measured
        assert b["process_vm_writev_gbps"]["64 KiB"] is None
    else:
        assert all(v > 0 for v in b["process_vm_writev_gbps"].values())
        assert b["process_vm_writev_threaded_gbps"]["16 MiB"] > 0
    assert 0 < b["tcp_stream_gbps"] < 1000
    for how in ("blocking", "polling"):
        assert b["tcp_stream"][how]["whole"] > 0 and 0 < b["tcp_stream"][how]["best"] <= b["tcp_stream_gbps"]
    for key in ("tcp_rtt_us", "tcp_rtt_spin_us"):
        rtt = b[key]
        assert 0 < rtt["median"] <= rtt["p99"] and rtt["ops"] >= 100
    if shutil.which("iperf3"):
        assert b["iperf3"]["gbps"] > 0 and isinstance(b["iperf3"]["agrees"], bool)
        assert "iperf3" in proc.stdout
    else:
        assert b["iperf3"] is None

    # Every ratio carries its physical limit and the flag.
    for name, t in data["transports"].items():
        for size, row in t["bandwidth"].items():
            assert isinstance(row["limit"]["above_limit"], bool)
            if name == "tcp":
                assert row["limit"]["baseline"] == "tcp_stream_gbps"
            elif size == "16 MiB":  # shared by the copy threads: the faster of threaded and single
                assert row["limit"]["baseline"] in ("memcpy_threaded_gbps", "memcpy_gbps")
            else:
                assert row["limit"]["baseline"] == "memcpy_gbps"
    assert isinstance(data["transports"]["tcp"]["latency"]["put 4 KiB"]["limit"]["above_limit"], bool)
    assert isinstance(data["machine"]["above_physical_limit"], int)
