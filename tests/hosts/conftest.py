"""The hosts tier: agents in network namespaces joined by veth pairs (examples/hosts/netns.py).

Collected only by ``make test-hosts`` (AIOHIXL_TEST_HOSTS=1): it needs root, ``ip``, ``nft``
(Debian ``nftables``) and ``tc``. Every test gets hosts of its own, removed after it whatever
happened; a killed run's leftovers are swept first.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "hosts"))

import netns  # noqa: E402

if not os.environ.get("AIOHIXL_TEST_HOSTS"):
    collect_ignore_glob = ["test_*.py"]
elif os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "nft", "tc")):
    raise pytest.UsageError("make test-hosts needs root and ip, nft (apt nftables), tc (iproute2)")


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    """Three hosts on one bridge; this process is the bridge's gateway (``hosts.gateway``)."""
    netns.sweep()
    with netns.Hosts(3) as h:
        yield h
