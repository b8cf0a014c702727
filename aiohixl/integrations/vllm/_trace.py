"""Per-request timings as JSON lines, for examples/vllm_pd/bench.py (``"trace"`` in the extra config).

One file per worker process, ``<prefix>.<engine>-<role>.<pid>.jsonl``; ``t_ns`` is
``time.monotonic_ns()``, one clock for every process of a host.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO


class Trace:
    def __init__(self, prefix: str | None, engine_id: str, role: str) -> None:
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        if prefix:
            self._file = open(f"{prefix}.{engine_id}-{role}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def __bool__(self) -> bool:
        return self._file is not None

    def event(self, event: str, transfer_id: str, req_id: str, nbytes: int = 0) -> None:
        if self._file is None:
            return
        line = json.dumps(
            {"transfer_id": transfer_id, "req_id": req_id, "event": event, "t_ns": time.monotonic_ns(), "bytes": nbytes}
        )
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
