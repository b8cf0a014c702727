"""Region descriptors: the bytes that let a peer address a region.

Layout, version 2 (little endian)::

    magic    4s   b"HXRD"
    version  B    2
    access   B    Access flags
    kind     B    0 user memory, 1 memfd
    flags    B    0
    region   I    region id in its agent
    nbytes   Q
    address  Q    virtual address in the owner (RDMA addresses by it)
    key      Q    the region's secret: the owner refuses every access without it
    agent    16s  owner's identity
    name     H + utf-8
    keys     H + TLVs (type B, length H, value): transport keys

Nothing here is ever unpickled; every length is checked against the input.
A descriptor is a capability: whoever holds it can do to the region what its
access allows, and nobody can without it (or the region's published name).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .errors import InvalidDescriptor
from .memory import Access

__all__ = ["VERSION", "RegionInfo", "encode_info", "decode"]

MAGIC = b"HXRD"
VERSION = 2
_HEAD = struct.Struct("<4sBBBBIQQQ16s")
_LEN = struct.Struct("<H")
_KEY = struct.Struct("<BH")
_KINDS = {"cpu": 0, "memfd": 1}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
MAX_NAME = 255


@dataclass(frozen=True)
class RegionInfo:
    """What a descriptor says about a region."""

    agent_id: bytes
    region_id: int
    nbytes: int
    address: int
    access: Access
    kind: str
    name: str | None
    key: int = 0  # the owner's per-region secret, carried by every access
    keys: dict[int, bytes] = field(default_factory=dict)


def encode_info(info: RegionInfo) -> bytes:
    name = (info.name or "").encode()
    if len(name) > MAX_NAME:
        raise InvalidDescriptor(f"region name longer than {MAX_NAME} bytes")
    keys = b"".join(_KEY.pack(t, len(v)) + v for t, v in sorted(info.keys.items()))
    return b"".join(
        (
            _HEAD.pack(
                MAGIC,
                VERSION,
                int(info.access),
                _KINDS[info.kind],
                0,
                info.region_id,
                info.nbytes,
                info.address,
                info.key,
                info.agent_id,
            ),
            _LEN.pack(len(name)),
            name,
            _LEN.pack(len(keys)),
            keys,
        )
    )


def decode(data: bytes) -> RegionInfo:
    """Parse a descriptor; anything malformed raises InvalidDescriptor."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidDescriptor(f"a descriptor is bytes (Region.descriptor()), not {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEAD.size + 2 * _LEN.size:
        raise InvalidDescriptor(f"descriptor too short ({len(data)} bytes)")
    magic, version, access, kind, flags, region_id, nbytes, address, key, agent_id = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise InvalidDescriptor("not an aiohixl region descriptor (bad magic)")
    if version != VERSION:
        raise InvalidDescriptor(f"descriptor version {version}; this aiohixl reads {VERSION}")
    if access & ~int(Access.REMOTE_READ | Access.REMOTE_WRITE):
        raise InvalidDescriptor(f"unknown access bits {access:#x}")
    if kind not in _KIND_NAMES:
        raise InvalidDescriptor(f"unknown memory kind {kind}")
    if flags:
        raise InvalidDescriptor(f"unknown flags {flags:#x}")
    if nbytes >= 1 << 63:
        raise InvalidDescriptor(f"a region of {nbytes} bytes cannot exist")
    pos = _HEAD.size
    (name_len,) = _LEN.unpack_from(data, pos)
    pos += _LEN.size
    if pos + name_len + _LEN.size > len(data):
        raise InvalidDescriptor("descriptor truncated in the name")
    try:
        name = data[pos : pos + name_len].decode() or None
    except UnicodeDecodeError:
        raise InvalidDescriptor("region name is not UTF-8") from None
    pos += name_len
    (keys_len,) = _LEN.unpack_from(data, pos)
    pos += _LEN.size
    if pos + keys_len != len(data):
        raise InvalidDescriptor("descriptor length does not match its keys")
    keys: dict[int, bytes] = {}
    end = pos + keys_len
    while pos < end:
        if pos + _KEY.size > end:
            raise InvalidDescriptor("descriptor truncated in a transport key")
        ktype, klen = _KEY.unpack_from(data, pos)
        pos += _KEY.size
        if pos + klen > end:
            raise InvalidDescriptor("descriptor truncated in a transport key")
        if keys and ktype <= max(keys):
            raise InvalidDescriptor(f"transport key {ktype} out of order or repeated")
        keys[ktype] = data[pos : pos + klen]
        pos += klen
    return RegionInfo(
        agent_id=agent_id,
        region_id=region_id,
        nbytes=nbytes,
        address=address,
        access=Access(access),
        kind=_KIND_NAMES[kind],
        name=name,
        key=key,
        keys=keys,
    )
