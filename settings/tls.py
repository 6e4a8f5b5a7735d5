"""TLS between the proxy and the nodes, and between nodes (a decode node calls prefill nodes for leases): declared
once, so that `tandem serve`, a node and the proxy take the same flags, env vars and YAML keys.

    ServerTLSSettings  what a node's gRPC server presents (--tls-cert, --tls-key) and, for mutual TLS, the CA its
                       clients' certificates must chain to (--tls-client-ca)
    ClientTLSSettings  how the proxy and decode nodes call nodes: the CA the nodes' certificates chain to
                       (--node-tls-ca turns TLS on), the client certificate for mutual TLS, and the name to expect in
                       the nodes' certificates when it is not the host of their address (--node-tls-server-name)

Files are PEM paths, read when a process starts (node_common/tls.py); the settings hold no key material. Without
them everything is plaintext, as before: fine on one machine or inside a private network, not across one you do not
control.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from settings.spec import ConfigError, group, setting


@dataclass(frozen=True)
class ServerTLSSettings:
    tls_cert: str | None = setting(
        None, "a node's gRPC server certificate chain (PEM); with --tls-key the node serves TLS only",
        metavar="FILE")
    tls_key: str | None = setting(None, "the private key of --tls-cert (PEM)", metavar="FILE")
    tls_client_ca: str | None = setting(
        None, "CA certificates (PEM): a node then requires each client (proxy, decode node) to present a certificate "
              "they signed (mutual TLS; clients give --node-tls-cert/--node-tls-key)", metavar="FILE")

    def __post_init__(self) -> None:
        _absolute_paths(self)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca (mutual TLS) needs the node's own --tls-cert and --tls-key")

    @property
    def enabled(self) -> bool:
        return self.tls_cert is not None


@dataclass(frozen=True)
class ClientTLSSettings:
    node_tls_ca: str | None = setting(
        None, "CA certificates (PEM) the nodes' certificates chain to: calls to nodes (the proxy's, and a decode "
              "node's to prefill nodes) then use TLS", metavar="FILE")
    node_tls_cert: str | None = setting(
        None, "the client certificate chain (PEM) presented to nodes that require one (--tls-client-ca)",
        metavar="FILE")
    node_tls_key: str | None = setting(None, "the private key of --node-tls-cert (PEM)", metavar="FILE")
    node_tls_server_name: str | None = setting(
        None, "the name every node's certificate must hold, instead of the host of the node's address (gRPC's "
              "ssl_target_name_override): for nodes that share one certificate", metavar="NAME")

    def __post_init__(self) -> None:
        _absolute_paths(self, but=("node_tls_server_name",))
        if (self.node_tls_cert is None) != (self.node_tls_key is None):
            raise ConfigError("--node-tls-cert and --node-tls-key go together")
        if self.node_tls_ca is None and (self.node_tls_cert is not None or self.node_tls_server_name is not None):
            raise ConfigError("--node-tls-cert, --node-tls-key and --node-tls-server-name need --node-tls-ca (the "
                              "CA that signed the nodes' certificates)")

    @property
    def enabled(self) -> bool:
        return self.node_tls_ca is not None


def _absolute_paths(settings: ServerTLSSettings | ClientTLSSettings, but: tuple[str, ...] = ()) -> None:
    """Relative paths are the reader's (its working directory): made absolute here, so that processes `tandem serve`
    starts elsewhere (Ray workers) read the same files."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        if f.name not in but and value is not None:
            object.__setattr__(settings, f.name, os.path.abspath(value))  # a frozen dataclass, still being built


@dataclass(frozen=True)
class TLSSettings:
    server: ServerTLSSettings = group(ServerTLSSettings)
    client: ClientTLSSettings = group(ClientTLSSettings)
