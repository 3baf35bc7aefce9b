"""TLS, mutual TLS and bearer tokens, configured by file paths.

* A service serves TLS with ``--tls-cert``/``--tls-key``; with
  ``--tls-client-ca`` it also requires client certificates signed by that CA
  (mutual TLS), so only the coordinator can talk to its workers.
* The coordinator reaches TLS workers with ``--worker-tls-ca`` (and presents
  ``--worker-tls-cert``/``--worker-tls-key`` to workers that require it).
* The coordinator can require a bearer token from ``--auth-tokens-file`` (one
  token per line, ``#`` comments), on its gRPC and its HTTP API alike; health
  and reflection stay open for probes.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: Path | None) -> bytes | None:
    return path.read_bytes() if path is not None else None


@dataclass(frozen=True)
class ServerTls:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    """When set, clients must present a certificate signed by this CA."""

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())],
            root_certificates=_read(self.client_ca_file),
            require_client_auth=self.client_ca_file is not None,
        )


@dataclass(frozen=True)
class ClientTls:
    ca_file: Path | None = None
    """CA that signed the server's certificate; None: the system's roots."""
    cert_file: Path | None = None
    key_file: Path | None = None
    """A client certificate, for servers that require one (mutual TLS)."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both its cert and its key file")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )


def server_tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> ServerTls | None:
    """The TLS settings the flags describe, checked; None for plaintext."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", client_ca)):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag} {path}: {'not a file' if path.exists() else 'no such file'}")
    return ServerTls(cert, key, client_ca)


def authorized(authorization: str, tokens: Collection[str]) -> bool:
    """Whether an ``authorization`` header or metadata value is ``Bearer
    <token>`` with one of ``tokens``. Every token is compared, in constant
    time, so timing says nothing about which one matched."""
    scheme, _, token = authorization.partition(" ")
    presented = token.strip().encode()
    matches = [hmac.compare_digest(presented, known.encode()) for known in tokens]
    return scheme.lower() == "bearer" and any(matches)


def load_tokens(path: Path) -> frozenset[str]:
    """Bearer tokens, one per line; blank lines and ``#`` comments ignored."""
    tokens = frozenset(
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    if not tokens:
        raise ValueError("it holds no token: write one per line (# starts a comment)")
    return tokens
