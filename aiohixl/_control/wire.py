"""The control protocol's frames: encoding and bounded, checked decoding.

A frame is ``u32 length | u8 type | body`` (little endian, length counts type
and body). Bodies are fixed fields, ``str`` (u16 length + UTF-8) and ``blob``
(u32 length + bytes). Decoding never trusts a length: every read is checked,
and trailing bytes are an error. Nothing is ever unpickled.
"""

from __future__ import annotations

import builtins
import struct
from typing import Any

from ..errors import ProtocolError

MAGIC = b"HXCP"
VERSION_MIN = 2
VERSION_MAX = 2

# Before authentication a peer may send only this much per frame.
MAX_UNAUTH_FRAME = 4096
MAX_FRAME = 1 << 20
MAX_STR = 1024

(
    HELLO,
    CHALLENGE,
    AUTH,
    WELCOME,
    ERROR,
    LOOKUP,
    REGION,
    WITHDRAWN,
    PING,
    BYE,
    DATA_OK,
    WITHDRAWN_ACK,
    VERBS_QP,
    VERBS_QP_OK,
    STORE_JOIN,
    STORE_REPLY,
    STORE_PUBLISH,
    STORE_RECORD,
    STORE_GONE,
    STORE_ARRIVE,
    STORE_RELEASE,
    STORE_WATCH,
    STORE_MEMBERS,
) = range(1, 24)
NAMES = {
    HELLO: "HELLO",
    CHALLENGE: "CHALLENGE",
    AUTH: "AUTH",
    WELCOME: "WELCOME",
    ERROR: "ERROR",
    LOOKUP: "LOOKUP",
    REGION: "REGION",
    WITHDRAWN: "WITHDRAWN",
    PING: "PING",
    BYE: "BYE",
    DATA_OK: "DATA_OK",
    WITHDRAWN_ACK: "WITHDRAWN_ACK",
    VERBS_QP: "VERBS_QP",
    VERBS_QP_OK: "VERBS_QP_OK",
    # the rendezvous store's frames (aiohixl/ranks/tcp.py, docs/ranks.md), on connections of role STORE
    STORE_JOIN: "STORE_JOIN",
    STORE_REPLY: "STORE_REPLY",
    STORE_PUBLISH: "STORE_PUBLISH",
    STORE_RECORD: "STORE_RECORD",
    STORE_GONE: "STORE_GONE",
    STORE_ARRIVE: "STORE_ARRIVE",
    STORE_RELEASE: "STORE_RELEASE",
    STORE_WATCH: "STORE_WATCH",
    STORE_MEMBERS: "STORE_MEMBERS",
}

ROLE_CONTROL, ROLE_DATA, ROLE_STORE = 0, 1, 2
ROLE_NAMES = {ROLE_CONTROL: "control", ROLE_DATA: "data", ROLE_STORE: "store"}
ERR_AUTH, ERR_VERSION, ERR_SESSION, ERR_ROLE = 1, 2, 4, 5  # 3 was ERR_PROTOCOL, never sent
LOOKUP_OK, LOOKUP_UNKNOWN = 0, 1
BY_NAME, BY_ID = 0, 1


_HEAD = struct.Struct("<IB")


class Writer:
    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, v: int) -> Writer:
        self.parts.append(struct.pack("<B", v))
        return self

    def u16(self, v: int) -> Writer:
        self.parts.append(struct.pack("<H", v))
        return self

    def u32(self, v: int) -> Writer:
        self.parts.append(struct.pack("<I", v))
        return self

    def u64(self, v: int) -> Writer:
        self.parts.append(struct.pack("<Q", v))
        return self

    def raw(self, b: bytes) -> Writer:
        self.parts.append(bytes(b))
        return self

    def str(self, s: str) -> Writer:
        b = s.encode()
        if len(b) > MAX_STR:
            raise ValueError(f"string of {len(b)} bytes exceeds {MAX_STR}")
        return self.u16(len(b)).raw(b)

    def blob(self, b: bytes) -> Writer:
        return self.u32(len(b)).raw(b)

    def strs(self, items: Any) -> Writer:
        items = list(items)
        self.u8(len(items))
        for s in items:
            self.str(s)
        return self

    def frame(self, ftype: int) -> bytes:
        body = b"".join(self.parts)
        return _HEAD.pack(len(body) + 1, ftype) + body


class Reader:
    __slots__ = ("data", "pos", "what")

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolError(f"{self.what}: frame truncated")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def u8(self) -> int:
        return self.raw(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self.raw(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.raw(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.raw(8))[0]

    def str(self) -> str:
        n = self.u16()
        if n > MAX_STR:
            raise ProtocolError(f"{self.what}: string of {n} bytes exceeds {MAX_STR}")
        try:
            return self.raw(n).decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"{self.what}: string is not UTF-8") from None

    def blob(self, limit: int = MAX_FRAME) -> bytes:
        n = self.u32()
        if n > limit:
            raise ProtocolError(f"{self.what}: blob of {n} bytes exceeds {limit}")
        return self.raw(n)

    def strs(self) -> list[builtins.str]:
        return [self.str() for _ in range(self.u8())]

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{self.what}: {len(self.data) - self.pos} trailing bytes")


def split_head(head: bytes, limit: int) -> tuple[int, int]:
    """Body length and type of a frame from its 5-byte head, checked against ``limit``."""
    length, ftype = _HEAD.unpack(head)
    if length < 1 or length > limit:
        raise ProtocolError(f"frame of {length} bytes (limit {limit})")
    if ftype not in NAMES:
        raise ProtocolError(f"unknown frame type {ftype}")
    return length - 1, ftype


# How other protocols begin (at most HEAD_SIZE bytes each), for saying what answered instead of
# an aiohixl peer: a frame head read from them is nonsense ("HTTP" read as a length).
_FOREIGN = (
    (b"HTTP/", "HTTP"),
    (b"GET ", "HTTP"),
    (b"POST ", "HTTP"),
    (b"PUT ", "HTTP"),
    (b"HEAD ", "HTTP"),
    (b"PRI *", "HTTP/2"),
    (b"SSH-", "SSH"),
    (b"\x15\x03", "TLS"),
    (b"\x16\x03", "TLS"),
    (b"-ERR", "Redis"),
)


def foreign_head(head: bytes) -> str:
    """Words on a peer's first bytes that are no aiohixl frame: which protocol they look like."""
    name = next((name for prefix, name in _FOREIGN if head.startswith(prefix)), None)
    return (
        f"the first bytes ({head!r}) look like {name}" if name else f"the first bytes ({head!r}) are no aiohixl frame"
    )


HEAD_SIZE = _HEAD.size
DATA_OK_FRAME = Writer().frame(DATA_OK)
