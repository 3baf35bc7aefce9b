"""``outrider bench memory``: the resident memory of each process of
``outrider up`` after one chat generation (:class:`outrider.bench.options.MemoryOptions`).

The services start as ``outrider up`` starts them, from its own flags
(``outrider.cli``), so what is measured is what a user runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from outrider.bench.options import MemoryOptions


def resident_mib(pid: int) -> float:
    """The resident set size of process ``pid`` in MiB (``VmRSS``, Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise OSError(f"no VmRSS for process {pid}")


def stack_args(up_flags: Sequence[str]) -> dict[str, Any]:
    """What ``outrider up`` with ``up_flags`` (after an optional ``--``)
    passes to ``start_stack``."""
    from outrider import flags
    from outrider.command_config import UpConfig
    from outrider.stack import serve_flags

    given = list(up_flags)
    if given[:1] == ["--"]:
        given = given[1:]
    parser = argparse.ArgumentParser(prog="outrider up")
    flags.add_flags(parser, UpConfig, env=False)  # as the command line's `up` reads them
    up = flags.build(UpConfig, parser.parse_args(given))
    return serve_flags(up.stack)


def main(options: MemoryOptions) -> int:
    """Starts the services, generates once, prints each one's resident memory and the total."""
    from outrider.client import Client
    from outrider.stack import start_stack

    print("Starting the services of `outrider up` ...", file=sys.stderr, flush=True)
    with (
        start_stack(**stack_args(options.up_flags)) as stack,
        Client(stack.coordinator.address) as client,
    ):
        client.generate(
            messages=[{"role": "user", "content": "Why is the sky blue?"}],
            max_new_tokens=options.max_new_tokens,
        )
        total = 0.0
        for service in stack.services:
            mib = resident_mib(service.process.pid)
            total += mib
            print(f"{service.name:12} {mib:7.0f} MiB")
        print(f"{'total':12} {total:7.0f} MiB")
    return 0
