"""Raw RC peers: a pyverbs program (tests/rdma/pyverbs_peer.py, no aiohixl in it) against an agent.

The program runs under the system python3 (Debian's python3-pyverbs) as its
own process; the two sides trade only JSON files in one folder
($AIOHIXL_RC_EXCHANGE, a share two hosts both see, else a temporary folder):
addresses and GIDs are data, nothing assumes one host. In the two-guest tier
(AIOHIXL_TEST_BRIDGE set) the program runs in guest B, started through its bridge.
"""

import asyncio
import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

import aiohixl
from aiohixl.transports import verbs as _rdma

from ..harness import BRIDGE, BRIDGE_WAIT
from ..waiting import wait_until

try:
    _rdma.choose()
except ValueError as exc:
    pytest.skip(f"no RDMA device here ({exc}); run `make test-rdma`", allow_module_level=True)

SYSTEM_PYTHON = "/usr/bin/python3"
PEER = str(Path(__file__).with_name("pyverbs_peer.py"))
if subprocess.run([SYSTEM_PYTHON, "-c", "import pyverbs"], capture_output=True).returncode != 0:
    pytest.skip("no pyverbs for /usr/bin/python3 (Debian: python3-pyverbs)", allow_module_level=True)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(600)]

REMOTE_INVALID_REQUEST = 9  # IBV_WC_REM_INV_REQ_ERR
REMOTE_ACCESS_ERROR = 10  # IBV_WC_REM_ACCESS_ERR
SUCCESS = 0


def pattern(n: int, seed: int) -> bytes:  # pyverbs_peer.pattern, written out again: neither imports the other
    block = bytes((seed * 31 + i) & 0xFF for i in range(251))
    return (block * (n // 251 + 1))[:n]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def folder(tmp_path):
    shared = os.environ.get("AIOHIXL_RC_EXCHANGE")
    if not shared:
        return tmp_path
    path = Path(shared) / os.urandom(6).hex()
    path.mkdir(parents=True)
    return path


def put_json(path: Path, data: object) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(data))
    os.rename(path.with_suffix(".tmp"), path)


async def read_json(path: Path, proc: asyncio.subprocess.Process) -> dict:
    async def there() -> bool:
        if proc.returncode is not None and not path.exists():
            raise AssertionError(f"pyverbs_peer exited {proc.returncode}: {(await proc.communicate())[1].decode()}")
        return path.exists()

    await wait_until(there, timeout=300, what=str(path))
    return json.loads(path.read_text())


class BridgedPeer:
    """The program in the other guest (tests/rdma_two/bridge.py): what the tests use of a process.
    The bridge does not carry its exit code: its JSON files say how it went."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.returncode: int | None = None

    async def wait(self) -> int:
        self.returncode = await self.proc.wait()
        await self.proc.aclose()
        return self.returncode

    async def communicate(self) -> tuple[bytes, bytes]:
        await self.wait()
        return b"", b"(its output is in guest B's console: build/softroce-two/b.log)"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)


async def start_peer(*args: str):
    if BRIDGE:  # the two-guest tier: the program runs in guest B, RC crosses the link
        from ..rdma_two.bridge import open_bridged

        return BridgedPeer(await open_bridged(["pyverbs_peer", *args], BRIDGE, timeout=BRIDGE_WAIT))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return await asyncio.create_subprocess_exec(
        SYSTEM_PYTHON, PEER, *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


async def finish(proc: asyncio.subprocess.Process) -> None:
    out, err = await proc.communicate()
    assert proc.returncode == 0, (out + err).decode()


async def pyverbs_initiator(folder: Path, export: aiohixl.RcExport, ops: list[dict]) -> list[dict]:
    """Run the program's initiator against ``export``; its per-op results."""
    put_json(folder / "export.json", export.info())
    proc = await start_peer("initiator", str(folder), json.dumps(ops))
    try:
        export.connect(await read_json(folder / "peer.json", proc))
        put_json(folder / "connected", {})
        results = await read_json(folder / "result.json", proc)
        await finish(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return results


def agent() -> aiohixl.Agent:
    return aiohixl.Agent(name="raw-rc", transports=("verbs", "tcp"))


async def test_pyverbs_writes_and_reads_an_exported_range(folder):
    async with agent() as a:
        region = a.allocate(64 << 10, access="rw")
        n = 16 << 10
        with a.export_rc(region[4096 : 4096 + n], access="rw", label="pyverbs") as export:
            info = export.info()
            assert info["length"] == n and info["access"] == "rw", info
            assert json.loads(export.to_json()) == info  # plain JSON, nothing else
            ops = [
                {"op": "write", "offset": 0, "length": n, "seed": 3, "imm": 0xBEEF},
                {"op": "read", "offset": 100, "length": 5000},
            ]
            results = await pyverbs_initiator(folder, export, ops)
            assert [r["status"] for r in results] == [SUCCESS, SUCCESS], results
            sent = pattern(n, 3)
            assert bytes(region.memory[4096 : 4096 + n]) == sent
            assert results[1]["sha256"] == digest(sent[100:5100])
            assert bytes(region.memory[:4096]) == bytes(4096)  # outside the range: untouched
            assert bytes(region.memory[4096 + n :]) == bytes((64 << 10) - 4096 - n)
            note = await a.notification(timeout=60)
            assert (note.imm, note.nbytes, note.peer) == (0xBEEF, n, "pyverbs")


@pytest.mark.parametrize("offset", [-16, 4096 - 100], ids=["before", "across-the-end"])
async def test_a_write_outside_the_export_fails_on_the_pyverbs_side(folder, offset):
    async with agent() as a:
        region = a.allocate(16 << 10, access="rw")
        with a.export_rc(region[4096:8192], access="rw") as export:
            results = await pyverbs_initiator(
                folder, export, [{"op": "write", "offset": offset, "length": 200, "seed": 1}]
            )
        assert [r["status"] for r in results] == [REMOTE_ACCESS_ERROR], results
        assert bytes(region.memory) == bytes(16 << 10)


async def test_a_read_only_export_refuses_writes(folder):
    async with agent() as a:
        region = a.allocate(8192, access="rw")
        region.memory[:] = pattern(8192, 9)
        with a.export_rc(region, access="r") as export:
            assert export.info()["access"] == "r"
            ops = [
                {"op": "read", "offset": 0, "length": 8192},
                {"op": "write", "offset": 0, "length": 64, "seed": 2},
            ]
            results = await pyverbs_initiator(folder, export, ops)
        # The QP itself grants no write (rxe NAKs it as an invalid request); its MR would refuse too.
        assert [r["status"] for r in results] in ([SUCCESS, REMOTE_INVALID_REQUEST], [SUCCESS, REMOTE_ACCESS_ERROR])
        assert results[0]["sha256"] == digest(pattern(8192, 9))
        assert bytes(region.memory) == pattern(8192, 9)


async def test_an_export_grants_no_more_than_its_region():
    async with agent() as a:
        readonly = a.allocate(4096, access="r")
        with pytest.raises(aiohixl.AccessDenied):
            a.export_rc(readonly, access="rw")
        with pytest.raises(aiohixl.InvalidArgument):
            a.export_rc(readonly[0:0], access="r")
        export = a.export_rc(readonly, access="r")
        with pytest.raises(aiohixl.InvalidArgument, match="gid"):
            export.connect({"gid": "nope", "qpn": 1, "psn": 1})
        await readonly.close()
        assert export.closed  # closed with its region, before its memory went


async def test_aiohixl_writes_and_reads_a_pyverbs_region(folder):
    n = 32 << 10
    proc = await start_peer("target", str(folder), str(n), "4")
    try:
        async with agent() as a, a.rc_peer() as rc:
            theirs = await read_json(folder / "peer.json", proc)
            rc.connect(theirs)
            remote = rc.region(theirs)
            assert remote.nbytes == n
            put_json(folder / "aiohixl.json", json.loads(rc.endpoint.to_json()))
            await read_json(folder / "ready", proc)
            back = a.register(bytearray(n))
            await rc.get(back, remote)
            assert bytes(back.memory) == pattern(n, 4)
            mine = a.register(bytearray(pattern(8192, 6)))
            await rc.put(remote[1000 : 1000 + 8192], mine)
            with pytest.raises(aiohixl.LengthMismatch):
                await rc.put(remote[0:10], mine)
            with pytest.raises(aiohixl.OutOfBounds):
                remote[n - 10 : n + 10]
            put_json(folder / "done", {})
            result = await read_json(folder / "result.json", proc)
        await finish(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    expected = bytearray(pattern(n, 4))
    expected[1000 : 1000 + 8192] = pattern(8192, 6)
    assert result["sha256"] == digest(bytes(expected))
