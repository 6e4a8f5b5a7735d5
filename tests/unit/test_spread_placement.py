"""Where `tandem serve --placement spread` puts a node (cluster/pools.py spread_host), and the role resources'
parsing (settings/serve.py parse_resources)."""

from __future__ import annotations

import pytest

from cluster.pools import spread_host
from settings import ConfigError
from settings.serve import parse_resources

NEED = {"CPU": 0.5}


def test_one_machine_is_left_to_ray() -> None:
    assert spread_host("decode", NEED, {"10.0.0.1": {"CPU": 8}}, []) is None


def test_a_decode_node_goes_apart_from_the_prefill_nodes() -> None:
    hosts = {"10.0.0.1": {"CPU": 8}, "10.0.0.2": {"CPU": 2}}
    # the emptier machine holds the prefill node: the decode node takes the other one, though it has less CPU
    assert spread_host("decode", NEED, hosts, [("10.0.0.1", "prefill", NEED)]) == "10.0.0.2"
    # a second prefill node spreads too: the machine with fewer nodes, before the one with more room
    assert spread_host("prefill", NEED, hosts, [("10.0.0.1", "prefill", NEED)]) == "10.0.0.2"
    # with a decode node on each machine, the prefill node goes where there is more room
    both = [("10.0.0.1", "decode", NEED), ("10.0.0.2", "decode", NEED)]
    assert spread_host("prefill", NEED, hosts, both) == "10.0.0.1"


def test_fewest_nodes_first_then_most_room_and_never_a_full_machine() -> None:
    hosts = {"a": {"CPU": 4}, "b": {"CPU": 4}, "c": {"CPU": 1}}
    placed = [("a", "decode", NEED), ("a", "decode", NEED), ("b", "decode", NEED)]
    assert spread_host("decode", NEED, hosts, placed) == "c"  # no node there yet
    full = [*placed, ("c", "decode", {"CPU": 1.0})]
    assert spread_host("decode", NEED, hosts, full) == "b"  # c has no room left; b holds fewer nodes than a
    assert spread_host("decode", {"CPU": 5}, hosts, []) is None  # no machine has room: Ray decides (and waits)


def test_role_resources_are_custom_positive_amounts() -> None:
    assert parse_resources('{"prefill-host": 1}', "--prefill-resources") == {"prefill-host": 1.0}
    for bad in ("nope", "[]", "{}", '{"CPU": 1}', '{"node:10.0.0.1": 1}', '{"x": 0}', '{"x": true}'):
        with pytest.raises(ConfigError):
            parse_resources(bad, "--prefill-resources")
