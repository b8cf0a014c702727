"""aiohixl.integrations.vllm without vLLM: its settings, its messages and its rank groups."""

from __future__ import annotations

import pytest

import aiohixl
from aiohixl.integrations.vllm import _messages as m
from aiohixl.integrations.vllm._config import Layout, default_rank_base, group_name, parse_group, read_settings


def test_import_is_cheap_and_starts_nothing() -> None:
    import sys

    import aiohixl.integrations.vllm  # noqa: F401

    assert "vllm" not in sys.modules  # the connector class (and vLLM) load on first access only


def test_settings_defaults_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOHIXL_TOKEN", "t")
    s = read_settings({"store": "tcp://127.0.0.1:1"}, "p0")
    assert s.layerwise and s.transports == "auto" and s.rank_base == default_rank_base("p0") and s.trace is None
    assert read_settings({"store": "tcp://h:1", "transports": ["tcp"]}, "p0").transports == ("tcp",)
    with pytest.raises(aiohixl.InvalidArgument, match="unknown key"):
        read_settings({"store": "tcp://h:1", "layer_wise": False}, "p0")
    monkeypatch.delenv("AIOHIXL_STORE", raising=False)
    with pytest.raises(aiohixl.InvalidArgument, match="store"):
        read_settings({}, "p0")
    monkeypatch.delenv("AIOHIXL_TOKEN")
    with pytest.raises(aiohixl.InvalidArgument, match="AIOHIXL_TOKEN"):
        read_settings({"store": "tcp://h:1"}, "p0")


def test_rank_bases_of_engines_do_not_overlap() -> None:
    bases = sorted(default_rank_base(f"engine{i}") for i in range(64))
    assert all(b - a >= 1024 for a, b in zip(bases, bases[1:], strict=False))


def test_group_names_carry_role_engine_and_layout() -> None:
    layout = Layout("abc" * 20, "float32", 32, 32768, 4, 1, "cpu-vec")
    g = group_name("P", "p0", layout)
    assert len(g.encode()) <= 255
    assert parse_group(g) == ("P", "p0", layout.key())
    assert parse_group("decode") is None


def test_messages_round_trip_and_foreign_data_is_ignored() -> None:
    ids = [7, 8, 9, 3, 4, 100]
    data = m.encode("REG", "t1", blocks=m.runs(ids), first=2)
    msg = m.decode(data)
    assert msg is not None and msg["op"] == "REG" and msg["t"] == "t1" and m.unruns(msg["blocks"]) == ids
    assert m.runs(list(range(128))) == [[0, 128]]
    for junk in (b"kv:1:2", m.PREFIX + b"{", m.PREFIX + b'{"op":"RM","t":"x"}', m.PREFIX + b'{"op":"DONE","t":1}'):
        assert m.decode(junk) is None
