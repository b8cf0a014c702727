"""An RC peer that is not aiohixl: pyverbs and the standard library only.

Run with the system interpreter (Debian's python3-pyverbs), never the
project's venv, and without importing aiohixl. Connection facts are JSON
files in a folder both sides can read (the same host, or a share between
two); written whole, then renamed, so a reader never sees half of one.

    /usr/bin/python3 pyverbs_peer.py initiator DIR OPS
        Reads DIR/export.json (what ``RcExport.info()`` gives), writes
        DIR/peer.json (this QP's gid, qpn, psn, lid, mtu), waits for
        DIR/connected, then runs OPS, a JSON list of
        {"op": "write"|"read", "offset", "length", "seed"?, "imm"?}:
        a write sends pattern(length, seed) to addr + offset (WRITE WITH
        IMM when imm is given), a read fetches into a fresh buffer.
        DIR/result.json: per op {"status": its completion's ibv_wc_status
        (0 success, 10 remote access error...), "sha256": of what a read got}.

    /usr/bin/python3 pyverbs_peer.py target DIR LENGTH SEED
        Registers LENGTH bytes (REMOTE_READ | REMOTE_WRITE) holding
        pattern(LENGTH, SEED), writes DIR/peer.json (gid, qpn, psn, lid,
        mtu, addr, rkey, length), reads DIR/aiohixl.json (the RcPeer's
        endpoint), connects, writes DIR/ready, waits for DIR/done, and
        writes DIR/result.json: {"sha256": of its buffer then}.

Device: $AIOHIXL_RDMA_DEVICE or the first one, port 1, the first RoCE v2
GID with an IPv4-mapped address (as aiohixl chooses), else GID 0.
"""

import hashlib
import json
import os
import random
import socket
import sys
import time

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

PORT = 1
SYSFS = "/sys/class/infiniband"
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def pattern(n: int, seed: int) -> bytes:
    block = bytes((seed * 31 + i) & 0xFF for i in range(251))  # 251: prime, so offsets differ
    return (block * (n // 251 + 1))[:n]


def put_json(path: str, data: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.rename(path + ".tmp", path)


def wait_file(path: str, timeout: float = 300.0) -> str:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"pyverbs_peer: {path} did not appear within {timeout} s")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def choose_device() -> tuple[str, int]:
    name = os.environ.get("AIOHIXL_RDMA_DEVICE") or get_device_list()[0].name.decode()
    base = f"{SYSFS}/{name}/ports/{PORT}"
    best = 0
    for index in sorted(os.listdir(f"{base}/gids"), key=int):
        try:
            with open(f"{base}/gids/{index}") as f:
                gid = f.read().strip()
            with open(f"{base}/gid_attrs/types/{index}") as f:
                kind = f.read().strip()
        except OSError:
            continue
        if "v2" in kind and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            best = int(index)
            break
    return name, best


class Rc:
    """One RC QP, its CQ and PD."""

    def __init__(self, remote_access: int) -> None:
        name, self.gid_index = choose_device()
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64)
        cap = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        attr = QPAttr()
        attr.qp_access_flags = remote_access
        attr.port_num = PORT
        attr.pkey_index = 0
        self.qp.to_init(attr)
        port = self.ctx.query_port(PORT)
        self.mtu, self.lid = port.active_mtu, port.lid
        self.psn = random.getrandbits(24)
        gid = self.ctx.query_gid(PORT, self.gid_index)
        self.endpoint = {
            "gid": str(gid),
            "qpn": self.qp.qp_num,
            "psn": self.psn,
            "lid": self.lid,
            "mtu": MTU_BYTES[self.mtu],
        }

    def connect(self, peer: dict) -> None:
        attr = QPAttr()
        attr.path_mtu = min(self.mtu, {v: k for k, v in MTU_BYTES.items()}[peer.get("mtu", 1024)])
        attr.dest_qp_num = peer["qpn"]
        attr.rq_psn = peer["psn"]
        attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12
        route = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=self.gid_index, hop_limit=64)
        attr.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=route, dlid=peer.get("lid", 0))
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.sq_psn = self.psn
        attr.max_rd_atomic = 16
        self.qp.to_rts(attr)  # through RTR

    def run(self, opcode: int, mr: MR, n: int, rkey: int, raddr: int, imm: int | None = None) -> int:
        """One signalled work request; its completion's status."""
        wr = SendWR(wr_id=1, opcode=opcode, num_sge=1, sg=[SGE(mr.buf, n, mr.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        if imm is not None:
            wr.imm_data = socket.htonl(imm)  # the wire carries it big-endian
        wr.set_wr_rdma(rkey, raddr)
        self.qp.post_send(wr)
        while True:
            count, wcs = self.cq.poll()
            if count:
                return wcs[0].status


def initiator(folder: str, ops: list) -> None:
    export = json.loads(wait_file(f"{folder}/export.json"))
    rc = Rc(0)
    put_json(f"{folder}/peer.json", rc.endpoint)
    wait_file(f"{folder}/connected")
    rc.connect(export)
    results = []
    for op in ops:
        n = op["length"]
        mr = MR(rc.pd, max(n, 1), e.IBV_ACCESS_LOCAL_WRITE)
        raddr = export["addr"] + op["offset"]
        if op["op"] == "write":
            mr.write(pattern(n, op.get("seed", 0)), n)
            opcode = e.IBV_WR_RDMA_WRITE_WITH_IMM if "imm" in op else e.IBV_WR_RDMA_WRITE
            status = rc.run(opcode, mr, n, export["rkey"], raddr, op.get("imm"))
            results.append({"status": status})
        else:
            status = rc.run(e.IBV_WR_RDMA_READ, mr, n, export["rkey"], raddr)
            results.append({"status": status, "sha256": hashlib.sha256(mr.read(n, 0)).hexdigest()})
    put_json(f"{folder}/result.json", results)


def target(folder: str, length: int, seed: int) -> None:
    rc = Rc(e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ)
    mr = MR(rc.pd, length, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ)
    mr.write(pattern(length, seed), length)
    put_json(f"{folder}/peer.json", {**rc.endpoint, "addr": mr.buf, "rkey": mr.rkey, "length": length})
    rc.connect(json.loads(wait_file(f"{folder}/aiohixl.json")))
    put_json(f"{folder}/ready", {})
    wait_file(f"{folder}/done")
    put_json(f"{folder}/result.json", {"sha256": hashlib.sha256(mr.read(length, 0)).hexdigest()})


if __name__ == "__main__":
    if sys.argv[1:2] == ["initiator"] and len(sys.argv) == 4:
        initiator(sys.argv[2], json.loads(sys.argv[3]))
    elif sys.argv[1:2] == ["target"] and len(sys.argv) == 5:
        target(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(__doc__)
