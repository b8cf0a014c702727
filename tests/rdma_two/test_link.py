"""Verbs between two kernels over a link that delays, drops and dies.

Guest A (this process) and guest B (the target, started through tests/rdma_two/bridge.py)
each have their own rxe device on the two ends of a virtual Ethernet link
(tests/softroce/run-two.sh). Run by `make test-rdma-two`; skipped anywhere else. The
power-off test reboots guest B: it is last in the run.
"""

import asyncio
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import aiohixl

from ..harness import BRIDGE, TOKEN, Target, pattern, sha
from ..waiting import wait_until
from .perf import report

if not BRIDGE:
    pytest.skip("the two-guest tier: run `make test-rdma-two`", allow_module_level=True)

MIB = 1 << 20
HEARTBEAT_TIMEOUT = 5.0  # the Agent's default; its QP's: rdma_timeout=14, rdma_retry_count=7
# docs/rdma.md: a silent peer fails ops after (7 + 1) * 4.096 us * 2**14 ~= 0.55 s of QP
# retries, and the heartbeat ends the session after 5 s whatever the QP does; the slack is the
# host's reaction to the power-off request and an emulated guest's scheduling.
POWER_OFF_BOUND = HEARTBEAT_TIMEOUT + 3.0


def agent() -> aiohixl.Agent:
    return aiohixl.Agent("guest-a", token=TOKEN, transports=("verbs",))


@pytest.fixture
def lossy_link():
    dev = os.environ.get("SOFTROCE_NETDEV", "eth0")
    subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "2ms", "loss", "1%"], check=True)
    yield
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], check=True)


@pytest.mark.asyncio
async def test_a_delaying_lossy_link_changes_no_byte(lossy_link):
    # netem on guest A's egress: WRITE data, READ requests and SENDs are delayed and dropped;
    # RC retransmits (go-back-N on a sequence NAK, the ACK timeout for a lost tail).
    target = await Target.start()
    try:
        await target.alloc("kv", 4 * MIB)
        await target.alloc("src", MIB, seed=3)
        async with agent() as a:
            peer = await a.connect(target.address)
            assert peer.transport == "verbs"
            kv, rsrc = await peer.region("kv"), await peer.region("src")
            src_arr = pattern(4 * MIB, 4)
            src = a.register(src_arr)
            dst_arr = np.zeros(MIB, dtype=np.uint8)
            dst = a.register(dst_arr)
            t0 = time.monotonic()
            await asyncio.gather(
                *(peer.put(kv[i * MIB : (i + 1) * MIB], src[i * MIB : (i + 1) * MIB]) for i in range(4))
            )
            report(f"lossy link: 4 concurrent 1 MiB puts in {time.monotonic() - t0:.2f} s")
            assert await target.hash("kv", 0, 4 * MIB) == sha(src_arr)
            await peer.get(dst, rsrc)
            assert sha(dst_arr) == sha(pattern(MIB, 3))
            # 256 scattered 4 KiB pieces in one submission, the message behind them
            pieces = [(kv[j * 16384 : j * 16384 + 4096], src[j * 4096 : (j + 1) * 4096]) for j in range(256)]
            check = asyncio.create_task(target.cmd(op="take_note", timeout=600))
            await peer.put_many(
                pieces, notify=f"kv:{255 * 16384}:4096:{sha(src_arr[255 * 4096 : 256 * 4096])}".encode()
            )
            assert (await check)["in_place"]
            assert await target.hash("kv", 0, 4096) == sha(src_arr[:4096])
            assert peer.broken is None
    finally:
        await target.aclose()


@pytest.mark.asyncio
async def test_guest_b_powered_off_mid_transfer_then_back():
    ctl = Path(os.environ["SOFTROCE_TWO_CTL"])
    target = await Target.start()
    await target.alloc("kv", MIB)
    src_arr = pattern(MIB, 8)
    async with agent() as a:
        peer = await a.connect(target.address)
        kv = await peer.region("kv")
        src = a.register(src_arr)
        done, last = 0, 0.0

        async def pump() -> None:
            nonlocal done, last
            while True:
                await peer.put(kv, src)
                done, last = done + 1, time.monotonic()

        tasks = [asyncio.create_task(pump()) for _ in range(4)]
        await wait_until(lambda: done >= 4, timeout=600, what="traffic before the power-off")
        (ctl / "poweroff-b").touch()  # run-two.sh kills guest B's QEMU
        asked = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = time.monotonic()
        assert all(isinstance(r, aiohixl.ConnectionLost) for r in results), results
        report(
            f"power-off: ops failed {failed - asked:.2f} s after the request, "
            f"{failed - last:.2f} s after the last completed put ({done} puts of 1 MiB)"
        )
        assert failed - asked < POWER_OFF_BOUND
        with pytest.raises(aiohixl.ConnectionLost):
            await peer.put(kv, src)
        await target.proc.aclose()  # its guest is gone: nothing there to ask to exit
        target = await Target.start()  # through the bridge of guest B booted again
        try:
            await target.alloc("kv", MIB)
            again = await a.connect(target.address)
            await again.put(await again.region("kv"), src)
            assert await target.hash("kv", 0, MIB) == sha(src_arr)
        finally:
            await target.aclose()
