"""`outrider bench`'s measurement math on hand-made numbers: Hugging Face
round counting, aggregation of a configuration's requests, and the
analytic bound (the command, prompts and report are in test_bench.py)."""

from __future__ import annotations

import pytest

from outrider.bench.bound import analytic_bound
from outrider.bench.configs import Config
from outrider.bench.hf import rounds_from_forward_calls
from outrider.bench.measurements import aggregate, measurement_from_stats
from outrider.bench.runner import interleaved_order
from tests.bench_numbers import m, stats

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
    # The draft's 40 ms a round (d̄) overlap the verify's 100 ms, after the
    # round's 1 ms of RPCs; a miss (40%) drafts afresh first.
    t = 0.001 + max(0.100, 0.040) + 0.4 * 0.040  # 0.117
    assert bound.round_time_s == pytest.approx(t)
    assert bound.speedup == pytest.approx(3.7 * 0.080 / t)


def test_pipelined_round_time_when_the_draft_is_the_longer():
    k0 = aggregate([m(10, 1.0, 10, verify_time_s=0.8, draft_time_s=0.0, overhead_time_s=0.0)])
    totals = pipelined_totals(1.2, hits=6, misses=4)  # d̄ = 120 ms a round > 100 ms
    pipelined = analytic_bound(totals, k0, pipelined=True)
    assert pipelined.round_time_s == pytest.approx(0.001 + 0.120 + 0.4 * 0.120)  # 0.169
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


def test_interleaved_order_rotates_and_reverses():
    configs = [Config(n, "hf", lambda p, k: None) for n in "abc"]
    assert [c.name for c in interleaved_order(configs, 0)] == ["a", "b", "c"]
    assert [c.name for c in interleaved_order(configs, 1)] == ["c", "b", "a"]
    assert [c.name for c in interleaved_order(configs, 4)] == ["c", "a", "b"]
    assert [c.name for c in interleaved_order(configs, 5)] == ["b", "a", "c"]
