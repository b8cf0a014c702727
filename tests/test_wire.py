"""The control protocol's frames in-process: round trips, and malformed input refused as
ProtocolError (never another exception, never a read past the frame)."""

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiohixl import ProtocolError
from aiohixl._control import wire as w

FIELDS = st.lists(
    st.one_of(
        st.tuples(st.just("u8"), st.integers(0, 0xFF)),
        st.tuples(st.just("u16"), st.integers(0, 0xFFFF)),
        st.tuples(st.just("u32"), st.integers(0, 0xFFFFFFFF)),
        st.tuples(st.just("u64"), st.integers(0, 0xFFFFFFFFFFFFFFFF)),
        st.tuples(st.just("str"), st.text(max_size=200).filter(lambda s: len(s.encode()) <= w.MAX_STR)),
        st.tuples(st.just("blob"), st.binary(max_size=300)),
        st.tuples(st.just("strs"), st.lists(st.text(max_size=20), max_size=5)),
    ),
    max_size=12,
)


def encode(fields, ftype: int) -> bytes:
    wr = w.Writer()
    for kind, value in fields:
        getattr(wr, kind)(value)
    return wr.frame(ftype)


def decode(frame: bytes, limit: int = w.MAX_FRAME) -> tuple[int, w.Reader]:
    n, ftype = w.split_head(frame[: w.HEAD_SIZE], limit)
    assert len(frame) == w.HEAD_SIZE + n
    return ftype, w.Reader(frame[w.HEAD_SIZE :], w.NAMES[ftype])


@given(FIELDS, st.sampled_from(sorted(w.NAMES)))
def test_every_field_round_trips(fields, ftype):
    got_type, r = decode(encode(fields, ftype))
    assert got_type == ftype
    assert [(kind, getattr(r, kind)()) for kind, _ in fields] == fields
    r.end()


@given(FIELDS.filter(bool), st.data())
def test_a_truncated_body_is_a_protocol_error(fields, data):
    body = encode(fields, w.LOOKUP)[w.HEAD_SIZE :]
    cut = data.draw(st.integers(0, len(body) - 1)) if body else 0
    r = w.Reader(body[:cut], "LOOKUP")
    with pytest.raises(ProtocolError, match="LOOKUP: frame truncated|LOOKUP: string"):
        for kind, _ in fields:
            getattr(r, kind)()
        r.end()  # every field read from fewer bytes than written: something is missing


@given(FIELDS, st.binary(min_size=1, max_size=16))
def test_trailing_bytes_are_a_protocol_error(fields, extra):
    body = encode(fields, w.REGION)[w.HEAD_SIZE :] + extra
    r = w.Reader(body, "REGION")
    for kind, _ in fields:
        getattr(r, kind)()
    with pytest.raises(ProtocolError, match=f"REGION: {len(extra)} trailing bytes"):
        r.end()


@given(st.binary(min_size=w.HEAD_SIZE, max_size=w.HEAD_SIZE))
def test_any_head_is_accepted_only_within_its_limit_and_known_types(head):
    length, ftype = struct.unpack("<IB", head)
    try:
        n, got = w.split_head(head, w.MAX_UNAUTH_FRAME)
    except ProtocolError:
        assert not 1 <= length <= w.MAX_UNAUTH_FRAME or ftype not in w.NAMES
    else:
        assert (n, got) == (length - 1, ftype) and got in w.NAMES


def test_malformed_fields_name_the_frame():
    with pytest.raises(ProtocolError, match="frame of 1347703880 bytes"):  # "HTTP" read as a length
        w.split_head(b"HTTP/", w.MAX_UNAUTH_FRAME)
    with pytest.raises(ProtocolError, match="frame of 0 bytes"):
        w.split_head(struct.pack("<IB", 0, w.PING), w.MAX_FRAME)
    with pytest.raises(ProtocolError, match="unknown frame type 200"):
        w.split_head(struct.pack("<IB", 1, 200), w.MAX_FRAME)
    too_long = struct.pack("<H", w.MAX_STR + 1) + bytes(w.MAX_STR + 1)
    with pytest.raises(ProtocolError, match="HELLO: string of 1025 bytes exceeds 1024"):
        w.Reader(too_long, "HELLO").str()
    with pytest.raises(ProtocolError, match="WELCOME: string is not UTF-8"):
        w.Reader(struct.pack("<H", 2) + b"\xff\xfe", "WELCOME").str()
    with pytest.raises(ProtocolError, match="REGION: blob of 5000 bytes exceeds 4096"):
        w.Reader(struct.pack("<I", 5000) + bytes(5000), "REGION").blob(4096)
    with pytest.raises(ProtocolError, match="AUTH: frame truncated"):
        w.Reader(struct.pack("<I", 10) + bytes(3), "AUTH").blob()
    with pytest.raises(ValueError, match="exceeds 1024"):  # the writer refuses what a reader would
        w.Writer().str("x" * (w.MAX_STR + 1))
