"""Runs the three services as separate processes on loopback (``outrider up``).

Workers start first; each writes its bound port to a ready file once it is
SERVING, then the coordinator starts against those ports. What a service
writes to stderr while it starts is held back, and passed on once it is
ready: one that fails to start is reported in one line, its last (the
reason ``outrider serve`` gives). Stopping sends SIGTERM to all three (they
drain), then SIGKILL to any that linger.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from outrider.command_config import StackConfig, default_drafter
from outrider.config import http_port_file
from outrider.drafters import COORDINATOR_DRAFTERS
from outrider.metrics import metrics_port_file


class StackError(RuntimeError):
    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        """2 when a service refused its configuration, as ``outrider serve`` does."""


class HeldStderr:
    """A service's stderr: held while it starts, passed on to ours once it
    is ready (:meth:`pass_on`)."""

    def __init__(self, stream: IO[str]) -> None:
        self._held: deque[str] = deque(maxlen=1000)
        self._passing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                if self._passing:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                else:
                    self._held.append(line)

    def pass_on(self) -> None:
        with self._lock:
            sys.stderr.writelines(self._held)
            sys.stderr.flush()
            self._held.clear()
            self._passing = True

    def last_line(self, timeout_s: float = 5.0) -> str:
        """The last line written, once the stream has ended (the process exited)."""
        self._thread.join(timeout_s)
        with self._lock:
            return next((line.strip() for line in reversed(self._held) if line.strip()), "")


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    ready_file: Path
    stderr: HeldStderr
    port: int | None = None
    metrics_port: int | None = None
    """Where it serves Prometheus metrics (``/metrics``); None: it does not."""
    http_port: int | None = None
    """Where a coordinator serves its OpenAI-compatible API; None: it does not."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        return (
            f"http://127.0.0.1:{self.metrics_port}/metrics"
            if self.metrics_port is not None
            else None
        )


@dataclass
class Stack:
    """Three running services; use as a context manager to stop them."""

    workdir: Path
    """Holds the services' ready files; removed with the stack."""
    services: list[Service] = field(default_factory=list)
    coordinators: dict[str | None, list[Service]] = field(default_factory=dict)
    """Coordinator replicas by drafter label (``start_shared_target_stack``;
    None: no draft worker)."""

    @property
    def coordinator(self) -> Service:
        return next(s for s in self.services if s.name == "coordinator")

    def start(
        self,
        name: str,
        args: Sequence[str],
        *,
        port: int = 0,
        timeout_s: float,
        label: str | None = None,
        metrics_port: int | None = None,
    ) -> Service:
        """Starts ``outrider serve NAME`` and waits until it is SERVING (see :meth:`launch`)."""
        service = self.launch(name, args, port=port, label=label, metrics_port=metrics_port)
        self.wait_ready(service, timeout_s)
        return service

    def launch(
        self,
        name: str,
        args: Sequence[str],
        *,
        port: int = 0,
        label: str | None = None,
        metrics_port: int | None = None,
    ) -> Service:
        """Starts ``outrider serve NAME`` without waiting for it; ``label``
        names the service when several share a role; with ``metrics_port``
        (0: any free port) it serves Prometheus metrics there."""
        label = label or name
        ready_file = self.workdir / f"{label}.port"
        command = [
            sys.executable,
            "-m",
            "outrider",
            "serve",
            name,
            "--port",
            str(port),
            "--ready-file",
            str(ready_file),
            *args,
        ]
        if metrics_port is not None:
            command += ["--metrics-port", str(metrics_port)]
        process = subprocess.Popen(
            command, start_new_session=True, stderr=subprocess.PIPE, text=True
        )
        assert process.stderr is not None  # a pipe, as asked
        service = Service(label, process, ready_file, HeldStderr(process.stderr))
        self.services.append(service)
        return service

    def wait_ready(self, service: Service, timeout_s: float) -> None:
        """Returns once ``service`` has written its port and reports SERVING;
        StackError if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while not service.ready_file.exists():
            if (code := service.process.poll()) is not None:
                why = service.stderr.last_line() or f"it exited with code {code}"
                raise StackError(f"the {service.name} did not start: {why}", 2 if code == 2 else 1)
            if time.monotonic() > deadline:
                raise StackError(
                    f"the {service.name} did not become ready within {timeout_s:.0f} s"
                )
            time.sleep(0.1)
        service.port = int(service.ready_file.read_text())
        if metrics_port_file(service.ready_file).exists():
            service.metrics_port = int(metrics_port_file(service.ready_file).read_text())
        if http_port_file(service.ready_file).exists():
            service.http_port = int(http_port_file(service.ready_file).read_text())
        with grpc.insecure_channel(service.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        if status.status != health_pb2.HealthCheckResponse.SERVING:
            raise StackError(f"the {service.name} reports {status.status} instead of SERVING")
        service.stderr.pass_on()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stops the coordinators, then the workers: a worker that stops
        first cuts the coordinators' calls to it (gRPC logs their GOAWAY)."""
        deadline = time.monotonic() + grace_s
        coordinators = [s for s in self.services if s.name == "coordinator"]
        workers = [s for s in self.services if s.name != "coordinator"]
        for group in (coordinators, workers):
            for service in group:
                if service.process.poll() is None:
                    service.process.send_signal(signal.SIGTERM)
            for service in group:
                try:
                    service.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(service.process.pid, signal.SIGKILL)
                    service.process.wait()
        self.services.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_flags(config: StackConfig) -> dict[str, Any]:
    """:func:`start_stack`'s arguments for ``config``: the flags of each
    service's ``outrider serve``, and no draft worker for prompt lookup
    (it drafts in the coordinator)."""
    drafter = config.drafter or default_drafter(
        config.device, draft_model=config.draft_model, target_model=config.target_model
    )
    target = ["--log-level", config.log_level, "--device", config.device, "--dtype", config.dtype]
    # A GGUF runs on llama.cpp on the CPU, whatever the target's device.
    draft_device = "cpu" if drafter == "gguf" else config.device
    draft = ["--log-level", config.log_level, "--device", draft_device]
    draft += ["--dtype", config.draft_dtype]
    if config.threads:
        target += ["--threads", str(config.threads)]
        draft += ["--threads", str(config.threads)]
    if config.enable_prefix_caching is not None:
        caching = f"--{'' if config.enable_prefix_caching else 'no-'}enable-prefix-caching"
        target.append(caching)
        draft.append(caching)
    if config.target_tp != 1:
        target += ["--tensor-parallel-size", str(config.target_tp)]
    if config.draft_tp != 1:
        draft += ["--tensor-parallel-size", str(config.draft_tp)]
    if config.target_model:
        target += ["--model", config.target_model]
    coordinator = ["--log-level", config.log_level, "--num-speculative-tokens", str(config.k)]
    if config.pipeline:
        coordinator += ["--pipeline"]
    if config.target_model:
        coordinator += ["--tokenizer", config.target_model]
    if drafter in COORDINATOR_DRAFTERS:
        if config.suffix_decoding:  # (the device's default drafter is prompt lookup)
            drafter = "suffix"
        coordinator += [COORDINATOR_DRAFTERS[drafter]]
        return dict(target_args=target, coordinator_args=coordinator, with_draft=False)
    draft += ["--drafter", drafter]
    if config.suffix_decoding:  # (beside the model: each round drafts by whichever pays)
        coordinator.append(COORDINATOR_DRAFTERS["suffix"])
    if drafter == "early-exit":
        draft += ["--draft-layers", str(config.draft_layers)]
    if drafter == "eagle" and config.head:
        draft += ["--head", config.head]
    # Model drafters default to the target's checkpoint (in bfloat16, in 4 bits, its GGUF,
    # cut; a head reads its embeddings).
    if model := config.draft_model or config.target_model:
        draft += ["--model", model]
    return dict(target_args=target, draft_args=draft, coordinator_args=coordinator)


def start_stack(
    *,
    target_args: Sequence[str] = (),
    draft_args: Sequence[str] = (),
    coordinator_args: Sequence[str] = (),
    coordinator_port: int = 0,
    with_draft: bool = True,
    timeout_s: float = 300.0,
    metrics_port: int | None = None,
    http_port: int | None = None,
) -> Stack:
    """Starts target, draft and coordinator; returns when all are SERVING.
    With ``metrics_port``, the coordinator serves its metrics there (0: any
    free port) and each worker on a free port (``Service.metrics_port``).
    With ``http_port``, the coordinator serves its OpenAI-compatible API
    there too (0: any free port; ``Service.http_port``)."""
    stack = Stack(workdir=Path(tempfile.mkdtemp(prefix="outrider-up-")))
    worker_metrics_port = None if metrics_port is None else 0
    try:
        target = stack.start(
            "target", target_args, timeout_s=timeout_s, metrics_port=worker_metrics_port
        )
        coordinator = ["--target", target.address]
        if with_draft:
            draft = stack.start(
                "draft", draft_args, timeout_s=timeout_s, metrics_port=worker_metrics_port
            )
            coordinator += ["--draft", draft.address]
        if http_port is not None:
            coordinator += ["--http-port", str(http_port)]
        stack.start(
            "coordinator",
            [*coordinator, *coordinator_args],
            port=coordinator_port,
            timeout_s=timeout_s,
            metrics_port=metrics_port,
        )
    except BaseException:
        stack.stop()
        raise
    return stack


def start_shared_target_stack(
    *,
    target_args: Sequence[str] = (),
    drafts: Mapping[str, Sequence[str]],
    coordinator_drafts: Mapping[str, Sequence[str]] = {},
    coordinator_args: Sequence[str] = (),
    coordinator_replicas: int = 1,
    coordinators: Mapping[str | None, str | None] | None = None,
    timeout_s: float = 300.0,
) -> Stack:
    """One target worker shared by every drafter's draft worker and
    coordinators (``outrider bench``).

    ``drafts`` maps a drafter label to its draft worker's flags; the
    ``coordinator_replicas`` coordinators in front of that draft worker (and
    the shared target) are ``stack.coordinators[label]``.
    ``coordinator_drafts`` maps the label of a drafter that runs in the
    coordinator (prompt lookup; suffix decoding, alone or beside a draft
    worker of the same label) to the coordinators' flags that name it.
    With neither, the coordinators without a drafter are
    ``stack.coordinators[None]``. ``coordinators`` maps other names to the
    label whose flags their coordinators take (``stack.coordinators[name]``;
    default: one name per label, the label itself).
    """
    stack = Stack(workdir=Path(tempfile.mkdtemp(prefix="outrider-bench-")))
    try:
        # The workers start one after another — a worker's start measures the
        # machine (on the CPU its small-batch linears are timed, and a worker
        # starting beside it slowed one path or the other) — then the
        # coordinators, side by side (they need the workers' ports).
        target = stack.start("target", target_args, timeout_s=timeout_s)
        draft_workers = {
            label: stack.start("draft", args, timeout_s=timeout_s, label=f"draft-{label}")
            for label, args in drafts.items()
        }
        draft_flags: dict[str | None, list[str]] = {
            **{label: list(flags) for label, flags in coordinator_drafts.items()},
            **{
                label: ["--draft", draft.address, *coordinator_drafts.get(label, ())]
                for label, draft in draft_workers.items()
            },
        } or {None: []}
        for name, label in (coordinators or {label: label for label in draft_flags}).items():
            stack.coordinators[name] = [
                stack.launch(
                    "coordinator",
                    ["--target", target.address, *draft_flags[label], *coordinator_args],
                    label=f"coordinator-{name or 'target-only'}-{replica}",
                )
                for replica in range(coordinator_replicas)
            ]
        for replicas in stack.coordinators.values():
            for service in replicas:
                stack.wait_ready(service, timeout_s)
    except BaseException:
        stack.stop()
        raise
    return stack
