"""Ranks, groups and a rendezvous store: the hixl-style functional API (docs/ranks.md)."""

from .context import Context, get, get_remote_mem, init, put
from .record import RankRecord
from .tcp import StoreServer

__all__ = ["Context", "init", "get_remote_mem", "put", "get", "RankRecord", "StoreServer"]
