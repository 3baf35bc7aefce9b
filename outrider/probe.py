"""A gRPC health check over TLS, for Kubernetes exec probes.

    python -m outrider.probe --port 50052 --tls-ca ca.crt [--tls-cert tls.crt --tls-key tls.key]

Kubernetes' native ``grpc:`` probes speak plaintext only, so the Helm chart
probes a service that serves TLS with this instead. It asks
``grpc.health.v1.Health/Check`` for the overall status (service ``""``) and
exits 0 on SERVING, 1 on anything else, with one line on stderr saying why.
A worker that requires client certificates is probed with the pod's own
certificate, so that certificate must allow client authentication.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from outrider.security import ClientTls


def check(address: str, *, tls: ClientTls, server_name: str | None, timeout_s: float) -> str:
    """The overall health status of the service at ``address``, by name (``SERVING``, ...)."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    with grpc.secure_channel(address, tls.credentials(), options=options) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m outrider.probe", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address of the service (default: this pod)"
    )
    parser.add_argument("--port", type=int, required=True, help="the service's gRPC port")
    parser.add_argument(
        "--tls-ca", type=Path, required=True, help="CA that signed the service's certificate (PEM)"
    )
    parser.add_argument(
        "--tls-cert", type=Path, help="client certificate, for a service that requires one (PEM)"
    )
    parser.add_argument("--tls-key", type=Path, help="private key of --tls-cert (PEM)")
    parser.add_argument(
        "--server-name", help="name to verify the service's certificate against (default: --host)"
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="deadline of the check in seconds"
    )
    args = parser.parse_args(argv)
    address = f"{args.host}:{args.port}"
    try:
        status = check(
            address,
            tls=ClientTls(args.tls_ca, args.tls_cert, args.tls_key),
            server_name=args.server_name,
            timeout_s=args.timeout,
        )
    except (ValueError, OSError) as exc:
        print(f"probe {address}: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"probe {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"probe {address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
