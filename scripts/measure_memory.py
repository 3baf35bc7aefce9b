"""Resident memory of each process of `outrider up` (the default model on this
machine's CPU unless told otherwise), after one chat generation.

    python scripts/measure_memory.py [--max-new-tokens 64] [-- extra `outrider up` flags]

Prints one line per service (RSS from /proc/PID/status) and the total.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from outrider.cli import _stack_args, build_parser
from outrider.client import Client
from outrider.stack import start_stack


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise OSError(f"no VmRSS for process {pid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args, up_flags = parser.parse_known_args()
    up = build_parser().parse_args(["up", *up_flags])
    with start_stack(**_stack_args(up)) as stack, Client(stack.coordinator.address) as client:
        client.generate(
            messages=[{"role": "user", "content": "Why is the sky blue?"}],
            max_new_tokens=args.max_new_tokens,
        )
        total = 0.0
        for service in stack.services:
            mib = resident_mib(service.process.pid)
            total += mib
            print(f"{service.name:12} {mib:7.0f} MiB")
        print(f"{'total':12} {total:7.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
