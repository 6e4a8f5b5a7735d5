"""How a cluster on one CPU machine shares its cores: torch threads per node process, and which prompts the
decode nodes prefill themselves.

Why it matters: every node is a torch process. Left to itself it runs one intra-op (OpenMP) thread per core, so
one prefill and one decode node on a 2-core box run 4 compute threads on 2 cores next to the proxy, and an OpenMP
parallel region ends in a barrier: when one of its threads has lost its core to the other node, the whole step
waits for a scheduler time slice. Under Ray it runs what the actor's OMP_NUM_THREADS says (the actor's whole CPUs,
at least 1): with `--node-cpus 0.5`, one thread each, so each phase of a request ran on half the machine while the
other half waited for the other phase. And disaggregation buys nothing on shared cores: a prefill on P slows D's
decode steps as much as the same chunk in D's own batch would, plus a KV transfer and a second engine loop. So on
a machine with fewer cores than the nodes need (`CORES_PER_NODE` each) the decode nodes take the cores and
prefill their requests themselves, prompts up to a full prefill step (chunked prefill in the running batch, as
vLLM does on one machine); the prefill nodes keep one thread each and take what the router still sends them
(prompts longer than a step, or a decode node that fills up). On a machine with cores for every node, each node
gets an equal share and the router keeps its own colocation threshold.

GPU nodes are left alone: their torch threads only launch kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass

from settings import ServeConfig
from settings.cluster import ENGINE_DEFAULTS

# Below this many cores per node process, nodes sharing the machine slow each other down more than
# disaggregation saves (a prefill node needs cores of its own to take prefills off the decode nodes' steps).
# Measured at 2 cores only (bench/results/serving-cpu-2026-12-03.md); 4 is a judgement for machines in between.
CORES_PER_NODE = 4


@dataclass(frozen=True)
class CpuLayout:
    """Torch CPU threads per prefill and per decode node process, and the proxy's colocation threshold (None:
    the proxy's default)."""

    prefill_threads: int
    decode_threads: int
    colocate_max_tokens: int | None

    @property
    def decode_prefills(self) -> bool:
        """Whether the decode nodes prefill their prompts themselves (the cores are too few to split)."""
        return self.colocate_max_tokens is not None


def cpu_layout(num_cpus: int, num_prefill_nodes: int, num_decode_nodes: int, max_step_tokens: int) -> CpuLayout:
    """The layout of `num_prefill_nodes` + `num_decode_nodes` CPU nodes on one machine of `num_cpus` cores;
    `max_step_tokens` is the nodes' prefill step (--max-num-batched-tokens)."""
    assert num_cpus > 0 and num_prefill_nodes >= 0 and num_decode_nodes >= 0, "counts must not be negative"
    num_nodes = num_prefill_nodes + num_decode_nodes
    if num_decode_nodes == 0 or num_nodes == 0:
        even = max(1, num_cpus // max(num_nodes, 1))
        return CpuLayout(even, even, None)
    if num_prefill_nodes > 0 and num_cpus < CORES_PER_NODE * num_nodes:
        # the decode nodes compute everything but what the router must still send to P: P stays small, so
        # that its occasional prefill takes one core from D's steps, not all of them
        return CpuLayout(1, max(1, num_cpus // num_decode_nodes), max_step_tokens)
    even = max(1, num_cpus // num_nodes)
    return CpuLayout(even, even, None)


def serve_layout(config: ServeConfig, num_cpus: int) -> CpuLayout:
    """`tandem serve`'s layout for its CPU nodes on this machine: `cpu_layout`, with --node-threads (both roles)
    over its thread counts; the prefill step is the nodes' --max-num-batched-tokens (from --node-args, else the
    engine's default). A --colocate-max-tokens in --proxy-args comes after the layout's, so it wins."""
    layout = cpu_layout(num_cpus, config.prefill_nodes, config.decode_nodes, _max_step_tokens(config.node_args))
    if config.node_threads is None:
        return layout
    return dataclasses.replace(layout, prefill_threads=config.node_threads, decode_threads=config.node_threads)


def _max_step_tokens(node_args: str) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS["max_num_batched_tokens"])
    known, _ = parser.parse_known_args(shlex.split(node_args))
    return int(known.max_num_batched_tokens)
