"""The cluster-wide settings: declared here once, resolved by whoever starts a process (`tandem serve`, a pod's
command line) and handed to every node (and, for prefix hashing, the proxy) as flags built from this declaration.

    HashingSettings    block size and prefix-hash seed: nodes and proxy must agree, or prefix routing misses
    TransportSettings  how the KV transfer library reaches peers (per backend options, never os.environ)
    KVTierSettings     the host tier's size, the cluster KV store's address
    ClusterSettings    all that every node of the cluster takes: the three above, KV backend, dtype, KV cache dtype,
                       drain timeout, TLS (settings/tls.py: the nodes' servers, and their calls to other nodes) and
                       TracingSettings (--otlp-traces-endpoint, which the proxy takes too)

Defaults equal the offline API's (`engine.config.EngineConfig`), so a node and `LLM(...)` behave alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from settings.spec import ConfigError, group, setting
from settings.tls import TLSSettings

# ipc: nodes on one host only (process_vm_readv, CUDA IPC); auto: ipc for a peer on this host, else the cross-host one
KV_BACKENDS = ("nixl", "mooncake", "ipc", "auto")
KV_CROSS_HOST_BACKENDS = ("nixl", "mooncake")  # kvtransfer.same_host.CROSS_HOST_BACKENDS
# kvtransfer.mooncake.PROTOCOLS: nvlink_intra is CUDA IPC between the GPUs of one machine (a CUDA build of Mooncake)
MOONCAKE_PROTOCOLS = ("tcp", "rdma", "nvlink_intra")
ENGINE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


@dataclass(frozen=True)
class HashingSettings:
    block_size: int = setting(ENGINE_DEFAULTS["block_size"], "KV block size in tokens (a power of two)", minimum=1,
                              metavar="N")
    hash_seed: str = setting(ENGINE_DEFAULTS["hash_seed"], "prefix-hash seed", metavar="SEED")


@dataclass(frozen=True)
class TransportSettings:
    """What the KV transfer library is told, per backend, through its own API. Variables a library reads only from
    the process environment (UCX_MODULES, UCX_TLS, MC_TRANSFER_TIMEOUT...) are the launcher's: see
    `ServeConfig.transport_env`."""

    ucx_devices: str | None = setting(
        None, "NIXL: the network devices UCX may use, e.g. 'mlx5_0:1,mlx5_1:1' or 'lo' (default: UCX picks all; "
              "'lo' for a single-machine tandem serve)", metavar="DEVICES")
    ucx_config: str | None = setting(
        None, "NIXL: UCX settings for its UCX backend, 'KEY=VALUE,...' (UCX's names, the UCX_ prefix optional), "
              "e.g. 'PROTO_EMULATION_ENABLE=n'; they add to and override the default, which is "
              "CUDA_IPC_ENABLE_GET_ZCOPY=y for a KV pool on a GPU (GPU-to-GPU reads crawl over TCP without it where "
              "NVLink is not reported) and nothing for one in host memory. A value cannot hold a comma: list "
              "values such as UCX_TLS=a,b go in the nodes' environment (--transport-env)", metavar="'K=V,...'")
    mooncake_protocol: str = setting(
        "tcp", "Mooncake: the transfer protocol (nvlink_intra: CUDA IPC between GPUs of one machine; its nodes start "
               "with MC_INTRANODE_NVLINK=1)", choices=MOONCAKE_PROTOCOLS)
    kv_cross_host_backend: str = setting(
        "nixl", "--kv-backend auto: the backend for peers on other hosts (or in other PID/network namespaces); "
                "peers on this host are read over ipc. Its transport settings above apply",
        choices=KV_CROSS_HOST_BACKENDS)

    def __post_init__(self) -> None:
        if self.ucx_config is not None:
            # The rule lives with the library that applies it; imported here only when there is something to
            # check, so that `import settings` stays free of transport packages.
            from kvtransfer.errors import InvalidRequestError
            from kvtransfer.ucx_config import parse_ucx_config

            try:
                parse_ucx_config(self.ucx_config)
            except InvalidRequestError as e:
                raise ConfigError(f"ucx_config (--ucx-config, TANDEM_UCX_CONFIG): {e}") from None

    def connector_options(self, backend: str) -> dict[str, Any]:
        """The keyword options `kvtransfer.make_connector(backend, ...)` takes for these settings; for "auto", the
        cross-host backend's and which one it is (its ipc connector takes the defaults)."""
        if backend == "auto":
            return {"cross_host": self.kv_cross_host_backend, **self.connector_options(self.kv_cross_host_backend)}
        if backend == "nixl":
            options = {"ucx_devices": self.ucx_devices} if self.ucx_devices else {}
            if self.ucx_config is not None:
                options["ucx_config"] = self.ucx_config
            return options
        if backend == "mooncake":
            return {"protocol": self.mooncake_protocol}
        return {}

    def launch_environment(self, backend: str) -> dict[str, str]:
        """What these settings need in the environment a node process starts with, for libraries that read it
        there only: Mooncake installs its nvlink_intra transport only when MC_INTRANODE_NVLINK is present (any
        value, "0" too, so a launcher that does not want it leaves it out). "auto" needs what its cross-host backend
        needs (ipc reads nothing from the environment)."""
        if backend == "auto":
            return self.launch_environment(self.kv_cross_host_backend)
        if backend == "mooncake" and self.mooncake_protocol == "nvlink_intra":
            return {"MC_INTRANODE_NVLINK": "1"}
        return {}


KV_STORE_SCHEME = "mooncake://"
DEFAULT_STAGING_GIB = 1.0  # the host tier a node with a KV store and no --kv-offloading-size gets


@dataclass(frozen=True)
class KVTierSettings:
    """The KV tiers below each node's pool (docs/architecture.md#kv-tiers): host memory, then the cluster's store."""

    kv_offloading_size: float = setting(
        0.0, "GiB of host memory per node (pinned on a GPU) that keeps the prefix blocks its KV pool evicts, as "
             f"vLLM's flag; 0: none (with --kv-store: {DEFAULT_STAGING_GIB:g}, where the store's blocks land)",
        minimum=0.0, metavar="GIB")
    kv_store: str | None = setting(
        None, f"the cluster KV store nodes put the blocks they computed in and get prefixes from: "
              f"{KV_STORE_SCHEME}HOST:PORT, the RPC address of a mooncake_master (tandem serve: 'mooncake' starts "
              "one on this machine)", metavar="URL")
    kv_store_segment_size: float = setting(
        1.0, "GiB of each node's memory lent to the store (Mooncake Store keeps its blocks in its clients' "
             "segments: the store holds about nodes x this)", minimum=0.0, metavar="GIB")

    def __post_init__(self) -> None:
        if self.kv_store is not None and self.kv_store != "mooncake":
            store_address(self.kv_store)  # raises ConfigError

    def host_tier_bytes(self) -> int:
        gib = self.kv_offloading_size or (DEFAULT_STAGING_GIB if self.kv_store else 0.0)
        return int(gib * 2**30)


def store_address(url: str) -> str:
    """HOST:PORT of a mooncake://HOST:PORT URL; ConfigError for anything else."""
    address = url.removeprefix(KV_STORE_SCHEME)
    host, _, port = address.rpartition(":")
    if not url.startswith(KV_STORE_SCHEME) or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--kv-store: expected {KV_STORE_SCHEME}HOST:PORT, got {url!r}")
    return address


@dataclass(frozen=True)
class TracingSettings:
    """OpenTelemetry traces of each request across proxy, prefill and decode nodes (node_common/tracing.py)."""

    otlp_traces_endpoint: str | None = setting(
        None, "send OpenTelemetry spans to this OTLP/HTTP collector, as vLLM's flag, e.g. http://HOST:4318 "
              "(default: no tracing)", metavar="URL")


@dataclass(frozen=True)
class ClusterSettings:
    hashing: HashingSettings = group(HashingSettings)
    kv_backend: str = setting(
        "nixl", "KV transfer library (ipc: nodes on one host only; auto: ipc for a peer on this host, "
                "--kv-cross-host-backend for the others; it pairs with plain nodes of those two backends too)",
        choices=KV_BACKENDS)
    dtype: str = setting(ENGINE_DEFAULTS["dtype"], "model dtype", choices=DTYPES)
    # cluster-wide: a prefill node's blocks are a decode node's, so both must store them alike (the handshake
    # refuses a pair that does not)
    kv_cache_dtype: str = setting(
        ENGINE_DEFAULTS["kv_cache_dtype"], "KV cache storage, vLLM's values: auto (the model dtype) or fp8 (= "
        "fp8_e4m3: e4m3 values with a power-of-two scale per token and KV head, about half of bf16's memory)",
        choices=KV_CACHE_DTYPES)
    drain_timeout: float = setting(120.0, "seconds a leaving node may take to finish its requests", minimum=1.0,
                                   metavar="SECONDS")
    transport: TransportSettings = group(TransportSettings)
    tls: TLSSettings = group(TLSSettings)
    kv_tiers: KVTierSettings = group(KVTierSettings)
    tracing: TracingSettings = group(TracingSettings)


# A single machine's cluster: UCX on the loopback device, and without its InfiniBand modules (with Debian's ibverbs
# providers installed, every UCX process crashes at exit otherwise). Never the default of a real cluster.
LOOPBACK_UCX_DEVICES = "lo"
LOOPBACK_TRANSPORT_ENV = "UCX_MODULES=^ib"


def single_machine(transport: TransportSettings) -> TransportSettings:
    """The transport of a cluster on one machine: settings the user left unset take the loopback values."""
    if transport.ucx_devices is not None:
        return transport
    return dataclasses.replace(transport, ucx_devices=LOOPBACK_UCX_DEVICES)
