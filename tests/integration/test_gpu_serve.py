"""Nodes started on a GPU the way `tandem serve` and the Helm chart start them: `--device cuda`, no index (Ray's
CUDA_VISIBLE_DEVICES picks the GPU). Since 07c0c8d such a node crashed at start ("Expected a torch.device with a
specified index"): the engine's device is now always indexed (engine/device.py). A prefill node, a decode node
(both on the one GPU, each with a share of its memory) and a proxy serve a greedy completion equal to
transformers'."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.device import resolve_device
from tests.fixtures.tiny_models import TinyModelFactory, hf_greedy
from tests.integration.processes import pd_cluster

pytestmark = [pytest.mark.gpu, pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_without_an_index_names_the_current_device() -> None:
    device = resolve_device("cuda")
    assert device.index == torch.cuda.current_device()
    torch.cuda.set_device(device)  # what a node does on its KV-registration thread: it used to raise here
    assert resolve_device("auto") == device


def test_nodes_started_with_device_cuda_serve_transformers_greedy_tokens(tiny_model: TinyModelFactory,
                                                                        tmp_path_factory: pytest.TempPathFactory
                                                                        ) -> None:
    model = tiny_model("llama")
    prompt = list(range(30, 46))
    (expected,) = hf_greedy(model, [prompt], 8)
    flags = ["--device", "cuda", "--gpu-memory-utilization", "0.3"]  # two nodes share the GPU
    with pd_cluster(model, "ipc", tmp_path_factory.mktemp("gpu-serve-logs"), flags) as url:
        answer = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}).json()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    assert answer["choices"][0]["text"] == tokenizer.decode(expected), answer
