"""bench/kv_handoff_gpu.py on CPU: its block picks, its byte check, and a smoke run over NIXL (the figures come from
the GPU machine; here only that it runs, and that it cannot report a move that did not happen)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.kv_handoff_gpu import make_cases, parse_variant, scattered_ids
from bench.kv_handoff_worker import Case, WorkerSpec, _DeviceCopy, _measure_case, block_digests

ROOT = Path(__file__).resolve().parents[2]


def run_lengths(ids: np.ndarray) -> np.ndarray:
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return np.diff(np.concatenate(([0], breaks, [ids.size])))


def test_scattered_blocks_are_distinct_and_come_in_short_runs() -> None:
    rng = np.random.default_rng(0)
    ids = scattered_ids(rng, pool_blocks=2048, num_blocks=1024)
    assert ids.size == 1024 and np.unique(ids).size == 1024 and ids.min() >= 0 and ids.max() < 2048
    lengths = run_lengths(ids)
    # runs of 1-4 blocks; two runs only join when the shuffle happens to put neighbours in order
    assert lengths[lengths <= 4].sum() >= 0.95 * ids.size and 2.0 <= lengths.mean() <= 3.0


def test_cases_pair_each_prompt_scattered_and_contiguous() -> None:
    cases = make_cases([64, 256], pool_blocks=32, seed=0)
    assert [(c.tokens, c.layout, len(c.remote_ids)) for c in cases] == [
        (64, "scattered", 4), (64, "contiguous", 4), (256, "scattered", 16), (256, "contiguous", 16)]
    assert cases[3].remote_ids == tuple(range(16)) and cases[3].local_ids == tuple(range(16, 32))


def test_a_variant_names_its_ucx_settings_and_environment() -> None:
    variant = parse_variant("name=strict ucx_config=PROTO_EMULATION_ENABLE=n,RNDV_THRESH=inf "
                            "env:UCX_TLS=cuda_ipc,cuda_copy,tcp")
    assert (variant.name, variant.ucx_config) == ("strict", "PROTO_EMULATION_ENABLE=n,RNDV_THRESH=inf")
    assert variant.env == {"UCX_TLS": "cuda_ipc,cuda_copy,tcp"}
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        parse_variant("name=bad ucx_config=TLS=cuda_ipc,cuda_copy")


def test_block_digests_are_position_weighted_sums_of_the_words() -> None:
    pool = torch.randn((4, 2, 2, 16, 8, 128), dtype=torch.bfloat16)
    words = pool.view(4, -1).view(torch.int32).numpy().astype(np.int64)
    weights = np.arange(1, words.shape[1] + 1, dtype=np.int64)
    with np.errstate(over="ignore"):  # both sides wrap around in int64
        expected = [int((words[i] * weights).sum()) for i in (3, 0)]
    assert block_digests(pool, [3, 0]) == expected
    swapped = pool.clone()
    flat = swapped.view(4, -1).view(torch.int32)
    flat[0, [5, 6]] = flat[0, [6, 5]]
    assert block_digests(swapped, [0])[0] != block_digests(pool, [0])[0]


class _CopyThatDoesNotHappen(_DeviceCopy):
    def move(self, case: Case) -> float:
        return 1e-3


def test_a_move_that_does_not_land_fails_the_case() -> None:
    spec = WorkerSpec(backend="copy", device="cpu", num_layers=1, pool_blocks=8, cases=(), warmup=0, repeats=1)
    from bench.kv_handoff_worker import make_pool

    case = Case(16, "scattered", (0, 3, 4), (5, 1, 2))
    assert _measure_case(_DeviceCopy(spec, make_pool(spec, seed=2, side="decode")), case, spec)["verified"]
    with pytest.raises(RuntimeError, match="did not land"):
        _measure_case(_CopyThatDoesNotHappen(spec, make_pool(spec, seed=2, side="decode")), case, spec)


def test_the_bench_runs_on_cpu_over_nixl_read_and_write(tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    completed = subprocess.run(
        [sys.executable, "bench/kv_handoff_gpu.py", "--device", "cpu", "--backends", "nixl,nixl-write,no-such",
         "--prompt-tokens", "64", "--repeats", "2", "--warmup", "1", "--json", str(out),
         "--variant", "name=tcp ucx_config=TLS=tcp"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["backend"], r["op"], r["layout"]): r for r in result["rows"]}
    assert set(rows) == {(backend, op, layout) for backend, op in (("copy", "copy"), ("nixl", "READ"),
                                                                   ("nixl-write", "WRITE"))
                         for layout in ("scattered", "contiguous")}
    assert all(r["verified"] and r["blocks"] == 4 and r["bytes"] == 4 * 2 * 2 * 16 * 8 * 128 * 2
               for r in rows.values())
    assert rows[("nixl", "READ", "contiguous")]["descriptors"] == 1
    assert rows[("nixl", "READ", "contiguous")]["backend_params"] == {"ucx_devices": "lo", "engine_config": "TLS=tcp"}
    assert rows[("nixl-write", "WRITE", "contiguous")]["backend_params"]["engine_config"] == "TLS=tcp"
    assert [s["backend"] for s in result["skipped"]] == ["no-such"]
    assert completed.stdout.splitlines()[0].startswith("| variant | backend | op |")
