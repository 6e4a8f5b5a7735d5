"""`tandem profile --quick` against a tiny model: it starts a real cluster (`tandem serve`: Ray, redis-server, a
prefill and a decode node, the proxy), measures the handoff disaggregated and then colocated once the prefill node
has left, the prefill and decode points, and writes a profile that loads, with every point measured and a fit that
follows them."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark.profile import fit_errors, load_profile, worst_relative_error
from cluster.cli import main
from tests.fixtures.tiny_models import TinyModelFactory
from tests.integration.processes import pd_cluster

pytestmark = pytest.mark.integration


def test_quick_profile_of_a_tiny_model(tiny_model: TinyModelFactory, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_model("llama", max_position_embeddings=1024)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    out = tmp_path / "profile.json"
    code = main(["profile", "--quick", "--model", str(model), "--dtype", "float32", "--node-threads", "1",
                 "--node-cpus", "0.5", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                 "--num-kv-blocks", "256", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    profile = load_profile(out)

    node = profile.node
    assert (node.model, node.dtype, node.device, node.threads) == (model.name, "float32", "cpu", 1)
    assert (node.max_num_seqs, node.max_num_batched_tokens, node.num_kv_blocks, node.block_size) == (8, 256, 256, 16)
    assert profile.cores > 0 and profile.command.startswith("tandem profile --quick")
    points = profile.points
    # the tiny tokenizer adds no special token: the server counts the prompts as sent
    assert sorted((p.prompt_tokens, p.batch) for p in points.prefill) == [(16, 1), (16, 2), (64, 1), (64, 2)]
    assert [(d.batch, d.context) for d in points.decode] == [(1, 16 + 4), (4, 16 + 4)]
    assert [h.prompt_tokens for h in points.handoff] == [16, 64]
    assert all(p.ttft_s > 0 for p in points.prefill) and all(d.itl_s > 0 for d in points.decode)

    step = profile.step
    assert min(step.base_s, step.per_token_s, step.per_seq_s, step.per_attended_s, profile.request_s) >= 0
    assert profile.decode_step_s(4, 20) > 0 and profile.prefill_s(64) > 0
    # a loaded 2-core box makes a tiny model's milliseconds noisy: the bound is loose, the report is the check
    assert worst_relative_error(fit_errors(profile)) < 1.0, printed
    assert "worst relative error" in printed and f"wrote {out}" in printed


def test_profile_of_a_running_cluster(tiny_model: TinyModelFactory, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--base-url: a cluster someone else started (here P + D + proxy, every prompt disaggregated): its prefill and
    decode points, no handoff, the node's capacity from the flags (no --registry)."""
    model = tiny_model("llama", max_position_embeddings=1024)
    out, logs = tmp_path / "remote.json", tmp_path / "logs"
    logs.mkdir()
    with pd_cluster(model, "nixl", logs, node_flags=["--num-kv-blocks", "128"]) as url:
        code = main(["profile", "--quick", "--base-url", url, "--tokenizer", str(model), "--num-kv-blocks", "128",
                     "--decode-batches", "1,2,4", "-o", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed
    profile = load_profile(out)
    assert profile.node.num_kv_blocks == 128 and profile.node.model == model.name
    assert len(profile.points.prefill) == 4 and len(profile.points.decode) == 3 and not profile.points.handoff
    assert "no handoff points" in printed.err and profile.step.per_token_s + profile.step.base_s > 0
