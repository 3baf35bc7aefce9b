"""`outrider bench`'s pure parts: prompt loading, aggregation, the analytic bound,
Hugging Face round counting and the report's shape, on hand-made numbers
(`--concurrency`'s are in test_bench_concurrency.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from outrider.bench.bound import analytic_bound
from outrider.bench.command import options_from_args
from outrider.bench.configs import Config, Drafter, outrider_variants, parse_drafter, parse_k_list
from outrider.bench.endpoints import OutriderEndpoint, outrider_configs
from outrider.bench.hf import rounds_from_forward_calls
from outrider.bench.measurements import Measurement, aggregate, measurement_from_stats
from outrider.bench.plot import plot
from outrider.bench.prompts import PROMPT_SETS, Prompt, category_of_file, load_prompts
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
    assert (twin.coordinator, twin.drafter, twin.k, twin.adaptive) == (
        "prompt-lookup",
        "prompt-lookup",
        None,
        True,
    )


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
    assert options_from_args(args).pipelined is True
    args = build_parser().parse_args(["bench", "--prompts", str(prompts), "--no-pipelined"])
    assert options_from_args(args).pipelined is False


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
        "--concurrency", "--coordinators", "--no-progress", "--log-level",
    ):  # fmt: skip
        assert flag in out.stdout


def test_bench_defaults_to_the_shipped_mt_bench_questions():
    from outrider.cli import build_parser

    options = options_from_args(build_parser().parse_args(["bench"]))
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
    files = options_from_args(args).prompt_files
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


def m(
    tokens: int,
    wall: float,
    rounds: int,
    drafted: int = 0,
    accepted: int = 0,
    per_position=(),
    **fields,
) -> Measurement:
    return Measurement(
        token_ids=tuple(range(tokens)), prompt_tokens=10, wall_s=wall, rounds=rounds,
        draft_tokens=drafted, accepted_tokens=accepted, accepted_per_position=tuple(per_position),
        **fields,
    )  # fmt: skip


def test_aggregate_sums_and_pads_the_histograms():
    a = m(
        10,
        1.0,
        4,
        8,
        6,
        (3, 2, 1),
        draft_time_s=0.1,
        verify_time_s=0.5,
        overhead_time_s=0.01,
        overhead_s=0.001,
    )
    b = m(
        30,
        2.0,
        10,
        40,
        20,
        (8, 6, 4, 2),
        draft_time_s=0.2,
        verify_time_s=1.0,
        overhead_time_s=0.02,
        overhead_s=0.003,
    )
    c = m(
        20,
        1.0,
        5,
        20,
        15,
        (5, 5, 3, 2),
        draft_time_s=0.1,
        verify_time_s=0.5,
        overhead_time_s=0.01,
        overhead_s=0.002,
    )
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
    a = m(
        10,
        1.0,
        4,
        8,
        6,
        pipeline=True,
        speculation_hits=3,
        speculation_misses=1,
        critical_path_overhead_s=0.001,
    )
    b = m(
        10,
        1.0,
        4,
        8,
        6,
        pipeline=True,
        speculation_hits=1,
        speculation_misses=2,
        critical_path_overhead_s=0.004,
    )
    c = m(
        10,
        1.0,
        4,
        8,
        6,
        pipeline=True,
        speculation_hits=2,
        speculation_misses=1,
        critical_path_overhead_s=0.002,
    )
    t = aggregate([a, b, c])
    assert (t.speculation_hits, t.speculation_misses) == (6, 4)
    assert t.speculation_hit_rate == pytest.approx(0.6)
    assert t.critical_path_overhead_s_p50 == pytest.approx(
        0.002
    )  # the median of the per-request medians
    synchronous = aggregate([m(10, 1.0, 4)])
    assert (
        synchronous.speculation_hit_rate is None
        and synchronous.critical_path_overhead_s_p50 is None
    )


def stats(**fields):
    """The SDK's GenerationStats, as far as the bench reads it."""
    base = dict(
        prompt_tokens=12, rounds=5, draft_tokens=16, accepted_tokens=9,
        accepted_per_position=[4, 3, 2], draft_time_s=0.01, verify_time_s=0.5,
        overhead_time_s=0.005, overhead_s_p50=0.0008, adaptive=False, num_drafts=4,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **fields})


def test_a_measurement_carries_the_pipelined_statistics():
    got = measurement_from_stats(
        [1, 2, 3],
        stats(
            pipeline=True,
            speculation_hits=3,
            speculation_misses=1,
            critical_path_overhead_s_p50=0.0021,
        ),
        0.1,
    )
    assert (got.pipeline, got.speculation_hits, got.speculation_misses) == (True, 3, 1)
    assert got.critical_path_overhead_s == pytest.approx(0.0021)
    assert got.num_drafts == 4 and got.accepted_per_position == (4, 3, 2)


def test_a_measurement_from_a_server_without_pipelining_has_none_of_it():
    got = measurement_from_stats([1, 2, 3], stats(), 0.1)
    assert (got.pipeline, got.speculation_hits, got.speculation_misses) == (False, 0, 0)
    assert got.critical_path_overhead_s is None


def iid_tokens_per_round(alpha: float, k: float) -> float:
    """The cost model's E, each position accepted independently with probability α."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def test_bound_on_hand_made_numbers():
    # outrider-k0: 100 rounds, 8 s of verify and 0.1 s of RPC -> t_target = 81 ms.
    k0 = aggregate([m(100, 9.0, 100, verify_time_s=8.0, draft_time_s=0.0, overhead_time_s=0.1)])
    # 50 rounds, K=4 drafted in full (200 drafts), 100 accepted, draft 2 ms a token,
    # verify 120 ms a round, rpc 1 ms a round.
    spec = aggregate(
        [
            m(
                150,
                7.0,
                50,
                200,
                100,
                (40, 30, 20, 10),
                draft_time_s=0.4,
                verify_time_s=6.0,
                overhead_time_s=0.05,
                num_drafts=50,
            )
        ]
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
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, overhead_time_s=0.0)])
    spec = aggregate(
        [
            m(
                30,
                1.0,
                10,
                40,
                20,
                (5, 5, 5, 5),
                draft_time_s=0.0,
                verify_time_s=1.0,
                overhead_time_s=0.0,
                num_drafts=10,
            )
        ]
    )
    bound = analytic_bound(spec, k0)
    assert bound.alpha == 0.5
    assert bound.expected_tokens_per_round == pytest.approx(3.0)
    assert bound.expected_tokens_per_round > iid_tokens_per_round(0.5, 4) == pytest.approx(1.9375)
    assert bound.tokens_per_round == pytest.approx(spec.mean_acceptance_length)


def test_e_counts_the_rounds_that_drafted_and_the_speedup_every_round():
    # Adaptive K: 6 of 10 rounds drafted (2 tokens each), 9 drafts accepted.
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, overhead_time_s=0.0)])
    spec = aggregate(
        [
            m(
                19,
                1.0,
                10,
                12,
                9,
                (6, 3),
                draft_time_s=0.0,
                verify_time_s=1.0,
                overhead_time_s=0.0,
                num_drafts=6,
            )
        ]
    )
    bound = analytic_bound(spec, k0)
    assert bound.expected_tokens_per_round == pytest.approx(1 + 9 / 6)
    assert bound.drafting_share == pytest.approx(0.6)
    assert (
        bound.tokens_per_round
        == pytest.approx(1 + 9 / 10)
        == pytest.approx(spec.mean_acceptance_length)
    )
    assert bound.speedup == pytest.approx(1.9 * 0.1 / 0.1)


def test_e_without_a_count_of_drafting_rounds_takes_every_round():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, overhead_time_s=0.0)])
    spec = aggregate(
        [m(19, 1.0, 10, 20, 9, (6, 3), draft_time_s=0.0, verify_time_s=1.0, overhead_time_s=0.0)]
    )
    assert analytic_bound(spec, k0).expected_tokens_per_round == pytest.approx(1.9)


def test_bound_uses_the_mean_drafts_per_round():
    # Prompt lookup proposed 2 tokens a round on average, all accepted: E = 3.
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, overhead_time_s=0.0)])
    spec = aggregate(
        [
            m(
                30,
                1.0,
                10,
                20,
                20,
                (10, 10),
                draft_time_s=0.0,
                verify_time_s=1.5,
                overhead_time_s=0.0,
                num_drafts=10,
            )
        ]
    )
    bound = analytic_bound(spec, k0)
    assert bound.mean_draft_tokens == 2.0
    assert bound.speedup == pytest.approx(3 * 0.1 / 0.15)


def pipelined_totals(draft_time_s: float, hits: int, misses: int):
    """10 rounds of 4 drafts (k̄ = 4), verify 100 ms and rpc 1 ms a round, 27 accepted (E = 3.7)."""
    return aggregate(
        [
            m(37, 1.0, 10, 40, 27, (8, 7, 6, 6), draft_time_s=draft_time_s, verify_time_s=1.0,
              overhead_time_s=0.01, num_drafts=10, pipeline=True, speculation_hits=hits,
              speculation_misses=misses)
        ]
    )  # fmt: skip


def test_pipelined_round_time_when_the_verify_is_the_longer():
    k0 = aggregate(
        [m(10, 1.0, 10, verify_time_s=0.8, draft_time_s=0.0, overhead_time_s=0.0)]
    )  # t_target = 80 ms
    bound = analytic_bound(
        pipelined_totals(0.4, hits=6, misses=4), k0, pipelined=True
    )  # t_draft = 10 ms
    assert bound.hit_rate == pytest.approx(0.6)
    # The draft's 40 ms a round (d̄) overlap the verify's 100 + 1 ms; a miss
    # (40%) drafts afresh first.
    t = max(0.101, 0.040) + 0.4 * 0.040  # 0.117
    assert bound.round_time_s == pytest.approx(t)
    assert bound.speedup == pytest.approx(3.7 * 0.080 / t)


def test_pipelined_round_time_when_the_draft_is_the_longer():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=0.8, draft_time_s=0.0, overhead_time_s=0.0)])
    totals = pipelined_totals(1.2, hits=6, misses=4)  # d̄ = 120 ms a round > 101 ms
    pipelined = analytic_bound(totals, k0, pipelined=True)
    assert pipelined.round_time_s == pytest.approx(0.120 + 0.4 * 0.120)  # 0.168
    # Synchronous, the same numbers cost 4 × 30 + 100 + 1 = 221 ms a round.
    assert analytic_bound(totals, k0).round_time_s == pytest.approx(0.221)


def test_pipelined_rounds_without_hits_or_misses_count_as_misses():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=0.8, draft_time_s=0.0, overhead_time_s=0.0)])
    bound = analytic_bound(pipelined_totals(0.4, hits=0, misses=0), k0, pipelined=True)
    assert bound.hit_rate == 0.0
    assert bound.round_time_s == pytest.approx(0.040 + 0.101)


def test_no_bound_without_time_split():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=1.0, draft_time_s=0.0, overhead_time_s=0.0)])
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
