"""`outrider bench memory`: the services of `outrider up`, from its own flags
(the run itself starts them: run it by hand)."""

from __future__ import annotations

import os

from outrider.bench.resident_memory import resident_mib, stack_args
from outrider.cli import build_parser


def test_the_flags_after_the_double_dash_are_outrider_up_s():
    args = build_parser().parse_args(["bench", "memory", "--max-new-tokens", "8", "--", "--k", "6"])
    assert (args.bench_command, args.max_new_tokens, args.up_flags) == (
        "memory",
        8,
        ["--", "--k", "6"],
    )
    started = stack_args(("--", "--drafter", "int4", "--k", "6", "--threads", "2"))
    assert started["draft_args"][-2:] == ["--drafter", "int4"]
    assert "--threads" in started["target_args"]
    assert started["coordinator_args"][-2:] == ["--num-speculative-tokens", "6"]
    assert stack_args(("--drafter", "prompt-lookup"))["with_draft"] is False


def test_resident_memory_is_read_from_proc():
    assert 1 < resident_mib(os.getpid()) < 1 << 20
