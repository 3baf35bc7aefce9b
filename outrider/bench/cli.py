"""``outrider bench`` on the command line: its flags, its tools' (``outrider
bench TOOL``), and the run each one starts.

Every flag comes from a field of the command's options dataclass
(:mod:`outrider.bench.options`, through ``outrider.flags``); the command's
description is that dataclass's docstring. Building the parser imports none
of the benchmark's runs: each is imported when its command runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import signal
import sys
from typing import Any, NamedTuple

from outrider import flags
from outrider.bench.options import (
    BenchOptions,
    HttpOptions,
    MemoryOptions,
    PoolOptions,
    PrefixOptions,
    StepsOptions,
)


class Tool(NamedTuple):
    options: type
    """Its options dataclass: its flags, and its description (the docstring)."""
    module: str
    """The module whose ``main(options) -> int`` runs it."""


TOOLS = {
    "steps": Tool(StepsOptions, "outrider.bench.steps"),
    "pool": Tool(PoolOptions, "outrider.bench.pooled_runs"),
    "http": Tool(HttpOptions, "outrider.bench.http_overhead"),
    "memory": Tool(MemoryOptions, "outrider.bench.resident_memory"),
    "prefix": Tool(PrefixOptions, "outrider.bench.prefix_cache"),
}
"""``outrider bench TOOL``, by name."""


def add_bench_parser(commands) -> None:
    """``outrider bench``, its flags and its tools, on the CLI's subcommands."""
    bench = _add_command(commands, "bench", BenchOptions)
    tools = bench.add_subparsers(
        dest="bench_command",
        metavar="TOOL",
        title="tools",
        description="measurements beside the bench (`outrider bench TOOL --help`)",
    )
    for name, tool in TOOLS.items():
        _add_command(tools, name, tool.options)


def _add_command(commands, name: str, options: type):
    """A command whose help is the first paragraph of ``options``' docstring,
    its description the rest, and its flags ``options``' fields."""
    summary, _, description = inspect.cleandoc(options.__doc__ or "").partition("\n\n")
    help_text = summary.replace("%", "%%")  # (argparse formats it)
    parser = commands.add_parser(name, help=help_text, description=description or summary)
    flags.add_flags(parser, options, env=False)
    return parser


def main(args: Any) -> int:
    """``outrider bench [TOOL]``: returns the exit status."""
    name = getattr(args, "bench_command", None)
    command = f"outrider bench {name}" if name else "outrider bench"

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt  # unwinds through the services' cleanup: no orphaned ones

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if name is None:
            from outrider.bench.command import run_bench

            run_bench(flags.build(BenchOptions, args))
            return 0
        tool = TOOLS[name]
        _refuse_bench_flags(args, tool)
        return importlib.import_module(tool.module).main(flags.build(tool.options, args))
    except (ValueError, RuntimeError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


def _refuse_bench_flags(args: Any, tool: Tool) -> None:
    """A ValueError where the bench's own flags come before a tool, which
    would ignore them."""
    own = {f.name for f in dataclasses.fields(tool.options)}
    given = [
        flags.flag_name(name)
        for name, default in flags.flag_defaults(BenchOptions).items()
        if name not in own and getattr(args, name, None) not in (None, default)
    ]
    if given:
        raise ValueError(f"{', '.join(given)}: a flag of `outrider bench` itself, not of this tool")
