"""`outrider bench`'s pure parts: prompt loading, aggregation, the analytic bound,
Hugging Face round counting and the report's shape, on hand-made numbers; and the
same for `--concurrency` (requests, streams, percentiles, speedups, mismatches, the run
with fake configurations)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from outrider.bench.bound import analytic_bound
from outrider.bench.command import options_from_args, parse_concurrency_list
from outrider.bench.concurrency.plot import plot as plot_concurrency
from outrider.bench.concurrency.render import render as render_concurrency
from outrider.bench.concurrency.report import REQUIRED_RUN_KEYS, percentile, summarize_batch, with_speedups
from outrider.bench.concurrency.report import build_report as build_concurrency_report
from outrider.bench.concurrency.run import run_concurrency
from outrider.bench.concurrency.streams import (
    Batch,
    LoadConfig,
    Stream,
    batch_requests,
    closed_loop_send_times,
    stream_from_arrivals,
)
from outrider.bench.configs import Config, Drafter, outrider_variants, parse_drafter, parse_k_list
from outrider.bench.endpoints import OutriderEndpoint, outrider_configs
from outrider.bench.hf import rounds_from_forward_calls
from outrider.bench.measurements import Measurement, aggregate, measurement_from_stats
from outrider.bench.plot import plot
from outrider.bench.prompts import Prompt, category_of_file, load_prompts
from outrider.bench.render import render
from outrider.bench.report import REQUIRED_CONFIG_KEYS, build_report
from outrider.bench.runner import interleaved_order, run_interleaved, without_ignored_options

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
    [("HumanEval_prompts", "humaneval"), ("my-questions", "my"), ("summaries", "summaries"), ("prompts", "prompts")],
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
    assert parse_drafter("int4", target_model=None) == Drafter("int4", ("--drafter", "int4"), "int4")
    assert parse_drafter("early-exit-8", target_model=None).hf_peer is None
    with pytest.raises(ValueError, match="unknown drafter"):
        parse_drafter("medusa", target_model=None)


def test_every_drafter_configuration_has_a_pipelined_twin_beside_it():
    variants = outrider_variants([None, "prompt-lookup"], [4, 8], adaptive=True, pipelined=True)
    assert [v.name for v in variants] == [
        "outrider-k0",
        "outrider-prompt-lookup-k4", "outrider-prompt-lookup-k4-pipelined",
        "outrider-prompt-lookup-k8", "outrider-prompt-lookup-k8-pipelined",
        "outrider-prompt-lookup-adaptive", "outrider-prompt-lookup-adaptive-pipelined",
    ]  # fmt: skip
    assert [v.pipeline for v in variants] == [False, False, True, False, True, False, True]
    twin = variants[-1]
    assert (twin.coordinator, twin.drafter, twin.k, twin.adaptive) == ("prompt-lookup", "prompt-lookup", None, True)


def test_no_pipelined_leaves_the_twins_out():
    names = [v.name for v in outrider_variants(["int4"], [4], adaptive=True, pipelined=False)]
    assert names == ["outrider-k0", "outrider-int4-k4", "outrider-int4-adaptive"]
    names = [v.name for v in outrider_variants(["int4"], [4], adaptive=False, pipelined=True)]
    assert names == ["outrider-k0", "outrider-int4-k4", "outrider-int4-k4-pipelined"]


class FakeClient:
    """The SDK's blocking client, recording what each request asked for."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def generate(self, **request):
        self.requests.append(request)
        return SimpleNamespace(token_ids=(1, 2), stats=stats(pipeline=bool(request["pipeline"])))


def test_every_outrider_configuration_sends_pipeline_explicitly():
    endpoint = OutriderEndpoint.__new__(OutriderEndpoint)
    endpoint.client, endpoint.ignore_eos = FakeClient(), False
    configs = outrider_configs({"prompt-lookup": endpoint}, [4], adaptive=True, pipelined=True)
    prompt = Prompt("q:1", "c", "x")
    for config in configs:
        assert config.run(prompt, 8).pipeline is config.pipeline
    sent = [(r["num_speculative_tokens"], r["adaptive"], r["pipeline"]) for r in endpoint.client.requests]
    assert sent == [(0, False, False), (4, False, False), (4, False, True), (None, True, False), (None, True, True)]
    assert [c.pipeline for c in configs] == [False, False, True, False, True]


def test_no_pipelined_flag_reaches_the_options(tmp_path):
    from outrider.cli import build_parser

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    args = build_parser().parse_args(["bench", "--prompts", str(prompts)])
    assert options_from_args(args).pipelined is True
    args = build_parser().parse_args(["bench", "--prompts", str(prompts), "--no-pipelined"])
    assert options_from_args(args).pipelined is False


def test_a_pipelined_configuration_whose_coordinator_did_not_pipeline_is_left_out(capsys):
    configs = [
        Config("outrider-pl-k4", "outrider", None, "pl", 4),
        Config("outrider-pl-k4-pipelined", "outrider", None, "pl", 4, pipeline=True),
        Config("outrider-pl-adaptive-pipelined", "outrider", None, "pl", None, adaptive=True, pipeline=True),
    ]
    warm = {
        "outrider-pl-k4": m(4, 1.0, 2),
        "outrider-pl-k4-pipelined": m(4, 1.0, 2, pipeline=False),  # asked for pipelined rounds, did not get them
        "outrider-pl-adaptive-pipelined": m(4, 1.0, 2, adaptive=True, pipeline=True),
    }
    assert [c.name for c in without_ignored_options(configs, warm)] == ["outrider-pl-k4", "outrider-pl-adaptive-pipelined"]
    err = capsys.readouterr().err
    assert "ignored `pipeline`" in err and "outrider-pl-k4-pipelined" in err and "adaptive" not in err


def test_bench_has_help_naming_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "outrider", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for flag in (
        "--prompts", "--limit", "--max-new-tokens", "--k", "--drafters", "--no-hf", "--no-adaptive", "--no-pipelined",
        "--json", "--plot", "--threads", "--target-model", "--dtype", "--device", "--ignore-eos",
        "--concurrency", "--coordinators", "--no-progress", "--log-level",
    ):  # fmt: skip
        assert flag in out.stdout


def test_missing_prompt_file_is_a_clear_error(capsys):
    from outrider.cli import main

    assert main(["bench", "--prompts", "/nonexistent.jsonl"]) == 1
    assert "--prompts /nonexistent.jsonl: no such file" in capsys.readouterr().err


# --- Hugging Face round counting -----------------------------------------------------


def test_rounds_of_plain_generate_verify_nothing():
    # Prompt of 26: prefill, then one token per call; 4 tokens generated.
    calls = [(26, 0), (1, 26), (1, 27), (1, 28)]
    assert rounds_from_forward_calls(calls, 26, 30) == (0, 0, ())


def test_rounds_of_assisted_generation():
    # Recorded from transformers 5.23 with an assistant that agrees on everything:
    # 4 drafts + bonus, 4 drafts + bonus, then 1 draft + bonus = 12 tokens.
    calls = [(30, 0), (5, 30), (2, 35)]
    assert rounds_from_forward_calls(calls, 26, 38) == (9, 9, (3, 2, 2, 2))


def test_rounds_of_prompt_lookup_with_rejections():
    # Round 1: 4 drafts, none accepted (commits 1). Round 2: 3 drafts, 2 accepted
    # (commits 3). Round 3: no draft (commits 1).
    calls = [(14, 0), (4, 10), (1, 13)]
    assert rounds_from_forward_calls(calls, 10, 15) == (7, 2, (1, 1))


# --- aggregation and the bound -----------------------------------------------------


def m(tokens: int, wall: float, rounds: int, drafted: int = 0, accepted: int = 0, per_position=(), **fields) -> Measurement:
    return Measurement(
        token_ids=tuple(range(tokens)), prompt_tokens=10, wall_s=wall, rounds=rounds,
        draft_tokens=drafted, accepted_tokens=accepted, accepted_per_position=tuple(per_position), **fields,
    )  # fmt: skip


def test_aggregate_sums_and_pads_the_histograms():
    a = m(10, 1.0, 4, 8, 6, (3, 2, 1), draft_time_s=0.1, verify_time_s=0.5, rpc_time_s=0.01, overhead_s=0.001)
    b = m(30, 2.0, 10, 40, 20, (8, 6, 4, 2), draft_time_s=0.2, verify_time_s=1.0, rpc_time_s=0.02, overhead_s=0.003)
    c = m(20, 1.0, 5, 20, 15, (5, 5, 3, 2), draft_time_s=0.1, verify_time_s=0.5, rpc_time_s=0.01, overhead_s=0.002)
    t = aggregate([a, b, c])
    assert (t.generated_tokens, t.rounds, t.draft_tokens, t.accepted_tokens) == (60, 19, 68, 41)
    assert t.accepted_per_position == (16, 13, 8, 4)
    assert t.tokens_per_s == pytest.approx(15.0)
    assert t.acceptance_rate == pytest.approx(41 / 68)
    assert t.mean_acceptance_length == pytest.approx((41 + 19) / 19)
    assert t.overhead_s_p50 == pytest.approx(0.002)
    assert t.verify_time_s == pytest.approx(2.0)


def test_aggregate_without_time_split_has_none():
    t = aggregate([m(10, 1.0, 10)])
    assert t.draft_time_s is None and t.overhead_s_p50 is None
    assert t.acceptance_rate is None  # nothing drafted
    assert t.mean_acceptance_length == 1.0


def test_aggregate_sums_hits_and_misses_and_takes_the_median_critical_path():
    a = m(10, 1.0, 4, 8, 6, pipeline=True, speculation_hits=3, speculation_misses=1, critical_path_overhead_s=0.001)
    b = m(10, 1.0, 4, 8, 6, pipeline=True, speculation_hits=1, speculation_misses=2, critical_path_overhead_s=0.004)
    c = m(10, 1.0, 4, 8, 6, pipeline=True, speculation_hits=2, speculation_misses=1, critical_path_overhead_s=0.002)
    t = aggregate([a, b, c])
    assert (t.speculation_hits, t.speculation_misses) == (6, 4)
    assert t.speculation_hit_rate == pytest.approx(0.6)
    assert t.critical_path_overhead_s_p50 == pytest.approx(0.002)  # the median of the per-request medians
    synchronous = aggregate([m(10, 1.0, 4)])
    assert synchronous.speculation_hit_rate is None and synchronous.critical_path_overhead_s_p50 is None


def stats(**fields):
    """The SDK's GenerationStats, as far as the bench reads it."""
    base = dict(
        prompt_tokens=12, rounds=5, draft_tokens=16, accepted_tokens=9, accepted_per_position=[4, 3, 2],
        draft_time_s=0.01, verify_time_s=0.5, rpc_time_s=0.005, overhead_s_p50=0.0008, adaptive=False,
        num_drafts=4,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **fields})


def test_a_measurement_carries_the_pipelined_statistics():
    got = measurement_from_stats(
        [1, 2, 3], stats(pipeline=True, speculation_hits=3, speculation_misses=1, critical_path_overhead_s_p50=0.0021), 0.1
    )
    assert (got.pipeline, got.speculation_hits, got.speculation_misses) == (True, 3, 1)
    assert got.critical_path_overhead_s == pytest.approx(0.0021)
    assert got.num_drafts == 4 and got.accepted_per_position == (4, 3, 2)


def test_a_measurement_from_a_server_without_pipelining_has_none_of_it():
    got = measurement_from_stats([1, 2, 3], stats(), 0.1)
    assert (got.pipeline, got.speculation_hits, got.speculation_misses) == (False, 0, 0)
    assert got.critical_path_overhead_s is None


def iid_tokens_per_round(alpha: float, k: float) -> float:
    """DESIGN §5's E, each position accepted independently with probability α."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def test_bound_on_hand_made_numbers():
    # outrider-k0: 100 rounds, 8 s of verify and 0.1 s of RPC -> t_target = 81 ms.
    k0 = aggregate([m(100, 9.0, 100, verify_time_s=8.0, draft_time_s=0.0, rpc_time_s=0.1)])
    # 50 rounds, K=4 drafted in full (200 drafts), 100 accepted, draft 2 ms a token,
    # verify 120 ms a round, rpc 1 ms a round.
    spec = aggregate(
        [m(150, 7.0, 50, 200, 100, (40, 30, 20, 10), draft_time_s=0.4, verify_time_s=6.0, rpc_time_s=0.05, num_drafts=50)]
    )
    bound = analytic_bound(spec, k0)
    e = 1 + 100 / 50  # the accepted drafts plus the recovered or bonus token
    t = 4 * 0.002 + 0.120 + 0.001  # 0.129
    assert bound.expected_tokens_per_round == pytest.approx(e)
    assert bound.round_time_s == pytest.approx(t)
    assert bound.speedup == pytest.approx(e * 0.081 / t)


def test_runs_of_acceptance_give_e_above_the_iid_one():
    # 10 rounds of 4 drafts: half accept all four, half none. α = 0.5, so the
    # i.i.d. formula says 1.94 tokens a round; the rounds committed 3.
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, rpc_time_s=0.0)])
    spec = aggregate([m(30, 1.0, 10, 40, 20, (5, 5, 5, 5), draft_time_s=0.0, verify_time_s=1.0, rpc_time_s=0.0, num_drafts=10)])
    bound = analytic_bound(spec, k0)
    assert bound.alpha == 0.5
    assert bound.expected_tokens_per_round == pytest.approx(3.0)
    assert bound.expected_tokens_per_round > iid_tokens_per_round(0.5, 4) == pytest.approx(1.9375)
    assert bound.tokens_per_round == pytest.approx(spec.mean_acceptance_length)


def test_e_counts_the_rounds_that_drafted_and_the_speedup_every_round():
    # Adaptive K: 6 of 10 rounds drafted (2 tokens each), 9 drafts accepted.
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, rpc_time_s=0.0)])
    spec = aggregate([m(19, 1.0, 10, 12, 9, (6, 3), draft_time_s=0.0, verify_time_s=1.0, rpc_time_s=0.0, num_drafts=6)])
    bound = analytic_bound(spec, k0)
    assert bound.expected_tokens_per_round == pytest.approx(1 + 9 / 6)
    assert bound.drafting_share == pytest.approx(0.6)
    assert bound.tokens_per_round == pytest.approx(1 + 9 / 10) == pytest.approx(spec.mean_acceptance_length)
    assert bound.speedup == pytest.approx(1.9 * 0.1 / 0.1)


def test_e_without_a_count_of_drafting_rounds_takes_every_round():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, rpc_time_s=0.0)])
    spec = aggregate([m(19, 1.0, 10, 20, 9, (6, 3), draft_time_s=0.0, verify_time_s=1.0, rpc_time_s=0.0)])
    assert analytic_bound(spec, k0).expected_tokens_per_round == pytest.approx(1.9)


def test_bound_uses_the_mean_drafts_per_round():
    # Prompt lookup proposed 2 tokens a round on average, all accepted: E = 3.
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, rpc_time_s=0.0)])
    spec = aggregate([m(30, 1.0, 10, 20, 20, (10, 10), draft_time_s=0.0, verify_time_s=1.5, rpc_time_s=0.0, num_drafts=10)])
    bound = analytic_bound(spec, k0)
    assert bound.mean_draft_tokens == 2.0
    assert bound.speedup == pytest.approx(3 * 0.1 / 0.15)


def pipelined_totals(draft_time_s: float, hits: int, misses: int):
    """10 rounds of 4 drafts (k̄ = 4), verify 100 ms and rpc 1 ms a round, 27 accepted (E = 3.7)."""
    return aggregate(
        [
            m(37, 1.0, 10, 40, 27, (8, 7, 6, 6), draft_time_s=draft_time_s, verify_time_s=1.0, rpc_time_s=0.01,
              num_drafts=10, pipeline=True, speculation_hits=hits, speculation_misses=misses)
        ]
    )  # fmt: skip


def test_pipelined_round_time_when_the_verify_is_the_longer():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=0.8, draft_time_s=0.0, rpc_time_s=0.0)])  # t_target = 80 ms
    bound = analytic_bound(pipelined_totals(0.4, hits=6, misses=4), k0, pipelined=True)  # t_draft = 10 ms
    assert bound.hit_rate == pytest.approx(0.6)
    # The draft's 40 ms a round (d̄) overlap the verify's 100 + 1 ms; a miss (40%) drafts afresh first.
    t = max(0.101, 0.040) + 0.4 * 0.040  # 0.117
    assert bound.round_time_s == pytest.approx(t)
    assert bound.speedup == pytest.approx(3.7 * 0.080 / t)


def test_pipelined_round_time_when_the_draft_is_the_longer():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=0.8, draft_time_s=0.0, rpc_time_s=0.0)])
    totals = pipelined_totals(1.2, hits=6, misses=4)  # d̄ = 120 ms a round > 101 ms
    pipelined = analytic_bound(totals, k0, pipelined=True)
    assert pipelined.round_time_s == pytest.approx(0.120 + 0.4 * 0.120)  # 0.168
    # Synchronous, the same numbers cost 4 × 30 + 100 + 1 = 221 ms a round.
    assert analytic_bound(totals, k0).round_time_s == pytest.approx(0.221)


def test_pipelined_rounds_without_hits_or_misses_count_as_misses():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=0.8, draft_time_s=0.0, rpc_time_s=0.0)])
    bound = analytic_bound(pipelined_totals(0.4, hits=0, misses=0), k0, pipelined=True)
    assert bound.hit_rate == 0.0
    assert bound.round_time_s == pytest.approx(0.040 + 0.101)


def test_no_bound_without_time_split():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, rpc_time_s=0.0)])
    assert analytic_bound(aggregate([m(10, 1.0, 10)]), k0) is None


def test_interleaved_order_rotates():
    configs = [Config(n, "hf", lambda p, k: None) for n in "abc"]
    assert [c.name for c in interleaved_order(configs, 0)] == ["a", "b", "c"]
    assert [c.name for c in interleaved_order(configs, 4)] == ["b", "c", "a"]


def approx4(value: float):
    """The report rounds to 4 decimals."""
    return pytest.approx(value, abs=1e-4)


# --- the report -----------------------------------------------------------------------


def make_report() -> dict:
    prompts = [Prompt("q:1", "writing", "a"), Prompt("q:2", "humaneval", "b")]
    t = dict(draft_time_s=0.0, verify_time_s=0.8, rpc_time_s=0.01, overhead_s=0.0004)
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
    assert names == ["hf-generate", "outrider-k0", "outrider-prompt-lookup-k4", "hf-assisted-prompt-lookup-k4"]
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
    assert rows["outrider-prompt-lookup-k4"]["speedup"] == pytest.approx(round(14 / 1.5 / (20 / 3), 4))
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
    assert h["best_outrider_over_best_hf_assisted"] == pytest.approx(round((14 / 1.5) / (20 / 2.3), 4))
    assert h["outrider_k0_over_hf_generate"] == 1.0
    assert h["outrider_k0_within_5pct_of_hf_generate"] is True


def test_without_hf_speedup_is_against_outrider_k0():
    prompts = [Prompt("q:1", "writing", "a")]
    configs = [Config("outrider-k0", "outrider", None, k=0)]
    report = build_report(configs, prompts, {"outrider-k0": [m(10, 1.0, 10, draft_time_s=0.0, verify_time_s=1.0, rpc_time_s=0.0)]})
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
    spec = dict(draft_time_s=0.4, verify_time_s=1.0, rpc_time_s=0.01, overhead_s=0.0005, num_drafts=10)
    results = {
        "outrider-k0": [m(10, 1.0, 10, draft_time_s=0.0, verify_time_s=0.8, rpc_time_s=0.0, overhead_s=0.0004,
                          critical_path_overhead_s=0.0004)],
        "outrider-pl-k4": [m(37, 1.5, 10, 40, 27, (8, 7, 6, 6), critical_path_overhead_s=0.045, **spec)],
        "outrider-pl-k4-pipelined": [
            m(37, 1.25, 10, 40, 27, (8, 7, 6, 6), pipeline=True, speculation_hits=6, speculation_misses=4,
              critical_path_overhead_s=0.0175, **spec)
        ],
    }  # fmt: skip
    return build_report(configs, prompts, results, {"title": "test"})


def test_report_of_a_pipelined_configuration():
    report = make_pipelined_report()
    json.dumps(report)
    rows = {c["name"]: c for c in report["configs"]}
    pipelined, synchronous = rows["outrider-pl-k4-pipelined"], rows["outrider-pl-k4"]
    assert set(REQUIRED_CONFIG_KEYS) <= pipelined.keys()
    assert (pipelined["pipeline"], pipelined["speculation_hits"], pipelined["speculation_misses"]) == (True, 6, 4)
    assert pipelined["speculation_hit_rate"] == 0.6
    assert synchronous["pipeline"] is False and synchronous["speculation_hit_rate"] is None
    assert pipelined["critical_path_ms_p50"] == approx4(17.5) and synchronous["critical_path_ms_p50"] == approx4(45.0)
    assert pipelined["expected_tokens_per_round"] == approx4(3.7)
    # t_target 80 ms; pipelined T = max(101, 40) ms + 0.4 × 40 ms = 117 ms; synchronous 141 ms.
    assert pipelined["bound_round_ms"] == approx4(117.0) and synchronous["bound_round_ms"] == approx4(141.0)
    assert pipelined["bound_speedup"] == approx4(3.7 * 0.080 / 0.117)
    assert pipelined["achieved_speedup_vs_k0"] == approx4((37 / 1.25) / 10)
    assert pipelined["achieved_over_bound"] == approx4((37 / 1.25 / 10) / (3.7 * 0.080 / 0.117))
    assert report["headline"]["pipelined_over_synchronous"] == {
        "outrider-pl-k4-pipelined": {
            "synchronous": "outrider-pl-k4", "tokens_per_s": approx4(1.5 / 1.25), "critical_path_ms_p50": [45.0, 17.5],
        }
    }  # fmt: skip


def test_render_shows_the_critical_path_and_the_hits():
    buffer = io.StringIO()
    render(make_pipelined_report(), buffer)
    text = buffer.getvalue()
    assert "critical path" in text and "hits/misses" in text
    assert ".60 (6/4)" in text and "17.50" in text
    assert "pipelined ÷ synchronous tokens/s: outrider-pl-k4-pipelined 1.20 (critical path p50 45.00 → 17.50 ms)" in text


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match=r"outrider\[bench\]"):
        plot(make_report(), tmp_path / "x.png")


def test_a_failing_run_names_the_configuration_and_the_prompt():
    def run(prompt, max_new_tokens):
        raise ValueError("the prompt is too long")

    with pytest.raises(RuntimeError, match=r"outrider-k0 failed on q:1: the prompt is too long"):
        run_interleaved([Config("outrider-k0", "outrider", run)], [Prompt("q:1", "c", "x")], 8, progress=False)


# --- concurrency: requests, streams, aggregation -----------------------------------------


def test_a_batch_sends_every_prompt_at_least_once_and_repeats_them_for_more_streams():
    prompts = [Prompt(f"q:{i}", "c", str(i)) for i in range(3)]
    assert [p.id for p in batch_requests(prompts, 1)] == ["q:0", "q:1", "q:2"]
    assert [p.id for p in batch_requests(prompts, 2)] == ["q:0", "q:1", "q:2"]
    assert [p.id for p in batch_requests(prompts, 5)] == ["q:0", "q:1", "q:2", "q:0", "q:1"]


def test_closed_loop_sends_each_later_request_when_an_earlier_one_ends():
    # Two streams, four queued requests created at t=0: the third goes out when the
    # first request ends (t=5), the fourth when the second one ends (t=7).
    assert closed_loop_send_times([0.0, 0.0, 0.0, 0.0], [7.0, 5.0, 12.0, 9.0], 2) == [0.0, 0.0, 5.0, 7.0]


def test_stream_times_come_from_its_chunks():
    s = stream_from_arrivals([1, 2, 3, 4, 5, 6], 10.0, [(10.5, 1), (10.6, 0), (10.8, 3), (11.3, 2)], rounds=3)
    assert s.ttft_s == pytest.approx(0.5)
    assert s.chunk_gaps_s == pytest.approx((0.3, 0.5))  # the empty chunk does not count
    assert s.chunk_tokens == (3, 2)
    assert s.generated_tokens == 6


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([1, 2, 3, 4], 50, 2.5), ([1, 2, 3, 4], 99, 3.97), ([4, 1, 3, 2], 0, 1), ([7.0], 99, 7.0), ([], 50, None)],
)
def test_percentile_interpolates_between_order_statistics(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def stream(tokens, ttft, gaps=(), chunk_tokens=None, **stats) -> Stream:
    return Stream(tuple(tokens), ttft, tuple(gaps), tuple(chunk_tokens or [1] * len(gaps)), **stats)


def test_a_batch_summary_counts_every_stream_over_the_batch_wall_time():
    # Two streams of 6 tokens each over 2 s of wall time: 6 tokens/s in all.
    a = stream(range(6), 0.1, gaps=(0.2, 0.4), chunk_tokens=(2, 3), rounds=3, draft_tokens=8, accepted_tokens=3)
    b = stream(range(6), 0.3, gaps=(0.1, 0.1, 0.1), chunk_tokens=(1, 2, 2), rounds=4, draft_tokens=8, accepted_tokens=2)
    row = summarize_batch(Batch(2, (a, b), 2.0))
    assert (row["concurrency"], row["requests"], row["generated_tokens"]) == (2, 2, 12)
    assert row["tokens_per_s"] == pytest.approx(6.0)
    assert row["ttft_ms_p50"] == pytest.approx(200.0)
    assert row["ttft_ms_p99"] == pytest.approx(298.0)
    # Chunk gaps 0.1, 0.1, 0.1, 0.2, 0.4; per token 0.05, 0.05, 0.1, 0.1, 0.1333.
    assert row["itl_ms_p50"] == pytest.approx(100.0)
    assert row["itl_ms_p99"] == pytest.approx(1000 * (0.2 + 0.96 * 0.2))
    assert row["itl_per_token_ms_p50"] == pytest.approx(100.0)
    assert row["tokens_per_chunk"] == approx4(12 / 7)
    assert row["acceptance_rate"] == pytest.approx(5 / 16)
    assert row["mean_acceptance_length"] == approx4((5 + 7) / 7)


def test_speedup_is_against_concurrency_1_of_the_same_configuration():
    runs = with_speedups([{"concurrency": 1, "tokens_per_s": 10.0}, {"concurrency": 8, "tokens_per_s": 45.0}])
    assert [r["speedup_vs_concurrency_1"] for r in runs] == [1.0, 4.5]
    assert with_speedups([{"concurrency": 8, "tokens_per_s": 45.0}])[0]["speedup_vs_concurrency_1"] is None


def concurrency_report(**batches_by_name) -> dict:
    prompts = [Prompt("q:1", "c", "a"), Prompt("q:2", "c", "b")]
    configs = [LoadConfig(name, "hf" if name.startswith("hf") else "outrider", None) for name in batches_by_name]
    return build_concurrency_report(configs, prompts, batches_by_name, {"hf-generate-batch": "RuntimeError: no"}, {"title": "t"})


def batch(n: int, *outputs, wall: float = 1.0) -> Batch:
    return Batch(n, tuple(stream(tokens, 0.1, gaps=[0.01] * (len(tokens) - 1)) for tokens in outputs), wall)


def test_concurrency_report_has_a_run_per_concurrency_with_the_required_keys():
    report = concurrency_report(
        **{
            "hf-generate": {1: batch(1, [1, 2], [3, 4]), 2: batch(2, [1, 2], [3, 4], wall=0.5)},
            "outrider-k0": {1: batch(1, [1, 2], [3, 4], wall=2.0), 2: batch(2, [1, 2], [3, 4])},
        }
    )
    assert report["mode"] == "concurrency" and report["concurrency"] == [1, 2]
    assert [c["name"] for c in report["configs"]] == ["hf-generate", "outrider-k0"]
    for config in report["configs"]:
        assert [r["concurrency"] for r in config["runs"]] == [1, 2]
        for run in config["runs"]:
            assert set(REQUIRED_RUN_KEYS) <= run.keys()
    k0 = report["configs"][1]["runs"]
    assert [r["tokens_per_s"] for r in k0] == [2.0, 4.0]
    assert [r["speedup_vs_concurrency_1"] for r in k0] == [1.0, 2.0]
    assert report["not_run"] == {"hf-generate-batch": "RuntimeError: no"}
    assert report["mismatches"] == [] and report["mismatch_reference"] == "hf-generate@1"
    json.dumps(report)


def test_concurrency_mismatches_name_the_reference_and_the_concurrency():
    report = concurrency_report(
        **{
            "hf-generate": {1: batch(1, [1, 2], [3, 4]), 2: batch(2, [1, 2], [3, 9])},
            "outrider-k0": {1: batch(1, [1, 2], [3, 5]), 2: batch(2, [1, 2], [3, 5])},
            "outrider-prompt-lookup-k4": {1: batch(1, [1, 2], [3, 4]), 2: batch(2, [1, 7], [3, 4])},
        }
    )
    found = {(m["config"], m["concurrency"], m["prompt"], m["reference"], m["first_difference_at"]) for m in report["mismatches"]}
    assert found == {
        ("hf-generate", 2, "q:2", "hf-generate@1", 1),  # padding changed a token
        ("outrider-k0", 1, "q:2", "hf-generate@1", 1),
        ("outrider-k0", 2, "q:2", "hf-generate@1", 1),  # the same at N=2 as at N=1: no concurrency mismatch
        ("outrider-prompt-lookup-k4", 2, "q:1", "hf-generate@1", 1),
        ("outrider-prompt-lookup-k4", 2, "q:1", "outrider-prompt-lookup-k4@1", 1),
    }
    runs = {c["name"]: c["runs"] for c in report["configs"]}
    assert [(r["mismatches_vs_reference"], r["mismatches_vs_concurrency_1"]) for r in runs["outrider-k0"]] == [(1, 0), (1, 0)]
    # hf-generate at N=1 is the reference: its difference at N=2 is both.
    assert [(r["mismatches_vs_reference"], r["mismatches_vs_concurrency_1"]) for r in runs["hf-generate"]] == [(0, 0), (1, 1)]
    buffer = io.StringIO()
    render_concurrency(report, buffer)
    text = buffer.getvalue()
    assert "MISMATCH: 5" in text and "hf-generate-batch: did not run (RuntimeError: no)" in text


@pytest.mark.parametrize("tokens", [[1, 2, 3], [1]])  # [1]: no inter-token gap to plot
def test_concurrency_plot_is_written(tmp_path, tokens):
    pytest.importorskip("matplotlib")
    report = concurrency_report(**{"outrider-k0": {1: batch(1, tokens, tokens), 4: batch(4, *[tokens] * 4)}})
    plot_concurrency(report, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000


# --- concurrency: the run ------------------------------------------------------------------


def fake_config(name: str, calls: list, *, fail: bool = False, may_fail: bool = False, adaptive: bool = False) -> LoadConfig:
    def run(requests, n, max_new_tokens, done):
        calls.append((name, n, len(requests), max_new_tokens))
        if fail:
            raise ValueError("not on this machine")
        done(len(requests))
        return Batch(n, tuple(stream([1] * max_new_tokens, 0.1, adaptive=adaptive) for _ in requests), 1.0)

    return LoadConfig(name, "hf", run, adaptive=adaptive, may_fail=may_fail)


def test_the_run_warms_up_then_rotates_the_configurations_from_one_concurrency_to_the_next():
    calls: list = []
    prompts = [Prompt("q:1", "c", "a"), Prompt("q:2", "c", "b"), Prompt("q:3", "c", "c")]
    configs = [fake_config("a", calls), fake_config("b", calls)]
    ran, batches, not_run = run_concurrency(configs, prompts, [1, 4], 32, progress=False)
    assert calls == [("a", 1, 1, 16), ("b", 1, 1, 16), ("a", 1, 3, 32), ("b", 1, 3, 32), ("b", 4, 4, 32), ("a", 4, 4, 32)]
    assert [c.name for c in ran] == ["a", "b"] and not not_run
    assert sorted(batches["a"]) == [1, 4]


def test_a_configuration_that_may_fail_is_left_out_with_its_error():
    calls: list = []
    configs = [fake_config("hf-generate-batch", calls, fail=True, may_fail=True), fake_config("outrider-k0", calls)]
    ran, batches, not_run = run_concurrency(configs, [Prompt("q:1", "c", "a")], [1, 2], 8, progress=False)
    assert [c.name for c in ran] == ["outrider-k0"] and list(batches) == ["outrider-k0"]
    assert not_run == {"hf-generate-batch": "ValueError: not on this machine"}
    assert sum(1 for c in calls if c[0] == "hf-generate-batch") == 1  # tried once, at the warm-up


def test_any_other_failure_stops_the_run_naming_the_configuration_and_the_concurrency():
    with pytest.raises(RuntimeError, match="outrider-k0 failed at concurrency 1: not on this machine"):
        run_concurrency([fake_config("outrider-k0", [], fail=True)], [Prompt("q:1", "c", "a")], [1], 8, progress=False)


def test_an_adaptive_configuration_whose_coordinator_fixed_k_is_left_out(capsys):
    configs = [fake_config("outrider-pl-adaptive", [], adaptive=False), fake_config("outrider-k0", [])]
    configs[0].adaptive = True  # asked for adaptive K, but its streams say K was fixed
    ran, _, _ = run_concurrency(configs, [Prompt("q:1", "c", "a")], [1], 8, progress=False)
    assert [c.name for c in ran] == ["outrider-k0"]
    assert "ignored `adaptive`" in capsys.readouterr().err


# --- concurrency: flags ----------------------------------------------------------------------


def test_concurrency_list_parses_and_always_holds_1():
    assert parse_concurrency_list("64,8,32") == [1, 8, 32, 64]
    assert parse_concurrency_list("1") == [1]
    for bad in ("0", "eight", ""):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_concurrency_list(bad)


def test_coordinator_replicas_need_concurrency(tmp_path, capsys):
    from outrider.cli import main

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    assert main(["bench", "--prompts", str(prompts), "--coordinators", "2"]) == 1
    assert "--coordinators needs --concurrency" in capsys.readouterr().err
