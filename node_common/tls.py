"""gRPC credentials from the TLS settings (settings/tls.py): a node's server, and the channels of whoever calls
nodes (the proxy; a decode node calling prefill nodes for leases). One place builds both sides, so a node and its
callers cannot disagree on what TLS means.

- A node with --tls-cert/--tls-key serves TLS only (no plaintext port beside it); with --tls-client-ca too, the
  handshake fails for a client without a certificate that CA signed.
- A caller with --node-tls-ca checks each node's certificate against that CA and the host of the node's address
  (an IP address must be in the certificate's IP SANs, a name in its DNS SANs), or against --node-tls-server-name
  for nodes that share one certificate. With --node-tls-cert/--node-tls-key it presents its own certificate.
Certificates are read once, at start: rotating them means restarting (or draining) the processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from settings.tls import ClientTLSSettings, ServerTLSSettings


class TLSFileError(ValueError):
    """A certificate or key file that cannot be read."""


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TLSFileError(f"cannot read the {what} {path}: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TLSFileError(f"the {what} {path} is not PEM")
    return data


def server_credentials(settings: ServerTLSSettings) -> grpc.ServerCredentials | None:
    """A node's server credentials; None: plaintext."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    pair = (_read(settings.tls_key, "TLS key (--tls-key)"), _read(settings.tls_cert, "TLS certificate (--tls-cert)"))
    client_ca = (_read(settings.tls_client_ca, "client CA (--tls-client-ca)")
                 if settings.tls_client_ca is not None else None)
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


@dataclass(frozen=True)
class ChannelSecurity:
    """How to open a channel to a node: plaintext (no credentials) or TLS."""

    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None  # ssl_target_name_override: the name to find in every node's certificate

    @classmethod
    def from_settings(cls, settings: ClientTLSSettings) -> ChannelSecurity:
        if settings.node_tls_ca is None:
            return PLAINTEXT
        key = cert = None
        if settings.node_tls_cert is not None and settings.node_tls_key is not None:
            cert = _read(settings.node_tls_cert, "client certificate (--node-tls-cert)")
            key = _read(settings.node_tls_key, "client key (--node-tls-key)")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(settings.node_tls_ca, "nodes' CA (--node-tls-ca)"), private_key=key,
            certificate_chain=cert)
        return cls(credentials, settings.node_tls_server_name)

    @property
    def secure(self) -> bool:
        return self.credentials is not None

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to the node at `address` (host:port); open it inside the event loop that uses it."""
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        if self.server_name is not None:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.aio.secure_channel(address, self.credentials, options=list(options))


PLAINTEXT = ChannelSecurity()
