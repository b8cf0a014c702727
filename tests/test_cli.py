"""The command line: info and a bench smoke run, as a user runs them."""

import json
import os
import subprocess
import sys


def test_info_reports_transports_and_reasons():
    out = subprocess.run([sys.executable, "-m", "aiohixl", "info"], capture_output=True, text=True, check=True).stdout
    assert "aiohixl 0.1.0" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert " yes " in lines["tcp"] and " yes " in lines["loopback"]
    if os.listdir("/sys/class/infiniband") if os.path.isdir("/sys/class/infiniband") else []:
        assert " yes " in lines["verbs"] or "port" in lines["verbs"]  # a device: used, or why its port isn't
    else:
        assert " no " in lines["verbs"] and ("libibverbs" in lines["verbs"] or "device" in lines["verbs"])


def test_bench_quick_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "aiohixl", "bench", "--quick", "--transports", "loopback,tcp", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(path.read_text())
    assert set(data["transports"]) == {"loopback", "tcp"}
    assert data["baselines"]["raw_socket_gbps"] > 0
    assert "vs raw tcp" in proc.stdout and "vs memcpy" in proc.stdout
