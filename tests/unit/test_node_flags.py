"""The nodes' device and GPU-share flags (--device, --gpu-memory-utilization, --load-format, --enforce-eager): what
a node makes of them, what `tandem serve` hands each node from its placement, and the clear errors for what a
machine cannot run."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cluster.pools import NodeLaunch, node_command
from node_common.options import add_node_args, engine_config, load_engine, parse_node_args
from settings import TREE_KEYS, ConfigError, ServeConfig, add_arguments, resolve
from tests.fixtures.tiny_models import TinyModelFactory

ROOT = Path(__file__).resolve().parents[2]


def node_args(*argv: str, model: str = "/m") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return parse_node_args(parser, ["--model", model, "--port", "1", *argv])


def serve_config(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServeConfig)
    return resolve(ServeConfig, vars(parser.parse_args(list(argv))), {}, TREE_KEYS)


def launched_node(config: ServeConfig, gpus_on_machine: bool) -> argparse.Namespace:
    """What a node of `tandem serve` parses, on a machine with GPUs or without (as cluster/serve.py builds it)."""
    launch = NodeLaunch(model="/m", registry_url="redis://r", cluster=config.cluster,
                        gpus_per_rank=(config.node_gpus or 0.0) if gpus_on_machine else 0.0,
                        gpu_memory_utilization=config.node_gpu_memory_utilization(),
                        extra_args=tuple(config.node_args.split()))
    command = node_command(launch, "prefill", "prefill-0", "127.0.0.1", 1)
    assert command[1:3] == ["-m", "prefill_node"]
    return node_args(*command[5:])  # past `--model /m`: node_args gives its own


def test_node_engine_flags_reach_the_engine_config() -> None:
    cfg = engine_config(node_args("--device", "cuda:1", "--gpu-memory-utilization", "0.45", "--load-format", "dummy",
                                  "--enforce-eager"))
    assert (cfg.device, cfg.gpu_memory_utilization, cfg.load_format, cfg.enforce_eager) == ("cuda:1", 0.45, "dummy",
                                                                                              True)


def test_node_engine_flags_default_to_the_offline_llms() -> None:
    cfg = engine_config(node_args())
    assert (cfg.device, cfg.gpu_memory_utilization, cfg.load_format, cfg.enforce_eager) == ("auto", 0.9, "auto",
                                                                                              False)


def test_serve_puts_each_node_on_its_gpu_with_its_share_of_the_memory() -> None:
    node = launched_node(serve_config("--gpu-memory-utilization", "0.4").placed_on(2), gpus_on_machine=True)
    assert (node.device, node.gpu_memory_utilization) == ("cuda", 0.4)
    # nodes sharing a GPU take their part of 0.9 unless told
    node = launched_node(serve_config("--node-gpus", "0.5"), gpus_on_machine=True)
    assert (node.device, node.gpu_memory_utilization) == ("cuda", 0.45)
    node = launched_node(serve_config("--node-gpus", "0.25", "--gpu-memory-utilization", "0.2"), gpus_on_machine=True)
    assert node.gpu_memory_utilization == 0.2
    node = launched_node(serve_config().placed_on(2), gpus_on_machine=True)  # a GPU each: the node's default
    assert (node.device, node.gpu_memory_utilization) == ("cuda", 0.9)


@pytest.mark.parametrize(("argv", "num_gpus", "node_gpus"), [
    ((), 1, 0.5),  # one prefill + one decode node on one GPU: half each
    ((), 2, 1.0),
    (("--decode-nodes", "2"), 2, 0.5),  # 3 nodes on 2 GPUs: 2 per GPU
    (("--tp", "2"), 4, 1.0),
    (("--node-gpus", "1"), 1, 1.0),  # the user's choice stands (and tandem serve says it does not fit)
])
def test_serve_shares_the_gpus_when_there_are_fewer_than_nodes(argv: tuple[str, ...], num_gpus: int,
                                                              node_gpus: float) -> None:
    config = serve_config(*argv).placed_on(num_gpus)
    assert config.node_gpus == node_gpus
    if node_gpus < 1 and "--node-gpus" not in argv:
        assert config.node_gpu_memory_utilization() == round(0.9 * node_gpus, 4)


def test_serve_runs_nodes_on_cpu_without_gpus_or_with_node_gpus_0() -> None:
    for config, gpus in ((serve_config("--gpu-memory-utilization", "0.4"), False), (serve_config("--node-gpus", "0"),
                                                                                     True)):
        node = launched_node(config, gpus_on_machine=gpus)
        assert node.device == "cpu" and engine_config(node).device == "cpu"


def test_serve_passes_load_format_and_enforce_eager_through_node_args() -> None:
    node = launched_node(serve_config("--node-args", "--load-format dummy --enforce-eager"), gpus_on_machine=True)
    assert (node.load_format, node.enforce_eager) == ("dummy", True)


@pytest.mark.parametrize(("argv", "message"), [
    (["--node-args", "--device cuda:1"], "tandem serve sets each node's --device itself: use its --node-gpus"),
    (["--node-args=--gpu-memory-utilization=0.3"], "sets each node's --gpu-memory-utilization itself"),
    (["--node-gpus", "1.5"], "a share of one GPU or whole GPUs, not 1.5"),
    (["--gpu-memory-utilization", "1.2"], "at most 1, got 1.2"),
    (["--gpu-memory-utilization", "0"], "must be at least 0.01"),
    (["--node-gpus", "0.5", "--gpu-memory-utilization", "0.9"], "more than a node's share of its GPU"),
])
def test_serve_refuses_device_and_share_settings_that_cannot_work(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        serve_config(*argv)


def test_whole_gpus_per_node_are_accepted() -> None:
    assert serve_config("--node-gpus", "2").node_gpus == 2.0


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "tpu"], "prefill node: cannot start the engine: device must be auto, cpu, cuda or cuda:N"),
    (["--gpu-memory-utilization", "1.5"], "cannot start the engine: gpu_memory_utilization must be a fraction"),
])
def test_a_node_refuses_bad_device_flags_with_one_line(tiny_model: TinyModelFactory, argv: list[str],
                                                       message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        load_engine(node_args(*argv, model=str(tiny_model("llama"))), "prefill")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_node_asked_for_cuda_on_a_machine_without_it_exits_with_the_reason(tiny_model: TinyModelFactory) -> None:
    done = subprocess.run([sys.executable, "-m", "decode_node", "--model", str(tiny_model("llama")), "--port", "1",
                           "--device", "cuda"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "decode node: cannot start the engine: device 'cuda': this machine has no CUDA device" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("argv", "prefill_tp", "decode_tp"), [
    (("--tp", "2"), 2, 2),
    (("--prefill-tp", "2"), 2, 1),
    (("--tp", "2", "--decode-tp", "1"), 2, 1),
])
def test_serve_gives_each_role_its_tensor_parallel_size(argv: tuple[str, ...], prefill_tp: int, decode_tp: int) -> None:
    config = serve_config(*argv)
    launch = NodeLaunch(model="/m", registry_url="redis://r", cluster=config.cluster, tp=config.tp,
                        role_tp={role: config.tp_of(role) for role in ("prefill", "decode")})
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        node = node_args(*node_command(launch, role, f"{role}-0", "127.0.0.1", 1)[5:])
        assert engine_config(node).tensor_parallel_size == tp
    # GPUs: a rank each, counted per role (2 prefill ranks + 1 decode rank fit 3 GPUs whole)
    assert serve_config("--prefill-tp", "2").placed_on(3).node_gpus == 1.0


def test_node_tp_flag_and_its_alias_set_the_engines_tensor_parallel_size() -> None:
    assert engine_config(node_args("--tp", "2")).tensor_parallel_size == 2
    assert engine_config(node_args("--tensor-parallel-size", "4")).tensor_parallel_size == 4
    assert engine_config(node_args()).tensor_parallel_size == 1


def test_a_node_builds_its_engine_on_the_thread_that_runs_it(tiny_model: TinyModelFactory,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # tensor-parallel workers die with the thread that spawned them, and an OpenMP team lives as long as the
    # thread that made it (AsyncEngine.load): the engine is built on the engine thread, and the loop runs there
    import engine.llm_engine

    built_on: list[threading.Thread] = []
    real = engine.llm_engine.LLMEngine

    def recording(config: object) -> object:
        built_on.append(threading.current_thread())
        return real(config)

    monkeypatch.setattr(engine.llm_engine, "LLMEngine", recording)
    loaded = load_engine(node_args(model=str(tiny_model("llama"))), "decode")
    try:
        assert isinstance(loaded.engine, real)
        assert built_on == [loaded._thread] and built_on[0] is not threading.current_thread()
        assert built_on[0].is_alive()  # waiting for start(), not gone
        loaded.start()
        assert loaded.healthy
    finally:
        loaded.stop()
    assert not built_on[0].is_alive()
