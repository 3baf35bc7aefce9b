"""The HTTP server of the API: uvicorn, in the coordinator's own event loop,
beside its gRPC server, so that a request goes from HTTP to the round loop
with no hop between."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp

from outrider.security import ServerTls

SHUTDOWN_GRACE_S = 1
"""How long requests still running when the server stops may take to finish
(the coordinator has drained its calls before)."""


class _InLoopServer(uvicorn.Server):
    """uvicorn, leaving the process's signals to the coordinator, whose
    handler drains both APIs and then stops this server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (0: any free port); OSError naming
    the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family)
    except OSError as exc:
        raise OSError(f"cannot bind the HTTP API to {host}:{port}: {exc.strerror}") from None


@dataclass
class HttpServer:
    """A started HTTP server: its bound port, and how to stop it."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    async def stop(self) -> None:
        """Stops taking connections, closes the idle ones, gives requests
        still running :data:`SHUTDOWN_GRACE_S`, then cancels them."""
        self.server.should_exit = True
        await self.task


async def start_http_server(
    app: ASGIApp, *, host: str, port: int, tls: ServerTls | None = None
) -> HttpServer:
    """Serves ``app`` on ``host:port`` (0: any free port), over TLS with
    ``tls`` (requiring client certificates when it names a client CA). Once
    this returns the port takes connections."""
    tls_options = (
        dict(
            ssl_certfile=str(tls.cert_file),
            ssl_keyfile=str(tls.key_file),
            ssl_ca_certs=str(tls.client_ca_file) if tls.client_ca_file else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.client_ca_file else ssl.CERT_NONE,
        )
        if tls
        else {}
    )
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        **tls_options,  # type: ignore[arg-type]
    )
    config.load()  # the TLS context is made here: a bad certificate fails now
    sock = listening_socket(host, port)
    server = _InLoopServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    return HttpServer(server, task, sock.getsockname()[1])
