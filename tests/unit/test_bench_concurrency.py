"""`outrider bench --concurrency`'s pure parts on hand-made numbers: requests,
streams, percentiles, speedups, mismatches, and the run with fake configurations."""

from __future__ import annotations

import asyncio
import io
import json
import types
from pathlib import Path

import pytest

import outrider.client
from outrider import flags
from outrider.bench.concurrency.plot import plot as plot_concurrency
from outrider.bench.concurrency.render import render as render_concurrency
from outrider.bench.concurrency.report import (
    REQUIRED_RUN_KEYS,
    percentile,
    summarize_batch,
    with_speedups,
)
from outrider.bench.concurrency.report import build_report as build_concurrency_report
from outrider.bench.concurrency.run import run_concurrency
from outrider.bench.concurrency.services import Replicas
from outrider.bench.concurrency.streams import (
    Batch,
    LoadConfig,
    Stream,
    batch_requests,
    closed_loop_send_times,
    stream_from_arrivals,
)
from outrider.bench.options import BenchOptions, parse_concurrency_list
from outrider.bench.prompts import Prompt
from tests.bench_numbers import approx4


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# --- concurrency: requests, streams, aggregation -----------------------------------------


def test_a_batch_sends_every_prompt_at_least_once_and_repeats_them_for_more_streams():
    prompts = [Prompt(f"q:{i}", "c", str(i)) for i in range(3)]
    assert [p.id for p in batch_requests(prompts, 1)] == ["q:0", "q:1", "q:2"]
    assert [p.id for p in batch_requests(prompts, 2)] == ["q:0", "q:1", "q:2"]
    assert [p.id for p in batch_requests(prompts, 5)] == ["q:0", "q:1", "q:2", "q:0", "q:1"]


def test_closed_loop_sends_each_later_request_when_an_earlier_one_ends():
    # Two streams, four queued requests created at t=0: the third goes out when the
    # first request ends (t=5), the fourth when the second one ends (t=7).
    assert closed_loop_send_times([0.0, 0.0, 0.0, 0.0], [7.0, 5.0, 12.0, 9.0], 2) == [
        0.0,
        0.0,
        5.0,
        7.0,
    ]


def test_outrider_streams_take_requests_from_one_queue(monkeypatch):
    # Two streams on two replicas (stream s on replica s), four requests of which the first is
    # slow: while it runs, the other stream takes the three fast ones in turn.
    served: dict[str, list[str]] = {"a": [], "b": []}

    class FakeClient:
        def __init__(self, address):
            self.address = address

        async def model_info(self):
            return None

        async def close(self):
            pass

        async def stream(self, messages, **_):
            text = messages[0]["content"]
            served[self.address].append(text)
            await asyncio.sleep(0.5 if text == "slow" else 0.01)
            stats = types.SimpleNamespace(
                rounds=1, draft_tokens=0, accepted_tokens=0, adaptive=False, pipeline=False,
                rounds_by_k=(1,), proposed_tokens=0,
            )  # fmt: skip
            yield types.SimpleNamespace(token_ids=[len(text)], stats=stats)

    monkeypatch.setattr(outrider.client, "AsyncClient", FakeClient)
    requests = [Prompt(f"q:{i}", "c", t) for i, t in enumerate(["slow", "f1", "f2", "f3"])]
    ended: list[int] = []
    batch = Replicas(["a", "b"]).run(requests, 2, 8, ended.append, k=0)
    assert served == {"a": ["slow"], "b": ["f1", "f2", "f3"]}
    assert [s.token_ids for s in batch.streams] == [(4,), (2,), (2,), (2,)]  # in request order
    assert sum(ended) == 4


def test_stream_times_come_from_its_chunks():
    s = stream_from_arrivals(
        [1, 2, 3, 4, 5, 6], 10.0, [(10.5, 1), (10.6, 0), (10.8, 3), (11.3, 2)], rounds=3
    )
    assert s.ttft_s == pytest.approx(0.5)
    assert s.chunk_gaps_s == pytest.approx((0.3, 0.5))  # the empty chunk does not count
    assert s.chunk_tokens == (3, 2)
    assert s.generated_tokens == 6


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 99, 3.97),
        ([4, 1, 3, 2], 0, 1),
        ([7.0], 99, 7.0),
        ([], 50, None),
    ],
)
def test_percentile_interpolates_between_order_statistics(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def stream(tokens, ttft, gaps=(), chunk_tokens=None, **stats) -> Stream:
    return Stream(tuple(tokens), ttft, tuple(gaps), tuple(chunk_tokens or [1] * len(gaps)), **stats)


def test_a_batch_summary_counts_every_stream_over_the_batch_wall_time():
    # Two streams of 6 tokens each over 2 s of wall time: 6 tokens/s in all.
    a = stream(
        range(6),
        0.1,
        gaps=(0.2, 0.4),
        chunk_tokens=(2, 3),
        rounds=3,
        draft_tokens=8,
        accepted_tokens=3,
    )
    b = stream(
        range(6),
        0.3,
        gaps=(0.1, 0.1, 0.1),
        chunk_tokens=(1, 2, 2),
        rounds=4,
        draft_tokens=8,
        accepted_tokens=2,
    )
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


def test_the_k_chosen_and_the_drafts_verified_count_every_batch_of_a_repeat():
    # The median batch ran at K = 0; another drafted: the policy chose both.
    idle = stream(range(4), 0.1, rounds=4, rounds_by_k=(4,))
    drafting = stream(
        range(4), 0.1, rounds=2, rounds_by_k=(0, 0, 2), draft_tokens=3, proposed_tokens=4
    )
    median = Batch(1, (idle,), 1.0, repeats=(Batch(1, (drafting,), 2.0, index=1),))
    row = summarize_batch(median)
    assert row["k_distribution"] == {"0": 0.6667, "2": 0.3333}  # (rounded to 4 places)
    assert row["verified_fraction"] == pytest.approx(3 / 4)
    assert row["tokens_per_s"] == pytest.approx(4.0)  # (the median batch's)


def test_speedup_is_against_concurrency_1_of_the_same_configuration():
    runs = with_speedups(
        [{"concurrency": 1, "tokens_per_s": 10.0}, {"concurrency": 8, "tokens_per_s": 45.0}]
    )
    assert [r["speedup_vs_concurrency_1"] for r in runs] == [1.0, 4.5]
    assert (
        with_speedups([{"concurrency": 8, "tokens_per_s": 45.0}])[0]["speedup_vs_concurrency_1"]
        is None
    )


def concurrency_report(**batches_by_name) -> dict:
    prompts = [Prompt("q:1", "c", "a"), Prompt("q:2", "c", "b")]
    configs = [
        LoadConfig(name, "hf" if name.startswith("hf") else "outrider", None)
        for name in batches_by_name
    ]
    return build_concurrency_report(
        configs, prompts, batches_by_name, {"hf-generate-batch": "RuntimeError: no"}, {"title": "t"}
    )


def batch(n: int, *outputs, wall: float = 1.0) -> Batch:
    return Batch(
        n, tuple(stream(tokens, 0.1, gaps=[0.01] * (len(tokens) - 1)) for tokens in outputs), wall
    )


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


def test_throughput_and_ttft_are_also_given_against_target_only_at_the_same_concurrency():
    def timed(n: int, ttft: float, wall: float) -> Batch:
        return Batch(n, tuple(stream([1, 2], ttft, gaps=[0.01]) for _ in range(2)), wall)

    report = concurrency_report(
        **{
            "outrider-k0": {1: timed(1, 0.2, 1.0), 2: timed(2, 0.4, 1.0)},
            "outrider-int4-adaptive": {1: timed(1, 0.22, 0.5), 2: timed(2, 0.3, 2.0)},
        }
    )
    k0, adaptive = (c["runs"] for c in report["configs"])
    assert [(r["vs_target_only"], r["ttft_vs_target_only"]) for r in k0] == [(1.0, 1.0)] * 2
    assert [r["vs_target_only"] for r in adaptive] == [2.0, 0.5]
    assert [r["ttft_vs_target_only"] for r in adaptive] == [approx4(1.1), approx4(0.75)]


def test_concurrency_mismatches_name_the_reference_and_the_concurrency():
    report = concurrency_report(
        **{
            "hf-generate": {1: batch(1, [1, 2], [3, 4]), 2: batch(2, [1, 2], [3, 9])},
            "outrider-k0": {1: batch(1, [1, 2], [3, 5]), 2: batch(2, [1, 2], [3, 5])},
            "outrider-prompt-lookup-k4": {1: batch(1, [1, 2], [3, 4]), 2: batch(2, [1, 7], [3, 4])},
        }
    )
    found = {
        (m["config"], m["concurrency"], m["prompt"], m["reference"], m["first_difference_at"])
        for m in report["mismatches"]
    }
    assert found == {
        ("hf-generate", 2, "q:2", "hf-generate@1", 1),  # padding changed a token
        ("outrider-k0", 1, "q:2", "hf-generate@1", 1),
        (
            "outrider-k0",
            2,
            "q:2",
            "hf-generate@1",
            1,
        ),  # the same at N=2 as at N=1: no concurrency mismatch
        ("outrider-prompt-lookup-k4", 2, "q:1", "hf-generate@1", 1),
        ("outrider-prompt-lookup-k4", 2, "q:1", "outrider-prompt-lookup-k4@1", 1),
    }
    runs = {c["name"]: c["runs"] for c in report["configs"]}
    assert [
        (r["mismatches_vs_reference"], r["mismatches_vs_concurrency_1"])
        for r in runs["outrider-k0"]
    ] == [(1, 0), (1, 0)]
    # hf-generate at N=1 is the reference: its difference at N=2 is both.
    assert [
        (r["mismatches_vs_reference"], r["mismatches_vs_concurrency_1"])
        for r in runs["hf-generate"]
    ] == [(0, 0), (1, 1)]
    buffer = io.StringIO()
    render_concurrency(report, buffer)
    text = buffer.getvalue()
    assert "MISMATCH: 5" in text and "hf-generate-batch: did not run (RuntimeError: no)" in text


@pytest.mark.parametrize("tokens", [[1, 2, 3], [1]])  # [1]: no inter-token gap to plot
def test_concurrency_plot_is_written(tmp_path, tokens):
    pytest.importorskip("matplotlib")
    report = concurrency_report(
        **{"outrider-k0": {1: batch(1, tokens, tokens), 4: batch(4, *[tokens] * 4)}}
    )
    plot_concurrency(report, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000


# --- concurrency: the run ------------------------------------------------------------------


def fake_config(
    name: str, calls: list, *, fail: bool = False, may_fail: bool = False, adaptive: bool = False
) -> LoadConfig:
    def run(requests, n, max_new_tokens, done):
        calls.append((name, n, len(requests), max_new_tokens))
        if fail:
            raise ValueError("not on this machine")
        done(len(requests))
        return Batch(
            n, tuple(stream([1] * max_new_tokens, 0.1, adaptive=adaptive) for _ in requests), 1.0
        )

    return LoadConfig(name, "hf", run, adaptive=adaptive, may_fail=may_fail)


def test_the_run_warms_up_then_rotates_the_configurations_from_one_concurrency_to_the_next():
    """Each concurrency's requests are first run short and untimed by every
    configuration: the first batch of a shape pays for all."""
    calls: list = []
    prompts = [Prompt("q:1", "c", "a"), Prompt("q:2", "c", "b"), Prompt("q:3", "c", "c")]
    configs = [fake_config("a", calls), fake_config("b", calls)]
    ran, batches, not_run = run_concurrency(configs, prompts, [1, 4], 32, progress=False)
    assert calls == [
        ("a", 1, 1, 16),
        ("b", 1, 1, 16),
        ("a", 1, 3, 4),
        ("b", 1, 3, 4),
        ("a", 1, 3, 32),
        ("b", 1, 3, 32),
        ("a", 4, 4, 4),
        ("b", 4, 4, 4),
        ("b", 4, 4, 32),
        ("a", 4, 4, 32),
    ]
    assert [c.name for c in ran] == ["a", "b"] and not not_run
    assert sorted(batches["a"]) == [1, 4]


def test_a_configuration_that_may_fail_is_left_out_with_its_error():
    calls: list = []
    configs = [
        fake_config("hf-generate-batch", calls, fail=True, may_fail=True),
        fake_config("outrider-k0", calls),
    ]
    ran, batches, not_run = run_concurrency(
        configs, [Prompt("q:1", "c", "a")], [1, 2], 8, progress=False
    )
    assert [c.name for c in ran] == ["outrider-k0"] and list(batches) == ["outrider-k0"]
    assert not_run == {"hf-generate-batch": "ValueError: not on this machine"}
    assert sum(1 for c in calls if c[0] == "hf-generate-batch") == 1  # tried once, at the warm-up


def test_any_other_failure_stops_the_run_naming_the_configuration_and_the_concurrency():
    with pytest.raises(
        RuntimeError, match="outrider-k0 failed at concurrency 1: not on this machine"
    ):
        run_concurrency(
            [fake_config("outrider-k0", [], fail=True)],
            [Prompt("q:1", "c", "a")],
            [1],
            8,
            progress=False,
        )


def test_an_adaptive_configuration_whose_coordinator_fixed_k_is_left_out(capsys):
    configs = [
        fake_config("outrider-pl-adaptive", [], adaptive=False),
        fake_config("outrider-k0", []),
    ]
    configs[0].adaptive = True  # asked for adaptive K, but its streams say K was fixed
    ran, _, _ = run_concurrency(configs, [Prompt("q:1", "c", "a")], [1], 8, progress=False)
    assert [c.name for c in ran] == ["outrider-k0"]
    assert "ignored `adaptive`" in capsys.readouterr().err


# --- concurrency: flags ----------------------------------------------------------------------


def test_concurrency_list_parses_and_the_run_always_holds_1():
    from outrider.cli import build_parser

    assert parse_concurrency_list("64,8,32") == [8, 32, 64]
    assert parse_concurrency_list("1") == [1]
    for bad in ("0", "eight", ""):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_concurrency_list(bad)

    def options(levels: str):
        args = build_parser().parse_args(["bench", "--concurrency", levels])
        return flags.build(BenchOptions, args)

    # Not listed, N = 1 runs once, as the reference; listed, --repeat times.
    assert (options("8,4").levels, options("8,4").reference_once) == ((1, 4, 8), True)
    assert (options("1,8").levels, options("1,8").reference_once) == ((1, 8), False)


def test_a_level_run_once_takes_one_batch_whatever_the_repeat():
    calls: list = []
    configs = [fake_config("outrider-k0", calls), fake_config("a", calls)]
    _, batches, _ = run_concurrency(
        configs, [Prompt("q:1", "c", "a")], [1, 2], 32, repeat=4, once=(1,), progress=False
    )
    timed = [(name, n) for name, n, _, tokens in calls if tokens == 32]
    assert timed.count(("a", 1)) == 1 and timed.count(("outrider-k0", 1)) == 1
    # (at N = 2 the two alternate in pairs, each order as often: k0 a, a k0, a k0, k0 a)
    assert [name for name, n in timed if n == 2] == [
        "outrider-k0", "a", "a", "outrider-k0", "a", "outrider-k0", "outrider-k0", "a"
    ]  # fmt: skip
    assert not batches["a"][1].repeats and len(batches["a"][2].repeats) == 3


def test_coordinator_replicas_need_concurrency(tmp_path, capsys):
    from outrider.cli import main

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    assert main(["bench", "--prompts", str(prompts), "--coordinators", "2"]) == 1
    assert "--coordinators needs --concurrency" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--repeat", "0", "--concurrency", "1,8"], "--repeat must be at least 1"),
    ],
)
def test_repeats_need_one_batch_at_least(tmp_path, capsys, flags, error):
    from outrider.cli import main

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    assert main(["bench", "--prompts", str(prompts), *flags]) == 1
    assert error in capsys.readouterr().err


def test_repeated_batches_report_their_median_and_check_every_output():
    """With ``repeat``, each configuration runs R batches at each N, the order
    rotated each time; the report gives the median batch with every batch's
    figure in run order, the median of the ratios to outrider-k0's batch of
    the same rotation, and a wrong output in any of them is a mismatch — of
    its request, counted once however many batches got it wrong."""
    calls: list = []
    walls = {"a": iter([1.5, 3.0, 2.0, 1.0, 1.0, 1.0]), "b": iter([2.0] * 6)}

    def config(name: str) -> LoadConfig:
        def run(requests, n, max_new_tokens, done):
            calls.append((name, n, max_new_tokens))
            if max_new_tokens < 32:  # a warm-up
                return Batch(n, tuple(stream([1] * max_new_tokens, 0.1) for _ in requests), 1.0)
            wall = next(walls[name])
            tokens = [2] * max_new_tokens if wall in (1.5, 3.0) else [1] * max_new_tokens
            return Batch(n, tuple(stream(tokens, wall / 10) for _ in requests), wall)

        return LoadConfig(name, "outrider", run)

    prompts = [Prompt("q:1", "c", "a")]
    configs = [config("outrider-k0"), config("a"), config("b")]
    walls["outrider-k0"] = iter([1.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    ran, batches, _ = run_concurrency(configs, prompts, [1, 2], 32, repeat=3, progress=False)
    timed = [c[0] for c in calls if c[1] == 1 and c[2] == 32]
    assert timed == ["outrider-k0", "a", "b", "b", "a", "outrider-k0", "a", "b", "outrider-k0"]
    assert batches["a"][1].wall_s == 2.0  # the median of 1.5, 3 and 2 s
    report = build_concurrency_report(ran, prompts, batches)
    run = next(c for c in report["configs"] if c["name"] == "a")["runs"][0]
    assert run["tokens_per_s"] == 16.0
    assert run["tokens_per_s_repeats"] == [approx4(32 / 1.5), approx4(32 / 3), 16.0]
    # (outrider-k0 ran its batches at 32, 16 and 32 tok/s: paired, a ran at 2/3, 2/3 and 1/2 of it)
    assert run["vs_target_only"] == 0.5
    assert run["vs_target_only_paired"] == approx4(2 / 3)
    # (first tokens at a tenth of the wall: 150, 300, 200 ms against 100, 200, 100)
    assert run["ttft_ms_p50_repeats"] == [150.0, 300.0, 200.0]
    assert run["ttft_vs_target_only"] == 2.0 and run["ttft_vs_target_only_paired"] == 1.5
    assert [(m["config"], m["concurrency"]) for m in report["mismatches"]] == [("a", 1)] * 2
    assert (run["mismatches_vs_reference"], run["mismatches_vs_concurrency_1"]) == (1, 0)
    out = io.StringIO()
    render_concurrency(report, out)
    assert "16.00" in out.getvalue() and "(10.67–21.33)" in out.getvalue()
    assert "0.50× (0.67×)" in out.getvalue() and "2.00× (1.50×)" in out.getvalue()
