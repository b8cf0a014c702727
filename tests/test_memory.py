"""Registration of every buffer kind, allocate(), slicing and descriptors."""

import asyncio
import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiohixl
from aiohixl import Access
from aiohixl import _testing as hooks
from aiohixl.descriptor import decode
from aiohixl.memkinds import memfd as memfd_kind

from .waiting import wait_until


@pytest.mark.parametrize(
    "make",
    [
        lambda: bytearray(4096),
        lambda: memoryview(bytearray(4096)),
        lambda: mmap.mmap(-1, 4096),
        lambda: np.zeros(1024, dtype=np.float32),
        lambda: np.zeros((32, 32), dtype=np.int32),
    ],
    ids=["bytearray", "memoryview", "mmap", "numpy-1d", "numpy-2d"],
)
async def test_register_buffer_kinds_roundtrip(agent, make):
    obj = make()
    region = agent.register(obj, name="r", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
    assert region.nbytes == memoryview(obj).nbytes
    src = agent.register(bytearray(range(256)) * (region.nbytes // 256))
    peer = agent.loopback()
    await peer.put(await peer.region("r"), src)
    assert bytes(memoryview(obj).cast("B")) == bytes(src.memory)


async def test_register_torch_cpu_tensor(agent):
    torch = pytest.importorskip("torch")
    t = torch.zeros(1024, dtype=torch.float32)
    region = agent.register(t, name="t", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
    src = agent.register(np.full(1024, 2.5, dtype=np.float32))
    peer = agent.loopback()
    await peer.put(await peer.region("t"), src)
    assert bool((t == 2.5).all())
    with pytest.raises(aiohixl.UnsupportedMemory, match="contiguous"):
        agent.register(torch.zeros(8, 8).t())
    await region.close()


async def test_registered_tensor_storage_cannot_be_pulled_away(agent):
    """resize_() would free the registered memory, set_() swap it: neither may leave the region dangling."""
    torch = pytest.importorskip("torch")
    rw = Access.REMOTE_READ | Access.REMOTE_WRITE
    grown = torch.zeros(1 << 18, dtype=torch.float32)  # 1 MiB: its own mapping, unmapped when freed
    swapped = torch.zeros(1 << 18, dtype=torch.float32)
    r_grown = agent.register(grown, name="grown", access=rw)
    r_swapped = agent.register(swapped, name="swapped", access=rw)
    view = grown[10:20]
    with pytest.raises(RuntimeError, match="not resizable"):
        grown.resize_(1 << 24)  # (torch leaves grown's shape wrong after this error: only view is used below)
    swapped.set_(torch.ones(16))  # the tensor moves away; the region keeps the memory it registered
    src = agent.register(np.full(1 << 18, 7.0, dtype=np.float32))
    peer = agent.loopback()
    await peer.put(await peer.region("grown"), src)
    await peer.put(await peer.region("swapped"), src)
    for region in (r_grown, r_swapped):
        assert np.array_equal(np.frombuffer(region.memory, dtype=np.float32), np.full(1 << 18, 7.0, np.float32))
    await r_grown.close()
    await r_swapped.close()
    del grown
    assert bool((view == 7.0).all())  # a view keeps the memory alive after the region and the tensor are gone


async def test_non_contiguous_is_refused(agent):
    with pytest.raises(aiohixl.UnsupportedMemory, match="contiguous"):
        agent.register(np.zeros((8, 8))[:, ::2])
    with pytest.raises(aiohixl.UnsupportedMemory, match="buffer protocol"):
        agent.register(object())


async def test_read_only_buffer(agent):
    with pytest.raises(aiohixl.InvalidArgument, match="REMOTE_WRITE"):
        agent.register(b"abcd", access=Access.REMOTE_WRITE)
    ro = agent.register(b"abcd" * 1024, access=Access.REMOTE_READ)
    assert ro.access == Access.REMOTE_READ and ro.readonly
    # register() exposes nothing unless asked; allocate() is memory made for peers
    assert agent.register(bytearray(8)).access == Access.NONE
    assert agent.register(b"x").access == Access.NONE
    assert agent.allocate(8).access == Access.REMOTE_READ | Access.REMOTE_WRITE
    dst = agent.register(bytearray(4096), name="dst", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
    peer = agent.loopback()
    await peer.put(await peer.region("dst"), ro)  # reading a read-only local buffer is fine
    assert bytes(dst.memory) == b"abcd" * 1024
    agent.register(bytearray(4096), name="src", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
    with pytest.raises(aiohixl.AccessDenied, match="Peer.get.*read-only"):
        await peer.get(ro, await peer.region("src"))


async def test_allocate_is_zeroed_page_aligned_memfd(agent):
    region = agent.allocate(3 * mmap.PAGESIZE + 5, name="a")
    assert region.kind == "memfd"
    assert region.address % mmap.PAGESIZE == 0
    assert region.nbytes == 3 * mmap.PAGESIZE + 5
    assert not any(region.memory)
    region.memory[:5] = b"hello"
    assert bytes(region[0:5].memory) == b"hello"


def _resident_pages(address: int, nbytes: int) -> int:
    """How many pages of [address, address + nbytes) are in memory (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


async def test_register_faults_every_page_in_and_keeps_the_contents(agent):
    """Populated in 16 MiB chunks, huge pages probed against small ones: every page is in
    memory once register() returns, and what the buffer held is still there."""
    buf = np.empty(300 << 20, dtype=np.uint8)  # malloc'd: its own mapping, mostly untouched
    buf[:: 1 << 20] = 7  # a few pages written before
    region = agent.register(buf)
    assert _resident_pages(region.address & ~(mmap.PAGESIZE - 1), region.nbytes) >= region.nbytes // mmap.PAGESIZE
    assert (buf[:: 1 << 20] == 7).all()
    await region.close()


async def test_allocate_async_lets_the_loop_run_and_returns_a_faulted_region(agent):
    src = agent.allocate(1 << 20, name="src")
    src.memory[:] = b"\x05" * (1 << 20)
    peer = agent.loopback()
    order = []

    async def meanwhile():
        await peer.put(await peer.region("src"), src)  # the loop serves ops while the pool faults in
        order.append("put")

    task = asyncio.create_task(meanwhile())
    pool = await agent.allocate_async(256 << 20, name="pool")
    order.append("allocated")
    await task
    assert order == ["put", "allocated"]
    assert _resident_pages(pool.address, pool.nbytes) == pool.nbytes // mmap.PAGESIZE
    await peer.put((await peer.region("pool"))[: 1 << 20], src)
    assert bytes(pool[: 1 << 20].memory) == bytes(src.memory)
    user = await agent.register_async(np.zeros(64 << 20, dtype=np.uint8))
    assert _resident_pages(user.address & ~(mmap.PAGESIZE - 1), user.nbytes) >= user.nbytes // mmap.PAGESIZE


async def _until_populating(agent):
    """Until allocate_async's populate is posted: an op in flight that no region names."""
    await wait_until(lambda: hooks.engine(agent).outstanding > 0, what="the populate posted")


async def test_allocate_async_cancelled_while_populating_returns_once_the_native_side_is_done(agent):
    task = asyncio.create_task(agent.allocate_async(512 << 20))
    await _until_populating(agent)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The cancellation is raised only after the populate's completion: nothing native touches
    # the memory it unmapped, and the agent goes on.
    assert hooks.engine(agent).outstanding == 0
    assert hooks.live_regions(agent) == []
    region = await agent.allocate_async(1 << 20)
    assert _resident_pages(region.address, region.nbytes) == region.nbytes // mmap.PAGESIZE


async def test_agent_closed_while_allocate_async_populates():
    agent = aiohixl.Agent("closing")
    await agent.start()
    task = asyncio.create_task(agent.allocate_async(512 << 20))
    await _until_populating(agent)
    await agent.aclose()  # waits for the copy thread that populates
    with pytest.raises(aiohixl.ClosedError):
        await task
    assert hooks.engine(agent).outstanding == 0


async def test_slicing(agent):
    region = agent.allocate(100)
    s = region[10:50]
    assert (s.offset, s.nbytes) == (10, 40)
    assert (s[5:10].offset, s[5:10].nbytes) == (15, 5)
    assert (region[-10:].offset, region[-10:].nbytes) == (90, 10)
    with pytest.raises(aiohixl.OutOfBounds, match="outside"):
        region[50:101]
    with pytest.raises(aiohixl.OutOfBounds):
        s[0:41]
    with pytest.raises(aiohixl.UnsupportedMemory):
        region[0:10:2]


async def test_every_kind_of_slice_agrees_with_the_rule(agent):
    # Region, RegionSlice, RemoteRegion, RemoteSlice have a fast path for [int:int]; whatever
    # takes it or not, a slice is Python's, except that out of range is an error, not clamped.
    from aiohixl.remote import RemoteRegion

    region = agent.allocate(64)
    remote = RemoteRegion(decode(region.descriptor()))
    keys = [None, 0, 1, 5, 63, 64, 65, -1, -64, -65, np.int64(3), True]
    for whole in (region, region[0:64], remote, remote[0:64]):
        inner = whole[8:40]
        for of, base, length in ((whole, 0, 64), (inner, 8, 32)):
            for start in keys:
                for stop in keys:
                    lo = 0 if start is None else int(start) + (length if int(start) < 0 else 0)
                    hi = length if stop is None else int(stop) + (length if int(stop) < 0 else 0)
                    if 0 <= lo <= hi <= length:
                        s = of[start:stop]
                        assert (s.offset, s.nbytes) == (base + lo, hi - lo), (of, start, stop)
                    else:
                        with pytest.raises(aiohixl.OutOfBounds):
                            of[start:stop]


async def test_slices_are_read_only_and_odd_keys_get_clear_errors(agent):
    import sys

    from aiohixl.memory import RegionSlice

    region = agent.allocate(64, name="r")
    s = region[8:40]
    with pytest.raises(AttributeError):
        s.offset = 0  # a span names memory that was checked: it does not move
    with pytest.raises(AttributeError):
        region.nbytes = 1 << 40
    for key, error in [
        (slice(0, sys.maxsize), aiohixl.OutOfBounds),  # clipped by CPython's slice unpacking: still out
        (slice(-sys.maxsize * 4, 4), aiohixl.OutOfBounds),
        (slice(1.0, 2), TypeError),
        (slice("a", None), TypeError),
        (slice(0, 4, 0), aiohixl.UnsupportedMemory),
        (3, TypeError),
    ]:
        for of in (region, s):
            with pytest.raises(error, match="'r'"):
                of[key]
    assert len(region) == 64 and len(s) == 32 and region[3:][1:].offset == 4
    bare = RegionSlice.__new__(RegionSlice)  # never initialised: refused, not read as garbage
    with pytest.raises(TypeError):
        bare[0:1]
    with pytest.raises(ValueError):
        RegionSlice(region, -1, 4)


async def test_a_slice_made_by_hand_is_checked_as_slicing_checks_one(agent):
    """RegionSlice and RemoteSlice are exported (for annotations): one made by hand with the
    wrong region, bounds or types is refused with the library's errors, not met later as an
    AttributeError inside a put."""
    from aiohixl import RegionSlice, RemoteSlice

    region = agent.allocate(4096, name="hand")
    remote = await agent.loopback().region("hand")
    for cls, args, error in [
        (RegionSlice, (remote, 0, 1), aiohixl.InvalidArgument),
        (RemoteSlice, (region, 0, 1), aiohixl.InvalidArgument),
        (RegionSlice, (region, -1, 4), aiohixl.InvalidArgument),
        (RegionSlice, (region, 0, 1.5), aiohixl.InvalidArgument),
        (RemoteSlice, (remote, True, 1), aiohixl.InvalidArgument),
        (RegionSlice, (region, 4000, 100), aiohixl.OutOfBounds),
        (RemoteSlice, (remote, 0, 4097), aiohixl.OutOfBounds),
    ]:
        with pytest.raises(error, match=cls.__name__):
            cls(*args)
    region.memory[8:16] = b"by hand!"
    await agent.loopback().put(RemoteSlice(remote, 100, 8), RegionSlice(region, 8, 8))
    assert bytes(region.memory[100:108]) == b"by hand!"


async def test_a_step_of_the_wrong_type_is_named_as_given(agent):
    region = agent.allocate(16)
    with pytest.raises(aiohixl.UnsupportedMemory, match="a step of '1' is not contiguous"):
        region[::"1"]


async def test_duplicate_name_refused(agent):
    agent.allocate(10, name="kv")
    with pytest.raises(aiohixl.InvalidArgument, match="already registered"):
        agent.allocate(10, name="kv")


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda a: a.allocate(64, access=4), aiohixl.InvalidArgument, "bits outside"),
        (lambda a: a.register(bytearray(8), access=8), aiohixl.InvalidArgument, "bits outside"),
        (lambda a: a.allocate(64, access="rwx"), aiohixl.InvalidArgument, "access 'rwx': use"),
        (lambda a: a.register(bytearray(8), access=b"rw"), aiohixl.InvalidArgument, "access must be"),
        (lambda a: a.allocate(64, name=123), aiohixl.InvalidArgument, "name must be a str"),
        (lambda a: a.register(bytearray(8), name=b"kv"), aiohixl.InvalidArgument, "name must be a str"),
        (lambda a: a.allocate(2**62), MemoryError, r"Agent.allocate\(4611686018427387904\): cannot allocate"),
        (lambda a: a.allocate(1.5), aiohixl.InvalidArgument, "size must be an int"),
        (lambda a: a.allocate(2**64), MemoryError, "cannot allocate 18446744073709551616 bytes: the host has"),
        (lambda a: a.register(bytearray(8), access=-2), aiohixl.InvalidArgument, "bits outside"),
        (lambda a: a.allocate(64, name="n" * 256), aiohixl.InvalidArgument, "name is 256 bytes in UTF-8, at most 255"),
        (lambda a: a.allocate(64, name="a\x00"), aiohixl.InvalidArgument, "holds a NUL"),
        (lambda a: a.register(bytearray(8), name="\udcff"), aiohixl.InvalidArgument, "lone surrogate"),
        (lambda a: a.register(np.array([object()] * 4)), aiohixl.UnsupportedMemory, "holds Python objects"),
        (lambda a: a.register(_released()), aiohixl.UnsupportedMemory, "released memoryview"),
    ],
    ids=[
        "allocate-access-4",
        "register-access-8",
        "access-word",
        "access-bytes",
        "name-int",
        "name-bytes",
        "huge",
        "float",
        "2**64",
        "access-negative",
        "name-too-long",
        "name-nul",
        "name-surrogate",
        "object-array",
        "released-view",
    ],
)
async def test_bad_arguments_are_refused_clearly(agent, call, error, text):
    with pytest.raises(error, match=text):
        call(agent)
    assert not hooks.live_regions(agent)  # nothing half-registered


def _released() -> memoryview:
    view = memoryview(bytearray(8))
    view.release()
    return view


async def test_an_allocation_the_host_cannot_back_is_memory_error_before_any_page(agent):
    """allocate populates its pages at once: past what the host has, the kernel's OOM killer
    would end the process (this one, likely) instead of the call failing."""
    room = memfd_kind.room()
    assert room is not None, "this host's /proc/meminfo says what it has"
    with pytest.raises(MemoryError, match=r"cannot allocate \d+ bytes: the host has \d+ available"):
        agent.allocate(room + (1 << 30))
    with pytest.raises(MemoryError, match="the host has"):
        await agent.allocate_async(room + (1 << 30))
    assert not hooks.live_regions(agent)


async def test_a_region_name_of_255_bytes_is_taken(agent):
    # The memfd's own label (/proc/PID/fd) is cut to the kernel's 249 bytes; the name is whole.
    region = agent.allocate(4096, name="é" * 127 + "x")
    assert region.name == "é" * 127 + "x" and len(region.name.encode()) == 255


async def test_register_async_errors_name_register_async(agent):
    with pytest.raises(aiohixl.InvalidArgument, match=r"^Agent\.register_async: access=0x8 has bits outside"):
        await agent.register_async(bytearray(8), access=8)
    with pytest.raises(aiohixl.InvalidArgument, match=r"^Agent\.register_async: bytes is read-only"):
        await agent.register_async(b"abc", access=aiohixl.Access.REMOTE_WRITE)


async def test_access_words_work_as_the_ranks_api_takes_them(agent):
    assert agent.allocate(64, access="rw").access == Access.REMOTE_READ | Access.REMOTE_WRITE
    assert agent.register(bytearray(8), access="remote_write").access == Access.REMOTE_WRITE
    assert (await agent.allocate_async(64, access="r|w")).access == Access.REMOTE_READ | Access.REMOTE_WRITE
    assert (await agent.register_async(bytearray(8), access="none")).access == Access.NONE


async def test_reprs_name_the_access_flags(agent):
    """Not a bare int (str() of an IntFlag on Python 3.11+)."""
    both = agent.allocate(64, name="kv", access="rw")
    assert repr(both) == "<Region 'kv' (id 1) 64 bytes REMOTE_WRITE|REMOTE_READ>"
    assert repr(agent.register(bytearray(8))).endswith(" 8 bytes NONE>")
    remote = agent.loopback().remote_region(agent.allocate(16, access=Access.REMOTE_READ).descriptor())
    assert repr(remote).endswith(" 16 bytes REMOTE_READ>")


async def test_empty_multidimensional_buffer_registers(agent):
    region = agent.register(np.zeros((0, 5)))
    assert region.nbytes == 0 and len(region.memory) == 0
    region = agent.register(np.zeros((0, 5)), access=Access.NONE)
    await region.close()


async def test_closing_region_releases_buffer(agent):
    buf = bytearray(100)
    region = agent.register(buf)
    with pytest.raises(BufferError):
        buf.append(1)  # pinned while registered
    await region.close()
    buf.append(1)
    assert region.closed
    with pytest.raises(aiohixl.ClosedError, match="Region.descriptor"):
        region.descriptor()


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(f"memfd:aiohixl:{name} " in line for line in maps)


async def test_closing_allocated_region_unmaps_it_before_close_returns(agent):
    # The unmap runs on a worker thread (GiBs take a second), yet close() returns only after it.
    region = agent.allocate(8 << 20, name="gone")
    assert _mapped("gone")
    await region.close()
    assert not _mapped("gone") and region.pinned.fd is None


async def test_memory_still_viewed_after_close_keeps_its_bytes(agent):
    """Closing drops the mapping's page-table entries a piece at a time before unmapping (the
    mmap lock is not held for the whole of a GiB); a view the caller still holds keeps the
    mapping, and its bytes, the last piece's included."""
    size = (64 << 20) + 12345  # two pieces and a part
    region = agent.allocate(size, name="viewed")
    view = np.frombuffer(region.memory, dtype=np.uint8)
    view[:] = pattern_bytes = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    await region.close()
    assert region.closed and region.pinned.fd is None
    assert np.array_equal(view, pattern_bytes)


async def test_cancelled_close_still_releases_the_region(agent):
    region = agent.allocate(8 << 20, name="cancelled")
    task = asyncio.create_task(region.close())
    await asyncio.sleep(0)  # started: the unmap may be on its worker thread now
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert region.closed and not _mapped("cancelled")


async def test_aclose_unmaps_every_allocated_region():
    agent = aiohixl.Agent("owner")
    regions = [agent.allocate(4 << 20, name=f"pool{i}") for i in range(3)]
    await agent.aclose()
    assert all(r.closed for r in regions)
    assert not any(_mapped(f"pool{i}") for i in range(3))


_CANCELLED_IN_EXIT = """
import asyncio, aiohixl

async def worker(state):
    async with aiohixl.Agent("w") as agent:
        state["agent"], state["kv"] = agent, agent.allocate(1 << 20, name="kv")
        state["kv"].memory[:2] = b"kv"
        await asyncio.Event().wait()

async def main():
    state = {}
    task = asyncio.create_task(worker(state))
    while "kv" not in state:
        await asyncio.sleep(0)
    task.cancel()
    while not state["agent"].closed:  # its exit began closing the agent
        await asyncio.sleep(0)
    task.cancel()  # again, as a task group or a timeout may
    await asyncio.gather(task, return_exceptions=True)
    agent, kv = state["agent"], state["kv"]
    print(agent.closed, kv.closed, flush=True)
    await agent.aclose()

asyncio.run(main())
"""


def test_an_agent_exit_cancelled_twice_still_releases_everything():
    """A task cancelled again while its `async with Agent()` exit closes the agent: the close
    runs to its end all the same (the cancellation is raised after it), so the regions are
    released; cut short, they stayed mapped and the interpreter crashed at exit."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CANCELLED_IN_EXIT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
    assert "Fatal Python error" not in out.stderr and "BufferError" not in out.stderr, out.stderr


async def test_a_second_aclose_returns_once_the_first_has_closed_the_agent():
    agent = aiohixl.Agent("twice")
    region = agent.allocate(4 << 20, name="twice")
    first = asyncio.create_task(agent.aclose())
    await wait_until(lambda: agent.closed)
    await agent.aclose()
    assert region.closed and not _mapped("twice")
    await first


async def test_descriptor_roundtrip_and_checks(agent):
    region = agent.allocate(4096, name="kv", access=Access.REMOTE_WRITE)
    desc = region.descriptor()
    peer = agent.loopback()
    remote = peer.remote_region(desc)
    assert (remote.name, remote.nbytes, remote.access, remote.id) == ("kv", 4096, Access.REMOTE_WRITE, region.id)
    assert remote[100:200].nbytes == 100
    async with aiohixl.Agent("other") as other:
        with pytest.raises(aiohixl.InvalidDescriptor, match="belongs to agent"):
            other.loopback().remote_region(desc)
    bad = bytearray(desc)
    bad[4] = 99
    with pytest.raises(aiohixl.InvalidDescriptor, match="version 99"):
        peer.remote_region(bytes(bad))
    with pytest.raises(aiohixl.InvalidDescriptor, match="magic"):
        peer.remote_region(b"PICKLE" + desc[6:])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_descriptor_decoder_never_crashes(data):
    try:
        decode(data)
    except aiohixl.InvalidDescriptor:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_descriptors_are_refused_or_decoded_consistently(data):
    from aiohixl.descriptor import RegionInfo, encode_info

    desc = bytearray(
        encode_info(
            RegionInfo(
                bytes(range(16)),
                7,
                4096,
                0x7F0000001000,
                Access.REMOTE_WRITE,
                "memfd",
                "kv",
                key=0x0123456789ABCDEF,
                keys={1: b"\x01\x02\x03\x04"},
            )
        )
    )
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(desc) - 1))
        desc[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(desc)))
    try:
        info = decode(bytes(desc[:cut]) if data.draw(st.booleans()) else bytes(desc))
    except aiohixl.InvalidDescriptor:
        return
    # whatever decodes re-encodes to the same bytes: nothing was guessed
    assert encode_info(info) in (bytes(desc), bytes(desc[:cut]))


class _CudaArray:
    """What CuPy/Numba device arrays look like to register(): no host buffer at all."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "|u1", "data": (0x7F0000000000, False), "version": 3}


class _DlpackDevice:
    def __dlpack_device__(self):
        return (2, 1)  # kDLCUDA, device 1

    def __dlpack__(self, stream=None):
        raise AssertionError("register() must not ask a device object for its data")


@pytest.mark.parametrize(
    "obj, device", [(_CudaArray(), "cuda \\(__cuda_array_interface__\\)"), (_DlpackDevice(), "cuda:1 \\(DLPack\\)")]
)
async def test_device_memory_is_refused_naming_the_device(agent, obj, device):
    with pytest.raises(aiohixl.UnsupportedMemory, match=f"Agent.register: memory on device {device}"):
        agent.register(obj)


async def test_torch_device_tensor_is_refused_naming_the_device(agent):
    torch = pytest.importorskip("torch")
    with pytest.raises(aiohixl.UnsupportedMemory, match="device meta"):
        agent.register(torch.empty(16, device="meta"))
