"""Command-line options both node kinds take, and the EngineConfig they make.

The cluster-wide settings (block size, hash seed, KV backend, dtype, drain timeout, transport) are flags built from
their one declaration (`settings.cluster.ClusterSettings`), read as everywhere: flag > YAML --config > TANDEM_* env
> default; `tandem serve` passes them all as flags. The engine flags' defaults are EngineConfig's, the offline
`LLM(...)`'s.
"""

from __future__ import annotations

import argparse
import logging
import socket
from typing import TYPE_CHECKING, Any

from engine.config import ALL2ALL_BACKENDS, ATTENTION_BACKENDS, DEVICE_CHOICES, LOAD_FORMATS, EngineConfig
from engine.spec_decode.config import SpeculativeConfig
from node_common.limits import add_limit_args
from node_common.registrar import add_registry_args
from settings import ClusterSettings, add_arguments, parse_args_with
from settings import env as environment
from settings.cluster import ENGINE_DEFAULTS

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from node_common.store_tier import StoreTier

logger = logging.getLogger(__name__)


def add_node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="Hugging Face model directory, a .gguf file, or a directory holding one")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (gRPC and KV transfer)")
    parser.add_argument("--port", type=int, required=True, help="gRPC port")
    parser.add_argument("--node-id", default=None, help="defaults to <role>-<hostname>-<port>")
    add_arguments(parser, ClusterSettings)
    engine = ENGINE_DEFAULTS
    parser.add_argument("--max-num-seqs", type=int, default=engine["max_num_seqs"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=engine["max_num_batched_tokens"])
    parser.add_argument("--max-model-len", type=int, default=engine["max_model_len"])
    parser.add_argument("--num-kv-blocks", type=int, default=engine["num_kv_blocks"])
    parser.add_argument("--no-prefix-caching", action="store_true", default=not engine["enable_prefix_caching"])
    parser.add_argument("--attention-backend", default=engine["attention_backend"], choices=ATTENTION_BACKENDS)
    parser.add_argument("--seed", type=int, default=engine["seed"])
    parser.add_argument("--device", default=engine["device"], metavar="DEVICE",
                        help=f"{DEVICE_CHOICES} (auto: the GPU when there is one; under tandem serve Ray gives "
                             "each node its GPU, which it sees as cuda)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=engine["gpu_memory_utilization"],
                        metavar="F", help="the fraction of the GPU's total memory this node may use (weights, "
                        "activations, KV cache), as vLLM's: give nodes sharing a GPU their parts, e.g. 0.45 each "
                        "for two. Ignored on CPU")
    parser.add_argument("--load-format", default=engine["load_format"], choices=LOAD_FORMATS,
                        help="dummy: random weights of the shapes the model's config.json gives (no weights files)")
    parser.add_argument("--enforce-eager", action="store_true", default=engine["enforce_eager"],
                        help="no CUDA graphs for decode steps")
    parser.add_argument("--enable-expert-parallel", action="store_true", default=engine["enable_expert_parallel"],
                        help="a mixture-of-experts model's experts split whole across the node's tensor-parallel "
                             "ranks (tokens travel to them) instead of each expert split across every rank")
    parser.add_argument("--all2all-backend", default=engine["all2all_backend"], choices=ALL2ALL_BACKENDS,
                        help="expert parallelism's token exchange: allgather_reducescatter (every rank runs its "
                             "experts on every token, one all-reduce) or all_to_all (each token's rows travel to "
                             "their experts' ranks and back)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=engine["async_scheduling"], help="prepare and launch step N+1 while the device "
                        "runs step N (default: on with a GPU, off on CPU, where nothing runs in parallel)")
    parser.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (decode nodes draft and verify; '
                             "prefill nodes, whose requests end at their first token, ignore it). It turns "
                             "--async-scheduling off")
    parser.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=int,
                        default=engine["tensor_parallel_size"], metavar="N",
                        help="tensor-parallel ranks of this node: N processes, each with its slice of the weights "
                             "and of the KV pool (one GPU each on a GPU machine)")
    parser.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="torch CPU (intra-op) threads of this process (default: torch's, from OMP_NUM_THREADS "
                             "or one per core; tandem serve sets it from how its nodes share the machine, see "
                             "cluster/layout.py)")
    parser.add_argument("--log-level", default=environment.log_level())
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve the process's Prometheus metrics on this port (default: none)")
    add_limit_args(parser)  # --max-logprobs
    add_registry_args(parser)


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        config = SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert config is not None
    return config


def parse_node_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and resolves the cluster settings: `args.cluster` holds them, and each is also `args.<name>`."""
    args, cluster = parse_args_with(parser, ClusterSettings, argv)
    if args.num_threads is not None and args.num_threads < 1:
        parser.error(f"--num-threads must be at least 1, got {args.num_threads}")
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    args.cluster = cluster
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    # Nodes see token ids only: the proxy tokenizes and detokenizes.
    cluster: ClusterSettings = args.cluster
    return EngineConfig(
        model=args.model, dtype=cluster.dtype, kv_cache_dtype=cluster.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, block_size=cluster.hashing.block_size,
        enable_prefix_caching=not args.no_prefix_caching, num_kv_blocks=args.num_kv_blocks, seed=args.seed,
        attention_backend=args.attention_backend, hash_seed=cluster.hashing.hash_seed, skip_tokenizer_init=True,
        device=args.device, gpu_memory_utilization=args.gpu_memory_utilization, load_format=args.load_format,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, all2all_backend=args.all2all_backend,
        kv_offloading_bytes=cluster.kv_tiers.host_tier_bytes())


def load_engine(args: argparse.Namespace, role: str) -> AsyncEngine:
    """The node's engine, built on its own thread (AsyncEngine.load says why), not yet started. What the machine
    cannot run (a bad flag value, a model it cannot read, a device it does not have, too little GPU memory) ends
    the process with the reason on one line, not a traceback."""
    from engine.async_engine import AsyncEngine  # torch: only in the node process
    from engine.device import GpuMemoryError
    from engine.llm_engine import LLMEngine

    if args.num_threads is not None:
        import torch

        # explicitly, over OMP_NUM_THREADS: a Ray actor's children inherit Ray's OMP_NUM_THREADS=1
        torch.set_num_threads(args.num_threads)
    try:
        config = engine_config(args)
        if role == "prefill" and config.speculative_config is not None:
            # its requests end at the first token, which no draft precedes: speculation would only cost it
            # asynchronous scheduling
            logger.info("prefill node: --speculative-config ignored (speculation runs on decode nodes)")
            config.speculative_config = None
        loaded = AsyncEngine.load(lambda: LLMEngine(config))
    except (ValueError, GpuMemoryError) as e:  # ModelConfigError and DeviceError are ValueErrors
        logger.debug("the engine did not start", exc_info=True)
        raise SystemExit(f"{role} node: cannot start the engine: {e}") from None
    device = loaded.engine.runner.device
    if device.type == "cuda":
        import torch

        # this thread registers the KV pool with the transfer library next: its device current here too, as on
        # the thread that built the engine
        torch.cuda.set_device(device)
    return loaded


def store_tier(args: argparse.Namespace, engine: AsyncEngine, layout_hash: str) -> StoreTier | None:
    """The node's door to the cluster KV store (--kv-store), None without one; a store address it cannot use ends
    the process with the reason."""
    from node_common.store_tier import open_store_tier

    try:  # other nodes read this node's store segment at its advertised host
        return open_store_tier(args.cluster.kv_tiers, engine, layout_hash, advertised_host(args))
    except ValueError as e:
        raise SystemExit(f"cannot use the KV store: {e}") from None


def advertised_host(args: argparse.Namespace) -> str:
    """The host other nodes reach this one at: --advertise-address's, else --host unless it binds all interfaces
    (node_common/registrar.py advertised_address). What a transfer library or the store hands peers: a bind-all
    0.0.0.0 there makes a peer dial itself."""
    from node_common.registrar import advertised_address

    return advertised_address(args).rsplit(":", 1)[0].strip("[]")


def close_node(connector: Any, engine: LLMEngine, store: StoreTier | None = None) -> None:
    """At shutdown: every rank's transfer agent, then the engine's worker ranks, then the store's client."""
    try:
        connector.close()
    except Exception:  # noqa: BLE001 - a worker rank already gone: the engine's close below still runs
        logger.warning("closing the KV connector failed", exc_info=True)
    finally:
        engine.close()
        if store is not None:
            store.close()


def node_id(args: argparse.Namespace, role: str) -> str:
    return args.node_id or f"{role}-{socket.gethostname()}-{args.port}"
