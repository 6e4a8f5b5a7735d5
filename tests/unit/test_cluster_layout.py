"""How `tandem serve` shares one CPU machine's cores among its nodes (cluster/layout.py), and that the layout
reaches the node processes and the proxy as flags they parse."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.layout import CORES_PER_NODE, CpuLayout, cpu_layout, serve_layout
from cluster.pools import NodeLaunch, node_command
from cluster.serve import proxy_command
from node_common.options import add_node_args, parse_node_args
from proxy.routing.pd import add_routing_args
from settings import TREE_KEYS, ServeConfig, add_arguments, resolve


def serve_config(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServeConfig)
    return resolve(ServeConfig, vars(parser.parse_args(list(argv))), {}, TREE_KEYS)


def parsed_node(launch: NodeLaunch, role: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return parse_node_args(parser, node_command(launch, role, f"{role}-0", "127.0.0.1", 1)[3:])


def test_a_two_core_box_gives_the_decode_node_both_cores_and_its_prompts() -> None:
    assert cpu_layout(2, 1, 1, max_step_tokens=2048) == CpuLayout(prefill_threads=1, decode_threads=2,
                                                                  colocate_max_tokens=2048)


def test_decode_nodes_split_the_cores_when_they_prefill_themselves() -> None:
    layout = cpu_layout(4, 1, 2, max_step_tokens=512)
    assert (layout.prefill_threads, layout.decode_threads, layout.colocate_max_tokens) == (1, 2, 512)


def test_a_machine_with_cores_for_every_node_splits_them_evenly_and_keeps_the_proxys_threshold() -> None:
    layout = cpu_layout(2 * CORES_PER_NODE * 2, 1, 1, max_step_tokens=2048)
    assert layout == CpuLayout(2 * CORES_PER_NODE, 2 * CORES_PER_NODE, None)
    assert not layout.decode_prefills


@pytest.mark.parametrize("num_prefill, num_decode", [(0, 1), (0, 3), (2, 0)])
def test_a_single_pool_shares_the_cores_evenly(num_prefill: int, num_decode: int) -> None:
    layout = cpu_layout(6, num_prefill, num_decode, max_step_tokens=2048)
    share = 6 // (num_prefill + num_decode)
    assert layout == CpuLayout(share, share, None)


def test_more_nodes_than_cores_still_get_one_thread_each() -> None:
    layout = cpu_layout(1, 2, 3, max_step_tokens=2048)
    assert (layout.prefill_threads, layout.decode_threads) == (1, 1)


def test_node_threads_overrides_both_roles_and_the_step_comes_from_the_node_args() -> None:
    layout = serve_layout(serve_config("--node-threads", "3", "--node-args", "--max-num-batched-tokens 256"),
                          num_cpus=2)
    assert layout == CpuLayout(3, 3, 256)


def test_the_layouts_threads_reach_each_role_and_a_node_args_flag_wins() -> None:
    threads = {"prefill": 1, "decode": 2}
    launch = NodeLaunch(model="/m", registry_url="redis://r", num_threads=threads)
    assert (parsed_node(launch, "prefill").num_threads, parsed_node(launch, "decode").num_threads) == (1, 2)
    overridden = NodeLaunch(model="/m", registry_url="redis://r", num_threads=threads,
                            extra_args=("--num-threads", "5"))
    assert parsed_node(overridden, "decode").num_threads == 5
    assert parsed_node(NodeLaunch(model="/m", registry_url="redis://r"), "decode").num_threads is None


def test_a_node_refuses_zero_threads() -> None:
    launch = NodeLaunch(model="/m", registry_url="redis://r", extra_args=("--num-threads", "0"))
    with pytest.raises(SystemExit):
        parsed_node(launch, "decode")


def proxy_colocate_max_tokens(command: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_routing_args(parser)
    known, _ = parser.parse_known_args(command[3:])
    return int(known.colocate_max_tokens)


def test_the_proxy_colocates_as_the_layout_says_unless_the_proxy_args_say_otherwise() -> None:
    layout = CpuLayout(1, 2, 2048)
    assert proxy_colocate_max_tokens(proxy_command(serve_config(), Path("/m"), "m", "redis://r", layout)) == 2048
    mine = serve_config("--proxy-args", "--colocate-max-tokens 8")
    assert proxy_colocate_max_tokens(proxy_command(mine, Path("/m"), "m", "redis://r", layout)) == 8
    default = proxy_colocate_max_tokens(proxy_command(serve_config(), Path("/m"), "m", "redis://r", None))
    assert default == proxy_colocate_max_tokens(
        proxy_command(serve_config(), Path("/m"), "m", "redis://r", CpuLayout(4, 4, None)))


def test_the_proxy_exports_traces_where_the_nodes_do() -> None:
    """`tandem serve --otlp-traces-endpoint` reaches the proxy too: a trace without its root span is no trace."""
    from proxy.__main__ import parse_args

    traced = proxy_command(serve_config("--otlp-traces-endpoint", "http://collector:4318"), Path("/m"), "m",
                           "redis://r")
    assert parse_args(traced[3:])[1].otlp_traces_endpoint == "http://collector:4318"
    untraced = proxy_command(serve_config(), Path("/m"), "m", "redis://r")
    assert parse_args(untraced[3:])[1].otlp_traces_endpoint is None
