"""A partition mid-transfer: nftables drops the packets between this process and a target host.

No reset and no error reaches either side: only the heartbeats' silence tells. Every op in
flight must end with ConnectionLost within the heartbeat timeout (plus the time to notice),
none reported done may be torn, and once the link heals a new connection works.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import aiohixl
from tests.harness import Target, pattern, sha

TOKEN = "hosts-tier-token"
INTERVAL, TIMEOUT = 0.5, 1.5  # both sides' heartbeat (tests/target.py: timeout = 3 x interval)
SLICE, COUNT = 1 << 20, 48  # 48 MiB at 200 Mbit/s: 2 s on the wire, the partition comes early
# Silence is checked every interval, on a busy machine a little late: the bound that says "no hang".
BOUND = TIMEOUT + 2 * INTERVAL + 2.0

DIRECTIONS = {
    "both-ways": dict(both_ways=True),
    "to-target-only": dict(both_ways=False, inbound=True),  # the target hears nothing
    "from-target-only": dict(both_ways=False, inbound=False),  # we hear nothing (no acks, no heartbeats)
}


def agent() -> aiohixl.Agent:
    return aiohixl.Agent("gw", token=TOKEN, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
async def test_partition_mid_transfer_fails_every_op_and_tears_none(hosts, direction):
    host = hosts[0]
    hosts.cap("200mbit")
    target = await Target.start(
        listen=f"{host.address}:0", token=TOKEN, prefix=tuple(host.argv([])), heartbeat=INTERVAL
    )
    try:
        await target.alloc("dst", SLICE * COUNT, seed=1)
        old, new = pattern(SLICE * COUNT, 1), pattern(SLICE * COUNT, 2)
        async with agent() as me:
            peer = await me.connect(target.address)
            assert peer.transport == "tcp"
            dst = await peer.region("dst")
            src = me.register(new)
            ended: dict[int, tuple[float, BaseException | None]] = {}

            async def put(i: int) -> None:
                part = slice(i * SLICE, (i + 1) * SLICE)
                try:
                    await peer.put(dst[part], src[part], notify=str(i).encode())
                    ended[i] = (time.monotonic(), None)
                except aiohixl.HixlError as exc:
                    ended[i] = (time.monotonic(), exc)

            tasks = [asyncio.create_task(put(i)) for i in range(COUNT)]
            while len(ended) < 3:  # some done: the rest are on the wire or queued behind it
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=30)
                assert not all(t.done() for t in tasks), "every put ended before the partition"
            with hosts.partitioned(host, hosts.gateway, **DIRECTIONS[direction]):
                dropped = time.monotonic()
                done_before = len(ended)
                await asyncio.wait_for(asyncio.gather(*tasks), BOUND + 10)  # a hang fails here
                lost = {i: at - dropped for i, (at, exc) in ended.items() if exc is not None}
                done = sorted(i for i, (_, exc) in ended.items() if exc is None)
                assert lost, f"no op was in flight at the partition ({done_before} done before)"
                for i, (_, exc) in ended.items():
                    assert exc is None or isinstance(exc, aiohixl.ConnectionLost), (i, repr(exc))
                assert max(lost.values()) < BOUND, lost
                assert isinstance(peer.broken, aiohixl.ConnectionLost)
                print(
                    f"{direction}: {len(done)} puts done, {len(lost)} lost, ConnectionLost "
                    f"{min(lost.values()):.2f}-{max(lost.values()):.2f} s after the drop (heartbeat {TIMEOUT} s)"
                )
            # Healed: a new connection works, and the target tells what landed.
            peer = await me.connect(target.address)
            await peer.put((await peer.region("dst"))[0:SLICE], src[0:SLICE])
        state = await target.state()
        notes = (await target.cmd(op="collect", n=state["received"], timeout=10))["notes"]
        noted = {int(data) for _, data in notes}
        torn = 0
        for i in range(COUNT):
            part = slice(i * SLICE, (i + 1) * SLICE)
            got = await target.hash("dst", i * SLICE, SLICE)
            if i in done or i in noted:  # reported done or notified: every byte new
                assert got == sha(new[part]), f"put {i} reported done, but its bytes are not all there"
            elif got not in (sha(old[part]), sha(new[part])):
                torn += 1  # failed, as reported: a failed put promises nothing of its bytes
        assert set(done) <= noted | {0}, (done, noted)  # put 0 was sent again after the heal, unnotified
        print(f"{direction}: {len(noted)} notified, {torn} failed puts left part-written")
    finally:
        await target.aclose()
