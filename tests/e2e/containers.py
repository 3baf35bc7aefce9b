"""The container engine as the image test drives it: runs the image as the Helm
chart's pods run it (UID 10001, read-only root filesystem, a writable cache
at /var/cache/outrider and /tmp, models mounted read-only at /models), on the
host's network, each container removed at the end whatever happens."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def find_engine() -> str:
    """podman, else docker when its daemon answers; skips the test without either."""
    if shutil.which("podman"):
        return "podman"
    if shutil.which("docker"):
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False)
        if info.returncode == 0:
            return "docker"
        pytest.skip("no podman, and docker's daemon does not answer (apt-get install podman)")
    pytest.skip("no container engine: install podman (apt-get install podman runc) or docker")


LIMIT = 1024
"""Each container's nofile and nproc limits: podman as root raises them by
default, and a VM may refuse that (runc: "error setting rlimits ...
operation not permitted", even at the host's own nproc); a test's three
services need few."""


def run_flags(engine: str) -> list[str]:
    """What every container gets besides its image and command. podman with
    runc: crun, its other runtime, refuses some VMs' cgroup layouts."""
    flags = ["--network=host", f"--ulimit=nofile={LIMIT}:{LIMIT}"]
    flags.append(f"--ulimit=nproc={LIMIT}:{LIMIT}")
    if engine == "podman" and shutil.which("runc"):
        flags.append("--runtime=runc")
    return flags


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Container:
    """``ENGINE run --rm IMAGE ARGS``, as a pod of the chart runs it; its log in ``log``."""

    def __init__(self, engine: str, image: str, name: str, models: Path, log: Path) -> None:
        self.engine, self.name, self.log = engine, name, log
        command = [
            engine, "run", "--rm", f"--name={name}", *run_flags(engine),
            "--read-only",
            # the chart's emptyDirs: anonymous volumes, which start as the
            # image's directories (the cache owned by 10001) and go with --rm
            "--volume=/var/cache/outrider", "--volume=/tmp",
            f"--volume={models}:/models:ro",
            image,
        ]  # fmt: skip
        self._command = command
        self.process: subprocess.Popen | None = None

    def start(self, *args: str) -> Container:
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [*self._command, *args], stdout=out, stderr=subprocess.STDOUT
            )
        return self

    def exec(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.engine, "exec", self.name, *command],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    def stop(self, timeout_s: int = 60) -> int:
        """``ENGINE stop`` (SIGTERM, SIGKILL after ``timeout_s``): the exit status."""
        assert self.process is not None
        subprocess.run(
            [self.engine, "stop", f"--time={timeout_s}", self.name],
            capture_output=True, timeout=timeout_s + 30, check=False,
        )  # fmt: skip
        return self.process.wait(timeout=30)

    def remove(self) -> None:
        """Removes the container whatever its state (a finalizer: never fails)."""
        subprocess.run(
            [self.engine, "rm", "--force", "--time=0", self.name],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_serving(self, port: int, timeout_s: float = 600) -> None:
        """Until ``grpc.health.v1`` on 127.0.0.1:``port`` answers SERVING."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                assert self.process is not None
                if (status := self.process.poll()) is not None:
                    pytest.fail(f"{self.name} exited with {status}:\n{self.tail()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                    if reply.status == SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"{self.name} not SERVING within {timeout_s} s:\n{self.tail()}")
                time.sleep(1)
