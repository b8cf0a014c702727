"""What every transport promises, written once and run over each path.

Paths: loopback (one agent), shm-memfd and shm-cma (a target process on this
host), tcp, and verbs inside the Soft-RoCE VM (``make test-rdma``). A new
transport is one more entry in ``PATHS``. The target's memory is checked
through the target process's own hash of it, never through the library.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiohixl
from aiohixl import Access
from aiohixl import _testing as hooks
from aiohixl.remote import RemoteRegion

from .harness import TOKEN, Target, pattern, sha
from .waiting import wait_until

IN_VM = bool(os.environ.get("SOFTROCE_GUEST"))
# name -> (transports the initiator allows, how the target registers its memory)
PATHS: dict[str, tuple[tuple[str, ...], str]] = {
    "loopback": (("loopback",), "alloc"),
    "shm-memfd": (("shm",), "alloc"),
    "shm-cma": (("shm",), "register"),
    "tcp": (("tcp",), "alloc"),
    "verbs": (("verbs",), "alloc"),
}
RUN = ["verbs"] if IN_VM else ["loopback", "shm-memfd", "shm-cma", "tcp"]
SPACE = (4 << 20) if IN_VM else (32 << 20)  # rxe moves tens of MB/s


@dataclasses.dataclass
class Path:
    """An initiator agent, a peer over one path, and the target's memory to check."""

    name: str
    agent: aiohixl.Agent
    peer: aiohixl.Peer
    target: Target | None  # None: the peer is the agent itself
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    async def region(
        self,
        name: str,
        size: int,
        *,
        access: Access = Access.REMOTE_READ | Access.REMOTE_WRITE,
        seed: int | None = None,
    ) -> RemoteRegion:
        """A region of the target that this path reaches, filled with ``pattern(size, seed)``."""
        if self.target is None:
            region = self.agent.allocate(size, name=name, access=access)
            arr = np.frombuffer(region.memory, dtype=np.uint8)
            if seed is not None:
                arr[:] = pattern(size, seed)
            self.arrays[name] = arr
        else:
            await self.target.alloc(name, size, access=int(access), seed=seed, kind=PATHS[self.name][1])
        remote = await self.peer.region(name)
        assert await self.peer.path(remote) == self.name
        return remote

    async def hash(self, name: str, offset: int, length: int) -> str:
        if self.target is None:
            return hashlib.sha256(self.arrays[name][offset : offset + length]).hexdigest()
        return await self.target.hash(name, offset, length)


async def open_path(name: str, target: Target | None, **agent_args: Any) -> Path:
    transports, _ = PATHS[name]
    agent = aiohixl.Agent(f"initiator-{name}", token=TOKEN, transports=transports, **agent_args)
    await agent.start()
    peer = agent.loopback() if target is None else await agent.connect(target.address)
    return Path(name, agent, peer, target)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=RUN)
async def path(request):
    target = None if request.param == "loopback" else await Target.start()
    p = await open_path(request.param, target)
    p.src_arr = pattern(SPACE, 7)  # type: ignore[attr-defined]
    p.src = p.agent.register(p.src_arr)  # type: ignore[attr-defined]
    p.dst_arr = np.zeros(SPACE, dtype=np.uint8)  # type: ignore[attr-defined]
    p.dst = p.agent.register(p.dst_arr)  # type: ignore[attr-defined]
    p.kv = await p.region("kv", SPACE)  # type: ignore[attr-defined]
    p.ksrc = await p.region("ksrc", SPACE, seed=21)  # type: ignore[attr-defined]
    yield p
    await p.agent.aclose()
    if target is not None:
        await target.aclose()


hyp = settings(
    max_examples=3 if IN_VM else 15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
sizes = st.one_of(
    st.integers(1, 4096), st.integers(4097, SPACE), st.sampled_from([1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, SPACE])
)


@pytest.mark.asyncio(loop_scope="module")
@hyp
@given(data=st.data())
async def test_put_then_get_byte_exact(path, data):
    n = data.draw(sizes)
    a, b = data.draw(st.integers(0, SPACE - n)), data.draw(st.integers(0, SPACE - n))
    await path.peer.put(path.kv[b : b + n], path.src[a : a + n])
    assert await path.hash("kv", b, n) == sha(path.src_arr[a : a + n])
    c = data.draw(st.integers(0, SPACE - n))
    path.dst_arr[c : c + n] = 0xEE
    await path.peer.get(path.dst[c : c + n], path.ksrc[b : b + n])
    assert np.array_equal(path.dst_arr[c : c + n], pattern(SPACE, 21)[b : b + n])


@pytest.mark.asyncio(loop_scope="module")
async def test_many_pairs_in_one_submission(path):
    # 300 pairs: more than one native chain on verbs, one submission everywhere.
    rng = np.random.default_rng(3)
    sizes_ = rng.integers(1, SPACE // 300, 300)
    offs = np.concatenate(([0], np.cumsum(sizes_)[:-1]))
    puts = [(path.kv[int(o) : int(o + s)], path.src[int(o) : int(o + s)]) for o, s in zip(offs, sizes_, strict=True)]
    await path.peer.put_many(puts)
    total = int(offs[-1] + sizes_[-1])
    assert await path.hash("kv", 0, total) == sha(path.src_arr[:total])
    path.dst_arr[:total] = 0
    await path.peer.get_many(
        [(path.dst[int(o) : int(o + s)], path.ksrc[int(o) : int(o + s)]) for o, s in zip(offs, sizes_, strict=True)]
    )
    assert np.array_equal(path.dst_arr[:total], pattern(SPACE, 21)[:total])


@pytest.mark.asyncio(loop_scope="module")
async def test_a_completed_put_is_seen_by_the_next_get(path):
    one = path.agent.register(bytearray(8))
    back = path.agent.register(bytearray(8))
    for i in range(10 if IN_VM else 300):
        one.memory[:] = i.to_bytes(8, "little")
        await path.peer.put(path.kv[64:72], one)
        await path.peer.get(back, path.kv[64:72])
        assert bytes(back.memory) == i.to_bytes(8, "little")


@pytest.mark.asyncio(loop_scope="module")
async def test_concurrent_ops_each_land_once(path):
    n, size = (100, 4096) if IN_VM else (2000, 4096)
    before = hooks.engine(path.agent).completed
    await asyncio.gather(
        *(path.peer.put(path.kv[i * size : (i + 1) * size], path.src[i * size : (i + 1) * size]) for i in range(n))
    )
    assert await path.hash("kv", 0, n * size) == sha(path.src_arr[: n * size])
    assert path.agent.outstanding == 0 and hooks.engine(path.agent).unknown_completions == 0
    assert hooks.engine(path.agent).completed - before <= n  # small ops may finish inline, none twice


@pytest.mark.asyncio(loop_scope="module")
async def test_refused_ops_leave_memory_untouched(path):
    ro = await path.region("ro", 64 << 10, access=Access.REMOTE_READ, seed=5)
    small = await path.region("small", 4096, seed=6)
    before = await path.hash("ro", 0, 64 << 10), await path.hash("small", 0, 4096)
    src = path.src
    with pytest.raises(aiohixl.AccessDenied, match="Peer.put.*REMOTE_WRITE"):
        await path.peer.put(ro[:10], src[:10])  # refused by the initiator, from the descriptor
    with pytest.raises(aiohixl.LengthMismatch, match="Peer.put"):
        await path.peer.put(small, src[:4095])
    # Forged descriptors get past the initiator's checks; the owner refuses.
    lying = RemoteRegion(dataclasses.replace(ro.info, access=Access.REMOTE_READ | Access.REMOTE_WRITE))
    with pytest.raises((aiohixl.AccessDenied, aiohixl.ConnectionLost)):
        await path.peer.put(lying, src[: 64 << 10])
    if path.peer.broken:  # RC semantics: a remote access error ends the queue pair
        path.peer = await path.agent.connect(path.target.address)
    longer = RemoteRegion(dataclasses.replace(small.info, nbytes=1 << 20))
    with pytest.raises((aiohixl.OutOfBounds, aiohixl.AccessDenied, aiohixl.ConnectionLost)):
        await path.peer.put(longer[4096 : 1 << 20], src[: (1 << 20) - 4096])
    if path.peer.broken:
        path.peer = await path.agent.connect(path.target.address)
    # No such region (verbs: no such rkey, which is what its NIC checks)
    rkey = small.info.keys.get(1)
    keys = {1: ((int.from_bytes(rkey, "little") + 0x100) & 0xFFFFFFFF).to_bytes(4, "little")} if rkey else {}
    ghost = RemoteRegion(dataclasses.replace(small.info, region_id=99999, keys=keys))
    with pytest.raises((aiohixl.RegionUnavailable, aiohixl.AccessDenied, aiohixl.ConnectionLost)):
        await path.peer.put(ghost, src[:4096])
    if path.peer.broken:
        path.peer = await path.agent.connect(path.target.address)
    assert (await path.hash("ro", 0, 64 << 10), await path.hash("small", 0, 4096)) == before
    # the path still works
    await path.peer.put(small, src[:4096])
    assert await path.hash("small", 0, 4096) == sha(path.src_arr[:4096])
    path.kv = await path.peer.region("kv")
    path.ksrc = await path.peer.region("ksrc")


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("forged_first", [False, True])
async def test_a_refused_submission_places_no_byte(path, forged_first):
    """One forged pair out of bounds: the owner refuses the whole put_many/get_many, valid pairs included."""
    if path.name == "verbs":
        pytest.skip("RDMA writes are checked by the NIC one by one: earlier ones of a chain land")
    name = f"sub{int(forged_first)}"
    small = await path.region(name, 4096, seed=8)
    before_small, before_kv = await path.hash(name, 0, 4096), await path.hash("kv", 0, 3 << 20)
    longer = RemoteRegion(dataclasses.replace(small.info, nbytes=1 << 20))
    valid = [(path.kv[0 : 1 << 20], path.src[0 : 1 << 20]), (path.kv[2 << 20 : 3 << 20], path.src[0 : 1 << 20])]
    forged = (longer[8192:16384], path.src[0:8192])
    pairs = [forged, *valid] if forged_first else [*valid, forged]
    with pytest.raises(aiohixl.OutOfBounds):
        await path.peer.put_many(pairs)
    assert await path.hash(name, 0, 4096) == before_small
    assert await path.hash("kv", 0, 3 << 20) == before_kv
    path.dst_arr[: 2 << 20] = 0xEE
    gets = [(path.dst[0 : 1 << 20], path.ksrc[0 : 1 << 20]), (path.dst[1 << 20 : (1 << 20) + 8192], longer[8192:16384])]
    with pytest.raises(aiohixl.OutOfBounds):
        await path.peer.get_many(gets)
    assert not (path.dst_arr[: 2 << 20] != 0xEE).any()  # no piece of the refused get landed
    await path.peer.put(path.kv[0:4096], path.src[0:4096])  # the path still works
    assert await path.hash("kv", 0, 4096) == sha(path.src_arr[:4096])


@pytest.mark.asyncio(loop_scope="module")
async def test_unnamed_regions_are_reachable_only_by_their_descriptor(path):
    """Ids count from 1: a peer that guesses one without the region's key reaches nothing."""
    size = 64 << 10
    if path.target is None:
        region = path.agent.allocate(size)  # no name: not published
        path.arrays["hidden"] = np.frombuffer(region.memory, dtype=np.uint8)
        desc = region.descriptor()
    else:
        kind = PATHS[path.name][1]
        desc = bytes.fromhex((await path.target.alloc("hidden", size, kind=kind, publish=False))["descriptor"])
    before = await path.hash("hidden", 0, size)
    real = path.peer.remote_region(desc)
    assert real.key != 0
    if path.name != "verbs":  # verbs: the NIC checks the rkey, which the descriptor carries as well
        for guess in range(1, real.id + 3):  # every id there is, with a guessed key
            forged = RemoteRegion(dataclasses.replace(real.info, region_id=guess, key=real.key ^ 1))
            with pytest.raises((aiohixl.RegionUnavailable, aiohixl.AccessDenied)):
                await path.peer.put(forged[:16], path.src[:16])
            with pytest.raises((aiohixl.RegionUnavailable, aiohixl.AccessDenied)):
                await path.peer.get(path.dst[:16], forged[:16])
        assert await path.hash("hidden", 0, size) == before
    # with its descriptor, the same region is reachable
    await path.peer.put(real, path.src[:size])
    assert await path.hash("hidden", 0, size) == sha(path.src_arr[:size])


@pytest.mark.asyncio(loop_scope="module")
async def test_cancelled_op_still_lands_and_its_memory_stays_alive(path):
    n = SPACE
    src_arr = pattern(n, 11)
    src = path.agent.register(src_arr)
    task = asyncio.create_task(path.peer.put(path.kv[:n], src))
    await asyncio.sleep(0)  # posted
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    del src_arr  # the user's reference is gone; the op keeps the buffer alive
    # the op is still accounted for, until its completion arrives
    await wait_until(lambda: path.agent.outstanding == 0, timeout=60, what="the cancelled put's completion")
    assert await path.hash("kv", 0, n) == sha(pattern(n, 11))
    await src.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_closing_the_agent_with_ops_in_flight(path):
    p = await open_path(path.name, path.target, copy_threads=1)
    name = "kv" if path.target is not None else "mine"
    remote = await p.peer.region(name) if path.target is not None else await p.region(name, SPACE)
    src = p.agent.register(pattern(SPACE, 2))
    tasks = [asyncio.create_task(p.peer.put(remote[:SPACE], src)) for _ in range(16)]
    await asyncio.sleep(0)
    await p.agent.aclose()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, aiohixl.ClosedError) for r in results), results
    assert p.agent.outstanding == 0
    with pytest.raises(aiohixl.ClosedError, match="Peer.put"):
        await p.peer.put(remote, src)
    # the target is unharmed: the module's own peer still works
    await path.peer.put(path.kv[:4096], path.src[:4096])
    assert await path.hash("kv", 0, 4096) == sha(path.src_arr[:4096])


@pytest.mark.parametrize("name", RUN)
async def test_peer_death_fails_outstanding_ops_then_reconnect_works(name):
    if name == "loopback":
        pytest.skip("a loopback peer cannot die without its agent")
    target = await Target.start(rdma_timeout=8)
    port = target.port
    size = SPACE
    await target.alloc("kv", size, kind=PATHS[name][1])
    p = await open_path(name, target)
    try:
        kv = await p.peer.region("kv")
        src = p.agent.register(pattern(size, 2))
        done = 0

        async def pump():
            nonlocal done
            while True:
                await p.peer.put(kv, src)
                done += 1

        tasks = [asyncio.create_task(pump()) for _ in range(4)]
        await wait_until(lambda: done >= 4, what="traffic before the kill")  # ops in flight at the kill
        target.kill()
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        assert all(isinstance(r, aiohixl.ConnectionLost) for r in results), results
        # the kernel closes a dead process's sockets at once; verbs waits out its QP timeout
        assert elapsed < (30.0 if IN_VM else 5.0), f"ops took {elapsed:.2f} s to fail"
        assert p.agent.outstanding == 0
        with pytest.raises(aiohixl.ConnectionLost, match="Peer.put"):
            await p.peer.put(kv, src)
        await target.proc.wait()
        # a new target on the same port: connecting again works
        target = await Target.start(listen=f"127.0.0.1:{port}")
        await target.alloc("kv", size, kind=PATHS[name][1])
        peer2 = await p.agent.connect(target.address)
        await peer2.put(await peer2.region("kv"), src)
        assert await target.hash("kv", 0, size) == sha(pattern(size, 2))
    finally:
        await p.agent.aclose()
        await target.aclose()
