"""What the rendezvous store keeps per rank, and its binary encoding.

A record is encoded with the control plane's Writer and decoded with its
bounded Reader (docs/ranks.md gives the layout); both stores keep these bytes
as they are. Nothing is pickled or JSON-decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from urllib.parse import parse_qs, unquote, urlsplit

from .._control import wire as w
from ..errors import InvalidArgument, ProtocolError

__all__ = ["RankRecord", "StoreURL", "parse_store_url", "MAX_REGIONS", "MAX_DESCRIPTOR"]

RECORD_VERSION = 1
MAX_REGIONS = 1024
MAX_DESCRIPTOR = 4096
MAX_RANK = (1 << 31) - 1


@dataclass(frozen=True)
class RankRecord:
    """One rank as the store holds it: who it is, where its agent listens, what it publishes."""

    rank: int
    group: str
    address: str  # host:port of its agent's listener
    agent_id: bytes  # 16 bytes: the incarnation (a restarted process has a new one)
    name: str  # its agent's name
    host: str  # machine id of its host
    pid: int
    world_size: int = 0  # 0: not given
    regions: dict[str, bytes] = field(default_factory=dict)  # published name -> region descriptor

    def encode(self) -> bytes:
        wr = w.Writer().u8(RECORD_VERSION).u32(self.rank).str(self.group).str(self.address).raw(self.agent_id)
        wr.str(self.name).str(self.host).u32(self.pid).u32(self.world_size).u16(len(self.regions))
        for name, desc in sorted(self.regions.items()):
            wr.str(name).blob(desc)
        return b"".join(wr.parts)

    @classmethod
    def decode(cls, data: bytes, what: str = "rank record") -> RankRecord:
        """Parse a record; anything malformed raises ProtocolError."""
        r = w.Reader(bytes(data), what)
        version = r.u8()
        if version != RECORD_VERSION:
            raise ProtocolError(f"{what}: record version {version}; this aiohixl reads {RECORD_VERSION}")
        rank, group, address, agent_id = r.u32(), r.str(), r.str(), r.raw(16)
        name, host, pid, world_size = r.str(), r.str(), r.u32(), r.u32()
        count = r.u16()
        if count > MAX_REGIONS or rank > MAX_RANK:
            raise ProtocolError(f"{what}: {count} regions for rank {rank}: out of range")
        regions: dict[str, bytes] = {}
        for _ in range(count):
            rname = r.str()
            if rname in regions:
                raise ProtocolError(f"{what}: region {rname!r} listed twice")
            regions[rname] = r.blob(MAX_DESCRIPTOR)
        r.end()
        return cls(rank, group, address, agent_id, name, host, pid, world_size, regions)

    @classmethod
    def decode_shared(cls, data: bytes, what: str = "rank record") -> RankRecord:
        """``decode``, once per process for the same bytes: the ranks of one process hear the same
        records from their store, and at hundreds of ranks decoding each copy was the cost."""
        data = bytes(data)
        rec = _decoded.get(data)
        if rec is None:
            if len(_decoded) >= _DECODED_MAX:
                _decoded.clear()
            rec = _decoded[data] = cls.decode(data, what)
        return rec

    def with_regions(self, regions: dict[str, bytes]) -> RankRecord:
        return replace(self, regions=dict(regions))

    def describe(self) -> str:
        return f"rank {self.rank} ({self.group}) at {self.address}, pid {self.pid}"


_decoded: dict[bytes, RankRecord] = {}  # decode_shared's records (immutable: shared by the stores of a process)
_DECODED_MAX = 65536


@dataclass(frozen=True)
class StoreURL:
    """A parsed ``tcp://HOST:PORT``, ``redis://[:PASSWORD@]HOST:PORT/DB[?lease=S]`` or
    ``etcd://[USER:PASSWORD@]HOST:PORT[/PREFIX][?lease=S]``."""

    url: str  # as given, for messages (a password is masked)
    scheme: str
    host: str
    port: int
    db: int = 0
    lease: float = 15.0  # redis, etcd: seconds an entry lives without a refresh
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    prefix: str = ""  # etcd: the keys' prefix

    def __str__(self) -> str:
        return self.url


def parse_store_url(url: str, what: str) -> StoreURL:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"{what}: store URL {url!r}: {exc}") from None
    shown = url if parts.password is None else url.replace(f":{parts.password}@", ":***@", 1)
    if parts.scheme not in ("tcp", "redis", "etcd") or not parts.hostname:
        raise InvalidArgument(
            f"{what}: store URL {shown!r} is not tcp://HOST:PORT, redis://HOST:PORT/DB or etcd://HOST:PORT[/PREFIX]"
        )
    if parts.scheme == "tcp":
        if port is None or parts.path not in ("", "/") or parts.query:
            raise InvalidArgument(f"{what}: store URL {shown!r}: give tcp://HOST:PORT")
        return StoreURL(shown, "tcp", parts.hostname, port)
    query = parse_qs(parts.query)
    if set(query) - {"lease"}:
        raise InvalidArgument(f"{what}: store URL {shown!r}: the only option is lease=SECONDS")
    lease = 15.0
    if "lease" in query:
        try:
            lease = float(query["lease"][-1])
        except ValueError:
            lease = -1.0
        if not 0.5 <= lease <= 3600:
            raise InvalidArgument(f"{what}: store URL {shown!r}: lease must be 0.5 to 3600 seconds")
    if parts.scheme == "etcd":
        # etcd grants whole seconds; below its floor (2 s with the default election timeout) it grants the floor
        if lease != int(lease) or lease < 1:
            raise InvalidArgument(f"{what}: store URL {shown!r}: an etcd lease is a whole number of seconds")
        prefix = parts.path.strip("/") or "aiohixl"
        return StoreURL(
            shown, "etcd", parts.hostname, port or 2379, 0, lease, parts.username, parts.password, unquote(prefix)
        )
    db_text = parts.path.strip("/") or "0"
    if not db_text.isdigit():
        raise InvalidArgument(f"{what}: store URL {shown!r}: the database must be a number")
    return StoreURL(shown, "redis", parts.hostname, port or 6379, int(db_text), lease, parts.username, parts.password)
