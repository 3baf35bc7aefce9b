"""Outrider's services as real processes on 127.0.0.1, for tests that kill,
freeze and drain them.

Each service runs ``outrider serve ROLE ARGS`` — the CLI's own code path, as
``outrider.stack`` runs it — in a process of its own, forked from a fork
server that has imported torch, transformers and grpc once. A (re)start then
costs the model load and warm-up (a fraction of a second on the tiny models)
instead of ~6 s of imports, so a test can kill and restart a worker twenty
times. The processes are ordinary ones: their own pid and memory, killed with
SIGKILL, frozen with SIGSTOP, drained with SIGTERM. Each writes its bound port
to a ready file once SERVING and its logs to a file next to it; a
``Cluster`` stops every process it started when it closes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import transformers.conversion_mapping  # noqa: F401
import transformers.core_model_loading  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
from grpc_health.v1 import health_pb2, health_pb2_grpc

import outrider.cli  # noqa: F401
import outrider.coordinator.main  # noqa: F401
import outrider.draft_worker.main  # noqa: F401
import outrider.target_worker.main  # noqa: F401
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

# The fork server imports this module, and with it everything a service
# needs (transformers imports a model's modules on first use, for seconds).
PRELOAD = [__name__]

_context = None


def _fork_context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _serve(argv: Sequence[str], log_file: str) -> None:
    """In the service's process: ``outrider serve ARGV``, logging to ``log_file``."""
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from outrider.cli import main

    sys.exit(main(["serve", *argv]))


@dataclass
class Service:
    """One service process; ``restart`` keeps its name, flags and port."""

    name: str
    role: str
    args: tuple[str, ...]
    ready_file: Path
    log_file: Path
    process: multiprocessing.process.BaseProcess
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def rss_bytes(self) -> int:
        """Resident memory, from /proc/PID/status (VmRSS)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for the {self.name} (pid {self.pid})")

    def alive(self) -> bool:
        return self.process.is_alive()

    async def exit_code(self, timeout_s: float) -> int | None:
        """The process's exit code (negative: the signal that ended it), or
        None if it is still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.process.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.process.exitcode

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@dataclass
class Cluster:
    """Services started from one work directory; ``close`` stops them all."""

    workdir: Path
    services: list[Service] = field(default_factory=list)

    async def start(
        self,
        role: str,
        args: Sequence[str] = (),
        *,
        name: str | None = None,
        port: int = 0,
        wait: bool = True,
    ) -> Service:
        """Starts ``outrider serve ROLE ARGS``; returns once it is SERVING
        unless ``wait`` is False."""
        name = name or role
        if any(s.name == name and s.alive() for s in self.services):
            raise RuntimeError(f"a service named {name!r} is already running")
        ready_file = self.workdir / f"{name}.port"
        ready_file.unlink(missing_ok=True)
        log_file = self.workdir / f"{name}.log"
        argv = [role, "--port", str(port), "--ready-file", str(ready_file), *args]
        process = _fork_context().Process(
            target=_serve, args=(argv, str(log_file)), name=name, daemon=False
        )
        process.start()
        service = Service(name, role, tuple(args), ready_file, log_file, process, port)
        self.services.append(service)
        if wait:
            await self.wait_ready(service)
        return service

    async def restart(self, service: Service, *, wait: bool = True) -> Service:
        """Starts a dead service again with its flags, on its port."""
        if await service.exit_code(5.0) is None:
            raise RuntimeError(f"the {service.name} is still running (pid {service.pid})")
        return await self.start(
            service.role, service.args, name=service.name, port=service.port, wait=wait
        )

    async def wait_ready(self, service: Service, timeout_s: float = 60.0) -> None:
        """Waits for the ready file, then for health SERVING."""
        deadline = time.monotonic() + timeout_s
        while not service.ready_file.exists():
            if not service.alive():
                raise RuntimeError(
                    f"the {service.name} exited with code {service.process.exitcode} "
                    f"while starting:\n{service.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the {service.name} was not ready within {timeout_s:.0f} s:\n"
                    f"{service.log_tail()}"
                )
            await asyncio.sleep(0.02)
        service.port = int(service.ready_file.read_text())
        status = await health(service.address)
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"the {service.name} reports {status} instead of SERVING")

    async def close(self, grace_s: float = 10.0) -> None:
        """Stops every process still running: SIGCONT (in case it is frozen),
        SIGTERM, then SIGKILL after ``grace_s``."""
        running = [s for s in self.services if s.alive()]
        for service in running:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    service.signal(sig)
                except ProcessLookupError:
                    pass
        for service in running:
            if await service.exit_code(grace_s) is None:
                service.signal(signal.SIGKILL)
                await service.exit_code(5.0)
        self.services.clear()


async def health(address: str, timeout_s: float = 5.0) -> int:
    """The service's overall health status (``HealthCheckResponse.ServingStatus``)."""
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s
        )
    return response.status


async def worker_info(service: Service, timeout_s: float = 5.0) -> pb.WorkerInfo:
    """A worker's GetWorkerInfo: its model, and its open sessions and cached tokens."""
    stub_class = (
        worker_pb2_grpc.TargetWorkerStub
        if service.role == "target"
        else worker_pb2_grpc.DraftWorkerStub
    )
    async with grpc.aio.insecure_channel(service.address) as channel:
        return await stub_class(channel).GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=timeout_s)


async def sessions_left(
    workers: Sequence[Service], timeout_s: float = 10.0
) -> dict[str, tuple[int, int]]:
    """(open sessions, cached tokens) of each worker, once both are 0 on
    all of them or ``timeout_s`` has passed (closes run after the stream ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [await worker_info(w) for w in workers]
        counts = {
            w.name: (i.active_sessions, i.cached_tokens)
            for w, i in zip(workers, infos, strict=True)
        }
        if all(c == (0, 0) for c in counts.values()) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.05)


@dataclass
class Stack:
    """Target worker(s), draft worker(s) and a coordinator in front of them."""

    coordinator: Service
    targets: list[Service]
    drafts: list[Service]

    @property
    def workers(self) -> list[Service]:
        return [*self.targets, *self.drafts]


def worker_args(model_dir: Path) -> list[str]:
    """A worker on a tiny float64 model, one torch thread."""
    return [
        "--model",
        str(model_dir),
        "--dtype",
        "float64",
        "--threads",
        "1",
        "--log-level",
        "warning",
    ]


async def start_stack(
    cluster: Cluster,
    target_dir: Path,
    draft_dir: Path | None = None,
    *,
    targets: int = 1,
    drafts: int = 1,
    target_args: Sequence[str] = (),
    draft_args: Sequence[str] = (),
    coordinator_args: Sequence[str] = (),
) -> Stack:
    """Starts the workers (concurrently), then the coordinator against them."""
    pending = [
        await cluster.start(
            "target", [*worker_args(target_dir), *target_args], name=f"target-{i}", wait=False
        )
        for i in range(targets)
    ]
    if draft_dir is not None:
        pending += [
            await cluster.start(
                "draft", [*worker_args(draft_dir), *draft_args], name=f"draft-{i}", wait=False
            )
            for i in range(drafts)
        ]
    for service in pending:
        await cluster.wait_ready(service)
    target_services = [s for s in pending if s.role == "target"]
    draft_services = [s for s in pending if s.role == "draft"]
    args = [
        "--tokenizer",
        str(target_dir),
        "--target",
        ",".join(s.address for s in target_services),
    ]
    if draft_services:
        args += ["--draft", ",".join(s.address for s in draft_services)]
    coordinator = await cluster.start(
        "coordinator", [*args, "--log-level", "warning", *coordinator_args]
    )
    return Stack(coordinator, target_services, draft_services)
