"""`outrider bench`'s pure parts: prompt loading, flags and the report's
shape, on hand-made numbers (the measurement math is in
test_bench_measurements.py, `--concurrency`'s in test_bench_concurrency.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from outrider import flags
from outrider.bench.configs import (
    Config,
    Drafter,
    coordinators_of,
    outrider_variants,
    parse_drafter,
    parse_k_list,
)
from outrider.bench.endpoints import OutriderEndpoint, outrider_configs
from outrider.bench.measurements import Measurement
from outrider.bench.options import BenchOptions
from outrider.bench.plot import plot
from outrider.bench.prompts import PROMPT_SETS, Prompt, category_of_file, load_prompts
from outrider.bench.render import render
from outrider.bench.report import REQUIRED_CONFIG_KEYS, build_report
from outrider.bench.runner import run_interleaved, selected, without_ignored_options
from tests.bench_numbers import approx4, m, stats

# --- prompts -----------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_mt_bench_rows_use_their_first_turn_and_category(tmp_path):
    path = write_jsonl(
        tmp_path / "question.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
            {"question_id": 101, "category": "reasoning", "turns": ["Why?"]},
        ],
    )
    prompts = load_prompts(path)
    assert [p.text for p in prompts] == ["Write a poem.", "Why?"]
    assert [p.category for p in prompts] == ["writing", "reasoning"]
    assert prompts[0].id == "question:81"


def test_prompt_rows_without_category_take_the_file_stem(tmp_path):
    path = write_jsonl(
        tmp_path / "HumanEval_prompts.jsonl",
        [{"task_id": "HumanEval/0", "prompt": "def f():\n"}, {"prompt": "x", "category": "code"}],
    )
    prompts = load_prompts(path)
    assert [p.category for p in prompts] == ["humaneval", "code"]
    assert prompts[0].text == "def f():\n"
    assert prompts[0].id == "HumanEval_prompts:HumanEval/0"


@pytest.mark.parametrize(
    ("stem", "category"),
    [
        ("HumanEval_prompts", "humaneval"),
        ("my-questions", "my"),
        ("summaries", "summaries"),
        ("prompts", "prompts"),
    ],
)
def test_category_of_file(stem, category):
    assert category_of_file(Path(f"{stem}.jsonl")) == category


def test_limit_spreads_over_the_file(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(80)])
    assert [p.text for p in load_prompts(path, limit=4)] == ["0", "20", "40", "60"]
    assert len(load_prompts(path, limit=500)) == 80


def test_a_row_without_turns_or_prompt_is_refused_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"text": "no"}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: a row needs `turns`"):
        load_prompts(path)


# --- flags ---------------------------------------------------------------------------


def test_k_list_and_drafters_parse():
    assert parse_k_list("8,4,4") == [4, 8]
    with pytest.raises(ValueError):
        parse_k_list("0")
    with pytest.raises(ValueError):
        parse_k_list("four")
    assert parse_drafter("bf16", target_model="/m").draft_args == (
        "--drafter", "model", "--dtype", "bfloat16", "--model", "/m",
    )  # fmt: skip
    assert parse_drafter("int4", target_model=None) == Drafter(
        "int4", ("--drafter", "int4"), "int4"
    )
    assert parse_drafter("early-exit-8", target_model=None).hf_peer is None
    assert parse_drafter("eagle", target_model="/m") == Drafter(
        "eagle", ("--drafter", "eagle", "--model", "/m"), None
    )  # a head reads the target's embeddings; transformers has no peer
    with pytest.raises(ValueError, match="unknown drafter"):
        parse_drafter("medusa", target_model=None)


def test_every_drafter_configuration_has_a_pipelined_twin_beside_it():
    variants = outrider_variants([None, "int4"], [4, 8], adaptive=True, pipelined=True)
    assert [v.name for v in variants] == [
        "outrider-k0",
        "outrider-int4-k4", "outrider-int4-k4-pipelined",
        "outrider-int4-k8", "outrider-int4-k8-pipelined",
        "outrider-int4-adaptive", "outrider-int4-adaptive-pipelined",
    ]  # fmt: skip
    assert [v.pipeline for v in variants] == [False, False, True, False, True, False, True]
    twin = variants[-1]
    assert (twin.coordinator, twin.drafter, twin.k, twin.adaptive) == ("int4", "int4", None, True)


def test_prompt_lookup_has_no_pipelined_twin():
    # (It drafts in the coordinator, in microseconds: nothing to overlap.)
    variants = outrider_variants(["prompt-lookup"], [4], adaptive=True, pipelined=True)
    assert [v.name for v in variants] == [
        "outrider-k0", "outrider-prompt-lookup-k4", "outrider-prompt-lookup-adaptive"
    ]  # fmt: skip


def test_suffix_beside_a_model_drafter_runs_its_draft_worker_and_has_no_pipelined_twin():
    combined = parse_drafter("suffix+int4", target_model="M")
    assert combined.draft_args == ("--drafter", "int4", "--model", "M")
    assert combined.coordinator_args == ("--suffix-decoding",) and combined.hf_peer is None
    variants = outrider_variants(["suffix+int4"], [4], adaptive=True, pipelined=True)
    assert [v.name for v in variants] == [
        "outrider-k0", "outrider-suffix+int4-k4", "outrider-suffix+int4-adaptive"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="beside a model drafter"):
        parse_drafter("suffix+prompt-lookup", target_model=None)


def test_each_configuration_of_a_drafter_that_keeps_outputs_has_a_coordinator_of_its_own():
    # Suffix decoding drafts from earlier requests' outputs: on a shared
    # coordinator each configuration would find the same prompt's answer
    # that the one before it wrote.
    variants = outrider_variants(["suffix", "int4"], [4], adaptive=True, pipelined=False)
    assert coordinators_of(variants) == {
        "outrider-k0": "suffix",
        "outrider-suffix-k4": "suffix",
        "outrider-suffix-adaptive": "suffix",
        "int4": "int4",
    }
    assert [v.coordinator for v in variants][:3] == [
        "outrider-k0", "outrider-suffix-k4", "outrider-suffix-adaptive"
    ]  # fmt: skip
    plain = outrider_variants(["int4", "suffix+int4"], [4], adaptive=False, pipelined=False)
    assert coordinators_of(plain) == {"int4": "int4", "outrider-suffix+int4-k4": "suffix+int4"}


def test_no_pipelined_leaves_the_twins_out():
    names = [v.name for v in outrider_variants(["int4"], [4], adaptive=True, pipelined=False)]
    assert names == ["outrider-k0", "outrider-int4-k4", "outrider-int4-adaptive"]
    names = [v.name for v in outrider_variants(["int4"], [4], adaptive=False, pipelined=True)]
    assert names == ["outrider-k0", "outrider-int4-k4", "outrider-int4-k4-pipelined"]


def test_sampled_twins_of_target_only_and_adaptive_k_run_last_at_temperature_1():
    variants = outrider_variants([None, "int4"], [4], adaptive=True, pipelined=True, sampled=True)
    sampled = [(v.name, v.k, v.adaptive, v.temperature) for v in variants if v.temperature]
    assert sampled == [
        ("outrider-k0-t1", 0, False, 1.0),
        ("outrider-int4-adaptive-t1", None, True, 1.0),
    ]
    assert variants[-2:] == [v for v in variants if v.temperature]
    assert all(not v.pipeline for v in variants if v.temperature)


def test_a_sampled_request_sends_its_temperature_and_its_prompts_seed():
    endpoint = OutriderEndpoint.__new__(OutriderEndpoint)
    endpoint.client, endpoint.ignore_eos, endpoint.structured_output = FakeClient(), False, None
    variants = outrider_variants([None], [4], adaptive=False, pipelined=False, sampled=True)
    configs = outrider_configs({None: endpoint}, variants)
    assert [c.name for c in configs] == ["outrider-k0", "outrider-k0-t1"]
    for config in configs:
        config.run(Prompt("q:1", "c", "x"), 8)
        config.run(Prompt("q:2", "c", "y"), 8)
    sent = [(r["temperature"], r["seed"]) for r in endpoint.client.requests]
    seeds = {Prompt("q:1", "c", "x").seed, Prompt("q:2", "c", "y").seed}
    assert len(seeds) == 2 and {seed for _, seed in sent} == seeds
    assert {t for t, _ in sent} == {0.0, 1.0}


def test_sampled_outputs_are_not_checked_against_greedy_ones():
    prompts = [Prompt("q:1", "c", "a")]
    configs = [
        Config("outrider-k0", "outrider", None, k=0),
        Config("outrider-k0-t1", "outrider", None, k=0, temperature=1.0),
        Config(
            "outrider-int4-adaptive-t1", "outrider", None, "int4", adaptive=True, temperature=1.0
        ),
    ]
    results = {
        "outrider-k0": [m(10, 1.0, 10)],
        "outrider-k0-t1": [Measurement((7, 7), 10, 1.0, 2, 0, 0, (), 0.0, 0.9, 0.0, 0.0)],
        "outrider-int4-adaptive-t1": [
            Measurement((8, 8), 10, 0.5, 1, 1, 1, (1,), 0.1, 0.3, 0.0, 0.0)
        ],
    }
    report = build_report(configs, prompts, results)
    assert report["mismatches"] == []
    assert report["headline"]["sampled_over_target_only"] == {"outrider-int4-adaptive-t1": 2.0}
    assert report["headline"]["best_outrider"] is None


class FakeClient:
    """The SDK's blocking client, recording what each request asked for."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def generate(self, **request):
        self.requests.append(request)
        return SimpleNamespace(token_ids=(1, 2), stats=stats(pipeline=bool(request["pipeline"])))


def test_every_outrider_configuration_sends_pipeline_explicitly():
    endpoint = OutriderEndpoint.__new__(OutriderEndpoint)
    endpoint.client, endpoint.ignore_eos, endpoint.structured_output = FakeClient(), False, None
    configs = outrider_configs(
        {"int4": endpoint}, outrider_variants(["int4"], [4], adaptive=True, pipelined=True)
    )
    prompt = Prompt("q:1", "c", "x")
    for config in configs:
        assert config.run(prompt, 8).pipeline is config.pipeline
    sent = [
        (r["num_speculative_tokens"], r["adaptive"], r["pipeline"])
        for r in endpoint.client.requests
    ]
    assert sent == [
        (0, False, False),
        (4, False, False),
        (4, False, True),
        (None, True, False),
        (None, True, True),
    ]
    assert [c.pipeline for c in configs] == [False, False, True, False, True]


def test_no_pipelined_flag_reaches_the_options(tmp_path):
    from outrider.cli import build_parser

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    args = build_parser().parse_args(["bench", "--prompts", str(prompts)])
    assert flags.build(BenchOptions, args).pipelined is True
    args = build_parser().parse_args(["bench", "--prompts", str(prompts), "--no-pipelined"])
    assert flags.build(BenchOptions, args).pipelined is False


def test_a_pipelined_configuration_whose_coordinator_did_not_pipeline_is_left_out(capsys):
    configs = [
        Config("outrider-pl-k4", "outrider", None, "pl", 4),
        Config("outrider-pl-k4-pipelined", "outrider", None, "pl", 4, pipeline=True),
        Config(
            "outrider-pl-adaptive-pipelined",
            "outrider",
            None,
            "pl",
            None,
            adaptive=True,
            pipeline=True,
        ),
    ]
    warm = {
        "outrider-pl-k4": m(4, 1.0, 2),
        "outrider-pl-k4-pipelined": m(
            4, 1.0, 2, pipeline=False
        ),  # asked for pipelined rounds, did not get them
        "outrider-pl-adaptive-pipelined": m(4, 1.0, 2, adaptive=True, pipeline=True),
    }
    assert [c.name for c in without_ignored_options(configs, warm)] == [
        "outrider-pl-k4",
        "outrider-pl-adaptive-pipelined",
    ]
    err = capsys.readouterr().err
    assert (
        "ignored `pipeline`" in err and "outrider-pl-k4-pipelined" in err and "adaptive" not in err
    )


def test_configs_select_by_glob_and_always_keep_the_references():
    names = [
        "hf-generate", "outrider-k0", "outrider-int4-k4", "outrider-int4-adaptive",
        "outrider-prompt-lookup-k4", "outrider-prompt-lookup-adaptive", "hf-assisted-int4-k4",
    ]  # fmt: skip
    configs = [Config(name, "outrider", None) for name in names]
    assert selected(configs, ()) == configs

    def chosen(*globs):
        return [c.name for c in selected(configs, globs)]

    assert chosen("outrider-*-adaptive") == [
        "hf-generate", "outrider-k0", "outrider-int4-adaptive", "outrider-prompt-lookup-adaptive"
    ]  # fmt: skip
    assert chosen("outrider-int4-k4", "hf-assisted-*") == [
        "hf-generate", "outrider-k0", "outrider-int4-k4", "hf-assisted-int4-k4"
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"--configs 'outrider-bf16-\*' matches no configuration"):
        chosen("outrider-int4-k4", "outrider-bf16-*")


def test_configs_flag_parses_to_globs(tmp_path, capsys):
    from outrider.cli import build_parser, main

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    args = build_parser().parse_args(
        ["bench", "--prompts", str(prompts), "--configs", " outrider-*-adaptive, outrider-int4-k8"]
    )
    assert flags.build(BenchOptions, args).configs == ("outrider-*-adaptive", "outrider-int4-k8")
    for empty in ("", " , "):
        assert main(["bench", "--prompts", str(prompts), "--configs", empty]) == 1
        assert f"--configs {empty!r}: give configuration names or globs" in capsys.readouterr().err


def test_bench_has_help_naming_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "outrider", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    for flag in (
        "--prompts", "--limit", "--max-new-tokens", "--k", "--drafters", "--no-hf", "--no-adaptive",
        "--no-pipelined", "--json", "--plot", "--threads", "--target-model", "--dtype", "--device",
        "--ignore-eos",
        "--concurrency", "--coordinators", "--no-progress", "--log-level", "--configs", "--repeat",
    ):  # fmt: skip
        assert flag in out.stdout


def test_bench_defaults_to_the_shipped_mt_bench_questions():
    from outrider.cli import build_parser

    options = flags.build(BenchOptions, build_parser().parse_args(["bench"]))
    assert options.prompt_files == (PROMPT_SETS["mt-bench"],)
    prompts = load_prompts(options.prompt_files[0])
    assert len(prompts) == 80
    assert {p.category for p in prompts} == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"
    }  # fmt: skip


def test_shipped_prompt_sets_are_named_and_carry_their_licence_and_provenance():
    from outrider.cli import build_parser

    names = ["mt-bench", "humaneval", "long-context"]
    args = build_parser().parse_args(["bench", *(f"--prompts={name}" for name in names)])
    files = flags.build(BenchOptions, args).prompt_files
    assert files == tuple(PROMPT_SETS[name] for name in names)
    humaneval = load_prompts(files[1])
    assert len(humaneval) == 164
    assert {p.category for p in humaneval} == {"humaneval"}
    long_context = load_prompts(files[2])
    categories = {"code-qa-1k", "code-qa-3k", "summary-1k", "summary-3k"}
    assert sorted(p.category for p in long_context) == sorted(list(categories) * 2)
    for prompt in long_context:  # ~4 characters per token; 1k and 3k tokens
        assert len(prompt.text) > (9_000 if prompt.category.endswith("3k") else 3_000)
    for path in files:
        assert list(path.parent.glob("LICENSE*"))
        assert (path.parent / "PROVENANCE.md").is_file()


def test_missing_prompt_file_is_a_clear_error(capsys):
    from outrider.cli import main

    assert main(["bench", "--prompts", "/nonexistent.jsonl"]) == 1
    assert "--prompts /nonexistent.jsonl: no such file" in capsys.readouterr().err


# --- the report -----------------------------------------------------------------------


def make_report() -> dict:
    prompts = [Prompt("q:1", "writing", "a"), Prompt("q:2", "humaneval", "b")]
    t = dict(draft_time_s=0.0, verify_time_s=0.8, overhead_time_s=0.01, overhead_s=0.0004)
    configs = [
        Config("hf-generate", "hf", None, k=0),
        Config("outrider-k0", "outrider", None, k=0),
        Config("outrider-prompt-lookup-k4", "outrider", None, "prompt-lookup", 4),
        Config("hf-assisted-prompt-lookup-k4", "hf", None, "prompt-lookup", 4),
    ]
    same = m(10, 1.0, 10)
    results = {
        "hf-generate": [same, m(10, 2.0, 10)],
        "outrider-k0": [m(10, 1.0, 10, **t), m(10, 2.0, 10, **t)],
        "outrider-prompt-lookup-k4": [
            m(10, 0.5, 4, 16, 6, (3, 2, 1), **t),
            # A different output on the second prompt.
            Measurement((0, 1, 2, 99), 10, 1.0, 2, 4, 2, (1, 1), 0.001, 0.2, 0.002, 0.0005),
        ],
        "hf-assisted-prompt-lookup-k4": [m(10, 0.8, 5, 12, 5), m(10, 1.5, 5, 12, 5)],
    }
    return build_report(configs, prompts, results, {"title": "test"})


def test_report_has_every_config_with_the_required_keys():
    report = make_report()
    names = [c["name"] for c in report["configs"]]
    assert names == [
        "hf-generate",
        "outrider-k0",
        "outrider-prompt-lookup-k4",
        "hf-assisted-prompt-lookup-k4",
    ]
    for config in report["configs"]:
        assert set(REQUIRED_CONFIG_KEYS) <= config.keys()
        assert set(config["by_category"]) == {"writing", "humaneval"}
    json.dumps(report)  # serialisable


def test_report_numbers():
    report = make_report()
    rows = {c["name"]: c for c in report["configs"]}
    assert rows["hf-generate"]["tokens_per_s"] == approx4(20 / 3)
    assert rows["hf-generate"]["speedup"] == 1.0
    assert rows["outrider-prompt-lookup-k4"]["tokens_per_s"] == approx4(14 / 1.5)
    assert rows["outrider-prompt-lookup-k4"]["speedup"] == pytest.approx(
        round(14 / 1.5 / (20 / 3), 4)
    )
    assert rows["outrider-prompt-lookup-k4"]["accepted_per_position"] == [4, 3, 1]
    assert rows["outrider-prompt-lookup-k4"]["bound_speedup"] is not None
    assert rows["outrider-k0"]["overhead_ms_per_round"] == approx4(0.4)
    assert rows["hf-generate"]["bound_speedup"] is None
    assert rows["hf-generate"]["overhead_ms_per_round"] is None
    assert rows["hf-assisted-prompt-lookup-k4"]["acceptance_rate"] == approx4(10 / 24)
    writing = rows["outrider-prompt-lookup-k4"]["by_category"]["writing"]
    assert writing["tokens_per_s"] == approx4(20.0) and writing["speedup"] == approx4(2.0)


def test_report_flags_mismatches_against_hf_generate():
    report = make_report()
    assert report["mismatch_reference"] == "hf-generate"
    assert report["mismatches"] == [
        {
            "config": "outrider-prompt-lookup-k4", "prompt": "q:2", "first_difference_at": 3,
            "tokens": 4, "reference_tokens": 10, "prompt_tokens": 10, "reference_prompt_tokens": 10,
        }
    ]  # fmt: skip
    rows = {c["name"]: c for c in report["configs"]}
    assert rows["outrider-prompt-lookup-k4"]["mismatches"] == 1
    assert rows["outrider-k0"]["mismatches"] == 0


def test_headline_compares_best_outrider_with_best_hf_assisted():
    h = make_report()["headline"]
    assert h["best_outrider"] == "outrider-prompt-lookup-k4"
    assert h["best_hf_assisted"] == "hf-assisted-prompt-lookup-k4"
    assert h["best_outrider_over_best_hf_assisted"] == pytest.approx(
        round((14 / 1.5) / (20 / 2.3), 4)
    )
    assert h["outrider_k0_over_hf_generate"] == 1.0
    assert h["outrider_k0_within_5pct_of_hf_generate"] is True


def test_without_hf_speedup_is_against_outrider_k0():
    prompts = [Prompt("q:1", "writing", "a")]
    configs = [Config("outrider-k0", "outrider", None, k=0)]
    report = build_report(
        configs,
        prompts,
        {"outrider-k0": [m(10, 1.0, 10, draft_time_s=0.0, verify_time_s=1.0, overhead_time_s=0.0)]},
    )
    assert report["baseline"] == "outrider-k0"
    assert report["configs"][0]["speedup"] == 1.0


def test_render_prints_tables_and_the_headline():
    buffer = io.StringIO()
    render(make_report(), buffer)
    text = buffer.getvalue()
    assert "outrider-prompt-lookup-k4" in text and "humaneval" in text
    assert "MISMATCH" in text
    assert "speedup = tokens/s ÷ tokens/s of hf-generate" in text


def make_pipelined_report() -> dict:
    """outrider-k0, and prompt lookup at K=4 synchronous and pipelined, on one prompt."""
    prompts = [Prompt("q:1", "writing", "a")]
    configs = [
        Config("outrider-k0", "outrider", None, k=0),
        Config("outrider-pl-k4", "outrider", None, "pl", 4),
        Config("outrider-pl-k4-pipelined", "outrider", None, "pl", 4, pipeline=True),
    ]
    spec = dict(
        draft_time_s=0.4, verify_time_s=1.0, overhead_time_s=0.01, overhead_s=0.0005, num_drafts=10
    )
    results = {
        "outrider-k0": [m(10, 1.0, 10, draft_time_s=0.0, verify_time_s=0.8, overhead_time_s=0.0,
                          overhead_s=0.0004, critical_path_overhead_s=0.0004)],
        "outrider-pl-k4": [
            m(37, 1.5, 10, 40, 27, (8, 7, 6, 6), critical_path_overhead_s=0.045, **spec)
        ],
        "outrider-pl-k4-pipelined": [
            m(37, 1.25, 10, 40, 27, (8, 7, 6, 6), pipeline=True, speculation_hits=6,
              speculation_misses=4, critical_path_overhead_s=0.0175, **spec)
        ],
    }  # fmt: skip
    return build_report(configs, prompts, results, {"title": "test"})


def test_report_of_a_pipelined_configuration():
    report = make_pipelined_report()
    json.dumps(report)
    rows = {c["name"]: c for c in report["configs"]}
    pipelined, synchronous = rows["outrider-pl-k4-pipelined"], rows["outrider-pl-k4"]
    assert set(REQUIRED_CONFIG_KEYS) <= pipelined.keys()
    assert (
        pipelined["pipeline"],
        pipelined["speculation_hits"],
        pipelined["speculation_misses"],
    ) == (True, 6, 4)
    assert pipelined["speculation_hit_rate"] == 0.6
    assert synchronous["pipeline"] is False and synchronous["speculation_hit_rate"] is None
    assert pipelined["critical_path_ms_p50"] == approx4(17.5) and synchronous[
        "critical_path_ms_p50"
    ] == approx4(45.0)
    assert pipelined["expected_tokens_per_round"] == approx4(3.7)
    # t_target 80 ms; pipelined T = max(101, 40) ms + 0.4 × 40 ms = 117 ms; synchronous 141 ms.
    assert pipelined["bound_round_ms"] == approx4(117.0) and synchronous[
        "bound_round_ms"
    ] == approx4(141.0)
    assert pipelined["bound_speedup"] == approx4(3.7 * 0.080 / 0.117)
    assert pipelined["achieved_speedup_vs_k0"] == approx4((37 / 1.25) / 10)
    assert pipelined["achieved_over_bound"] == approx4((37 / 1.25 / 10) / (3.7 * 0.080 / 0.117))
    assert report["headline"]["pipelined_over_synchronous"] == {
        "outrider-pl-k4-pipelined": {
            "synchronous": "outrider-pl-k4", "tokens_per_s": approx4(1.5 / 1.25),
            "critical_path_ms_p50": [45.0, 17.5],
        }
    }  # fmt: skip


def test_render_shows_the_critical_path_and_the_hits():
    buffer = io.StringIO()
    render(make_pipelined_report(), buffer)
    text = buffer.getvalue()
    assert "critical path" in text and "hits/misses" in text
    assert ".60 (6/4)" in text and "17.50" in text
    assert (
        "pipelined ÷ synchronous tokens/s: outrider-pl-k4-pipelined 1.20 "
        "(critical path p50 45.00 → 17.50 ms)" in text
    )


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"outrider\[bench\]"):
        plot(make_report(), tmp_path / "x.png")


def test_a_failing_run_names_the_configuration_and_the_prompt():
    def run(prompt, max_new_tokens):
        raise ValueError("the prompt is too long")

    with pytest.raises(RuntimeError, match=r"outrider-k0 failed on q:1: the prompt is too long"):
        run_interleaved(
            [Config("outrider-k0", "outrider", run)], [Prompt("q:1", "c", "x")], 8, progress=False
        )


def test_repeated_requests_report_their_median_and_check_every_output():
    """With ``repeat``, each prompt runs every configuration R times, the
    order rotated each time; each (configuration, prompt) reports its request
    of median wall time, and a wrong output in any repeat is a mismatch."""
    calls: list[str] = []
    walls = {"hf-generate": iter([1.0, 1.0, 1.0]), "outrider-k0": iter([2.0, 0.5, 1.0])}
    wrong = {"outrider-k0": iter([False, True, False])}

    def config(name: str) -> Config:
        def run(prompt, max_new_tokens):
            calls.append(name)
            tokens = 3 if next(wrong.get(name, iter([False] * 3))) else 4
            return m(tokens, next(walls[name]), rounds=4)

        return Config(name, "outrider", run)

    configs = [config("hf-generate"), config("outrider-k0")]
    results = run_interleaved(configs, [Prompt("q:1", "c", "x")], 4, repeat=3, progress=False)
    hf, k0 = "hf-generate", "outrider-k0"
    assert calls == [hf, k0, k0, hf, k0, hf]
    median = results["outrider-k0"][0]
    assert median.wall_s == 1.0 and sorted(r.wall_s for r in median.repeats) == [0.5, 2.0]
    report = build_report(configs, [Prompt("q:1", "c", "x")], results)
    assert [(x["config"], x["first_difference_at"]) for x in report["mismatches"]] == [
        ("outrider-k0", 3)
    ]
    assert next(c for c in report["configs"] if c["name"] == "outrider-k0")["tokens_per_s"] == 4.0
    out = io.StringIO()
    render({**report, "repeat": 3}, out)
    assert "each prompt ran 3 times per configuration" in out.getvalue()
