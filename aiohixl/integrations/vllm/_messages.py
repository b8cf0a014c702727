"""The notifications the decode and prefill workers exchange (JSON; peers' data is never unpickled).

D -> P: REG (a transfer's destination blocks), SKIP (decode holds the whole prompt: nothing
to push), CANCEL (stop writing this transfer). P -> D: CLAIM (this prefill worker will serve
the transfer), DONE (every byte is in place: the notification is ordered after the puts),
FAIL / ABORT (nothing more will come: the reason says why), CANCELLED (the answer to CANCEL:
no put of that transfer is in flight or will be posted).
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = b"aiohixl-vllm1:"
OPS = ("REG", "SKIP", "CANCEL", "CLAIM", "DONE", "FAIL", "ABORT", "CANCELLED")


def encode(op: str, transfer_id: str, **fields: Any) -> bytes:
    assert op in OPS
    return PREFIX + json.dumps({"op": op, "t": transfer_id, **fields}, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any] | None:
    """The message, or None for anything that is not one of ours (ignored, never trusted)."""
    if not data.startswith(PREFIX):
        return None
    try:
        msg = json.loads(data[len(PREFIX) :])
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(msg, dict) or msg.get("op") not in OPS or not isinstance(msg.get("t"), str):
        return None
    return msg


def runs(ids: list[int]) -> list[list[int]]:
    """Block ids as [first, count] runs of consecutive ids: short enough for one notification."""
    out: list[list[int]] = []
    for b in ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return out


def unruns(rs: Any) -> list[int]:
    return [int(first) + i for first, count in rs for i in range(int(count))]
