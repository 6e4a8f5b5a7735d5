"""Can a batch-256 decode layer hide its small GEMMs under the decode attention? (issue 12, GPU offline goal)

    python3 bench/h200/overlap_probe.py [--batch 256 --context 1536 --layers 8]

At batch 256 a decode layer's GEMMs are compute-bound (qkv, o_proj, gate_up, down: ~185 us a layer on the H200,
against ~100 us to read their weights) while the attention is bound by its K/V reads (~370 us). Splitting the whole
batch into two micro-batches would read every weight twice, which costs more than it hides (16 GB a step). But
qkv and o_proj can be split by rows without reading more: half B's qkv runs while half A's attention reads K/V,
half A's o_proj while half B's attends; their weights (50 and 34 MB) stay in L2 between the halves. The MLP stays
one GEMM over the whole batch. This probe times one layer (qkv, attention, o_proj, gate_up, SiLU-and-mul, down;
the norms, RoPE and the K/V store left out) captured in a CUDA graph, serial against the split schedule on two
streams, with the weights of `--layers` layers in rotation so that no layer's weights stay in L2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.kernels.decode import paged_decode_attention  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4096, 14336, 32, 8, 128, 16


def make_layers(n: int, dev: torch.device) -> list[dict[str, torch.Tensor]]:
    def w(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16) * in_f ** -0.5
    return [{"qkv": w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": w(HIDDEN, HEADS * HEAD_DIM),
             "gate_up": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER)} for _ in range(n)]


class Layer:
    """One decode layer's buffers and its two schedules; every tensor preallocated for graph capture."""

    def __init__(self, batch: int, context: int, num_layers: int, dev: torch.device) -> None:
        self.batch = batch
        blocks = context // PAGE
        # one K/V cache per rotated layer would not fit; every layer reads the same (much larger than L2) cache
        self.k_cache = torch.randn(batch * blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        self.v_cache = torch.randn_like(self.k_cache)
        self.tables = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
        self.seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        self.max_seq = context
        self.layers = make_layers(num_layers, dev)
        self.x = torch.randn(batch, HIDDEN, device=dev, dtype=torch.bfloat16)
        self.qkv = torch.empty(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=torch.bfloat16)
        self.attn = torch.empty(batch, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        self.h = torch.empty(batch, HIDDEN, device=dev, dtype=torch.bfloat16)
        self.act = torch.empty(batch, INTER, device=dev, dtype=torch.bfloat16)
        self.scale = HEAD_DIM ** -0.5
        self.side = torch.cuda.Stream(dev)

    def attention(self, rows: slice) -> None:
        q = self.qkv[rows, :HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        paged_decode_attention(q, self.k_cache, self.v_cache, self.tables[rows], self.seq_lens[rows], self.scale,
                               None, out=self.attn[rows], max_seq_len=self.max_seq)

    def mlp(self, w: dict[str, torch.Tensor]) -> None:
        gate_up = F.linear(self.h, w["gate_up"])
        torch.mul(F.silu(gate_up[:, :INTER]), gate_up[:, INTER:], out=self.act)
        torch.matmul(self.act, w["down"].t(), out=self.x)

    def serial(self) -> None:
        for w in self.layers:
            torch.matmul(self.x, w["qkv"].t(), out=self.qkv)
            self.attention(slice(None))
            torch.matmul(self.attn.view(self.batch, -1), w["o"].t(), out=self.h)
            self.mlp(w)

    def split(self, parts: int) -> None:
        """qkv and o_proj per part on the main stream, attention per part on the side stream."""
        main, side = torch.cuda.current_stream(), self.side
        step = self.batch // parts
        chunks = [slice(i * step, (i + 1) * step) for i in range(parts)]
        for w in self.layers:
            qkv_done, attn_done = [], []
            for rows in chunks:
                torch.matmul(self.x[rows], w["qkv"].t(), out=self.qkv[rows])
                event = torch.cuda.Event()
                event.record(main)
                qkv_done.append(event)
            for rows, event in zip(chunks, qkv_done, strict=True):
                side.wait_event(event)
                with torch.cuda.stream(side):
                    self.attention(rows)
                done = torch.cuda.Event()
                done.record(side)
                attn_done.append(done)
            for rows, done in zip(chunks, attn_done, strict=True):
                main.wait_event(done)
                torch.matmul(self.attn[rows].view(step, -1), w["o"].t(), out=self.h[rows])
            self.mlp(w)


def graph_time(fn, replays: int = 20, stream: torch.cuda.Stream | None = None) -> float:
    """Median milliseconds of one replay of fn captured in a CUDA graph (on `stream`, whose priority the
    graph's kernels keep)."""
    fn()  # compile the Triton kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    dev = torch.device("cuda")
    layer = Layer(args.batch, args.context, args.layers, dev)
    kv_bytes = 2 * layer.k_cache.numel() * 2
    print(f"{torch.cuda.get_device_name()}: batch {args.batch}, context {args.context}, K/V {kv_bytes / 1e9:.2f} GB "
          f"a layer, {args.layers} layers of weights in rotation")
    # the parts alone, for the budget of a layer
    w = layer.layers[0]
    parts = {
        "qkv": lambda: torch.matmul(layer.x, w["qkv"].t(), out=layer.qkv),
        "attention": lambda: layer.attention(slice(None)),
        "o_proj": lambda: torch.matmul(layer.attn.view(args.batch, -1), w["o"].t(), out=layer.h),
        "mlp": lambda: layer.mlp(w),
    }
    for name, fn in parts.items():
        print(f"  {name:10s} {graph_time(fn) * 1e3:8.1f} us (one layer, weights may sit in L2)")
    # the schedule computes what the serial layer does (up to the GEMMs' choice of kernel per row count)
    x0 = layer.x.clone()
    layer.serial()
    want = layer.x.clone()
    layer.x.copy_(x0)
    layer.split(2)
    torch.cuda.synchronize()
    print(f"split 2 against serial: max |diff| {(layer.x.float() - want.float()).abs().max().item():.3g}, "
          f"max |x| {want.float().abs().max().item():.3g}")
    results = {"serial": graph_time(layer.serial)}
    for n in (2, 4):
        results[f"split {n}"] = graph_time(lambda n=n: layer.split(n))
    high = torch.cuda.Stream(dev, priority=-1)  # the GEMMs first where both streams have work waiting
    for n in (2, 4):
        results[f"split {n}, GEMM stream high priority"] = graph_time(lambda n=n: layer.split(n), stream=high)
    base = results["serial"]
    for name, ms in results.items():
        print(f"{name:36s} {ms / args.layers * 1e3:8.1f} us a layer  ({base / ms:.3f}x serial)")


if __name__ == "__main__":
    main()
