"""Raw RC peers off an RDMA device: the connection facts parsed strictly, the API refusing clearly.

What moves bytes is tested against pyverbs over rxe0 in tests/rdma/test_raw_rc.py."""

import json

import pytest

import aiohixl
from aiohixl import RcEndpoint

GID = "0000:0000:0000:0000:0000:ffff:c000:0201"


def test_an_endpoint_round_trips_through_json():
    end = RcEndpoint.parse({"gid": GID.replace(":", ""), "qpn": 17, "psn": 0xABCDEF, "mtu": 4096, "extra": 1})
    assert end == RcEndpoint(GID, 17, 0xABCDEF, 0, 4096)
    assert RcEndpoint.parse(end.to_json()) == end
    assert json.loads(end.to_json()) == {"gid": GID, "qpn": 17, "psn": 0xABCDEF, "lid": 0, "mtu": 4096}


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        "[1, 2]",
        {"qpn": 1, "psn": 1},
        {"gid": "zz", "qpn": 1, "psn": 1},
        {"gid": GID, "qpn": 1 << 24, "psn": 1},
        {"gid": GID, "qpn": True, "psn": 1},
        {"gid": GID, "qpn": 1, "psn": "1"},
        {"gid": GID, "qpn": 1, "psn": 1, "mtu": 1500},
    ],
)
def test_a_malformed_endpoint_is_refused(bad):
    with pytest.raises(aiohixl.InvalidArgument):
        RcEndpoint.parse(bad)


async def test_without_verbs_export_and_rc_peer_say_why():
    async with aiohixl.Agent(transports=("tcp",)) as agent:
        region = agent.allocate(4096, access="rw")
        with pytest.raises(aiohixl.InvalidArgument, match="verbs"):
            agent.export_rc(region, access="rw")
        with pytest.raises(aiohixl.InvalidArgument, match="verbs"):
            agent.rc_peer()
