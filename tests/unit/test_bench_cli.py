"""`outrider bench`'s command line: flags generated from its options
dataclasses (`outrider.bench.options`), parsed as they were written by hand."""

from __future__ import annotations

import os

import pytest

from outrider import flags
from outrider.bench.options import BenchOptions
from outrider.bench.prompts import DESCRIBE_SCHEMA, PROMPT_SETS
from outrider.cli import build_parser, main


def bench_options(*argv: str) -> BenchOptions:
    return flags.build(BenchOptions, build_parser().parse_args(["bench", *argv]))


def test_bench_flags_keep_their_defaults():
    options = bench_options()
    assert options == BenchOptions()
    assert (options.prompt_files, options.k, options.drafters) == (
        (PROMPT_SETS["mt-bench"],), (4,), ("prompt-lookup", "int4")
    )  # fmt: skip
    assert (options.max_new_tokens, options.dtype, options.device, options.log_level) == (
        64, "float32", "auto", "warning"
    )  # fmt: skip
    assert (options.hf, options.adaptive, options.pipelined, options.progress) == (True,) * 4
    assert (options.concurrency, options.configs, options.levels) == (None, None, ())
    assert (options.repeat, options.coordinators, options.target_tp, options.draft_tp) == (1,) * 4
    assert options.torch_threads == (os.cpu_count() or 1)


def test_a_json_schema_constrains_outrider_and_leaves_hugging_face_out():
    options = bench_options("--prompts", "describe", "--json-schema", str(DESCRIBE_SCHEMA))
    assert options.prompt_files == (PROMPT_SETS["describe"],)
    assert options.json_schema == DESCRIBE_SCHEMA and not options.hf


def test_bench_flags_parse_to_their_values(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    options = bench_options(
        "--prompts", "humaneval", "--prompts", str(prompts), "--k", "8,2", "--drafters", "",
        "--no-hf", "--concurrency", "8,1", "--threads", "0", "--json", "out.json", "--no-progress",
    )  # fmt: skip
    assert options.prompt_files == (PROMPT_SETS["humaneval"], prompts)
    assert (options.k, options.drafters, options.hf, options.progress) == ((2, 8), (), False, False)
    assert (options.concurrency, options.levels, options.reference_once) == ((1, 8), (1, 8), False)
    assert options.torch_threads == (os.cpu_count() or 1)  # (0: all cores, as before)
    assert str(options.json) == "out.json"


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--k", "four"], "--k 'four': give comma-separated integers"),
        (["--concurrency", "0"], "--concurrency '0': give one or more numbers of streams"),
        (["--drafters", "medusa"], "unknown drafter 'medusa'"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--json-schema", "nowhere.json"], "--json-schema nowhere.json: no such file"),
        (
            ["--json-schema", str(DESCRIBE_SCHEMA), "--concurrency", "8"],
            "--json-schema runs one request at a time",
        ),
    ],
)
def test_a_bad_value_is_the_bench_s_error_not_a_usage_error(capsys, flags, error):
    assert main(["bench", *flags]) == 1
    assert f"outrider bench: {error}" in capsys.readouterr().err


def test_bench_reads_no_environment_variables(monkeypatch, capsys):
    monkeypatch.setenv("OUTRIDER_DEVICE", "cuda")
    monkeypatch.setenv("OUTRIDER_MAX_NEW_TOKENS", "8")
    assert (bench_options().device, bench_options().max_new_tokens) == ("auto", 64)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "[env" not in capsys.readouterr().out


def test_the_bench_s_own_flags_before_a_tool_are_refused(capsys):
    assert main(["bench", "--k", "8", "--no-hf", "pool", "run.json"]) == 1
    assert "--k, --no-hf: a flag of `outrider bench` itself" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["steps", "pool", "http", "memory"])
def test_every_tool_has_help_from_its_options(tool, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["bench", tool, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"usage: outrider bench {tool}")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert tool in capsys.readouterr().out.split("TOOL", 1)[1]
