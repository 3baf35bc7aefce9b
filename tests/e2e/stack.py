"""`outrider up` as the end-to-end tests run it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def outrider_up(*args: str) -> Iterator[tuple[str, str]]:
    """`outrider up ARGS` on free ports (gRPC and HTTP), stopped at the end
    with SIGTERM twice, as a supervisor that signals the process and then
    its group does: its gRPC address and the base URL of its
    OpenAI-compatible API. The second signal must not cut the stop short:
    no service of its process group may outlive it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "outrider", "up", "--port", "0", "--http-port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        address = api_url = None
        while address is None or api_url is None:
            line = process.stdout.readline() if process.stdout else ""
            if not line:
                pytest.fail(f"`outrider up` exited with {process.wait()} before serving")
            if match := re.search(r"serving on (\S+)", line):
                address = match.group(1)
            if match := re.search(r"OpenAI-compatible API: (\S+)", line):
                api_url = match.group(1)
            if time.monotonic() > deadline:
                pytest.fail("`outrider up` did not start within 300 s")
        yield address, api_url
    finally:
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # stopping its services
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(timeout=60) == 0
            deadline = time.monotonic() + 10
            while _group_alive(process.pid):
                assert time.monotonic() < deadline, "a service outlived `outrider up`"
                time.sleep(0.1)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
