"""What an engine reports of itself (outrider.engine_load)."""

import numpy as np
import pytest

from outrider.engine_load import WINDOW, EngineLoad, LoadMeter
from outrider.wire import load_from_pb, load_to_pb


def test_the_surface_keeps_one_point_per_range_of_rows_and_tokens_at_its_medians():
    meter = LoadMeter()
    steps = ((1, 1, 0.01), (1, 3, 0.02), (1, 4, 0.04), (1, 3, 0.03), (1, 100, 0.5), (8, 40, 0.9))
    for rows, tokens, seconds in steps:
        meter.begin()
        meter.stepped(rows=rows, tokens=tokens, seconds=seconds)
    load = meter.load
    # 3, 4 and 3 tokens in a row share a range: their medians are one point;
    # 40 tokens in 8 rows are a point of their own.
    assert load.curve == ((1.0, 1.0, 0.01), (1.0, 3.0, 0.03), (1.0, 100.0, 0.5), (8.0, 40.0, 0.9))
    assert load.steps == 6


def test_a_rare_slow_step_leaves_the_surface_and_an_old_one_leaves_it_for_good():
    meter = LoadMeter()
    meter.stepped(rows=1, tokens=1, seconds=0.9)  # a shape's first, eager run
    for _ in range(2):
        meter.stepped(rows=1, tokens=1, seconds=0.003)
    assert meter.load.curve == ((1.0, 1.0, 0.003),)
    for _ in range(WINDOW):
        meter.stepped(rows=1, tokens=1, seconds=0.005)  # the cost moved
    assert meter.load.curve == ((1.0, 1.0, 0.005),)


def test_the_heartbeat_counts_a_step_as_soon_as_it_begins():
    meter = LoadMeter()
    meter.begin()  # a long step, still running
    assert meter.load.steps == 1 and meter.load.curve == ()


def test_load_is_the_median_rows_and_tokens_of_recent_steps():
    meter = LoadMeter()
    meter.stepped(rows=8, tokens=40, seconds=0.1)
    assert (meter.load.tokens_per_step, meter.load.rows_per_step) == (40, 8)
    meter.stepped(rows=4, tokens=20, seconds=0.1)
    meter.stepped(rows=8, tokens=40, seconds=0.1)
    meter.stepped(rows=1, tokens=256, seconds=0.4)  # a prefill chunk
    meter.stepped(rows=8, tokens=40, seconds=0.1)
    assert (meter.load.tokens_per_step, meter.load.rows_per_step) == (40, 8)


def test_step_cost_is_flat_before_the_first_point_and_follows_the_last_slope_after():
    load = EngineLoad(((1.0, 2.0, 1.0), (1.0, 4.0, 1.0), (1.0, 8.0, 2.0)))
    assert [load.step_cost(t) for t in (1, 6, 16)] == [1.0, 1.5, 4.0]
    assert list(load.step_costs(np.array([1, 6, 16]), 1)) == [1.0, 1.5, 4.0]
    single = EngineLoad(((1.0, 4.0, 1.0),))
    assert single.step_cost(8) == 2.0  # one point: proportional beyond it
    assert EngineLoad().step_cost(4) is None


def test_step_cost_follows_the_measured_rows_nearest_those_asked():
    # A one-row prefill of 64 tokens costs half a verify of 8 rows of 8.
    load = EngineLoad(((1.0, 1.0, 0.05), (1.0, 64.0, 0.15), (8.0, 8.0, 0.08), (8.0, 64.0, 0.3)))
    assert load.step_cost(64, rows=1) == 0.15
    assert load.step_cost(64, rows=8) == 0.3
    assert load.step_cost(64, rows=6) == 0.3  # rows 5-8 are the range of 8
    assert load.step_cost(64, rows=2) == 0.15  # nearer 1 than 8
    assert load.step_cost(64, rows=3) == 0.3  # 3-4: nearer 8 than 1
    assert load.step_cost(120, rows=64) == pytest.approx(0.3 + (120 - 64) * 0.22 / 56)
    costs = load.step_costs(np.array([64.0, 64.0]), np.array([1.0, 8.0]))
    assert list(costs) == [0.15, 0.3]


def test_a_step_under_way_says_how_long_it_has_run():
    meter = LoadMeter()
    assert meter.load.running_s == 0.0
    meter.begin()
    assert meter.load.running_s > 0.0
    meter.stepped(rows=1, tokens=1, seconds=0.01)
    assert meter.load.running_s == 0.0


def test_a_reset_forgets_the_warm_up_but_not_the_heartbeat():
    meter = LoadMeter()
    meter.begin()
    meter.stepped(rows=1, tokens=3, seconds=0.2)  # a cold step
    meter.reset()
    assert meter.load.curve == () and meter.load.rows_per_step == 0
    assert meter.load.steps == 1


def test_the_engines_work_between_steps_is_a_median_per_row_of_recent_steps():
    meter = LoadMeter()
    meter.stepped(rows=8, tokens=8, seconds=0.01, work_s=0.016)
    assert meter.load.work_per_row_s == pytest.approx(0.002)
    meter.stepped(rows=8, tokens=8, seconds=0.01, work_s=0.016)
    meter.stepped(rows=1, tokens=1, seconds=0.01, work_s=0.5)  # (a rare slow one)
    assert meter.load.work_per_row_s == pytest.approx(0.002)


def test_the_surface_crosses_the_wire_and_a_curve_without_rows_is_one_range():
    load = EngineLoad(((1.0, 60.0, 0.15), (8.0, 40.0, 0.2)), 12.0, 8.0, 7, 0.01, 0.002)
    assert load_from_pb(load_to_pb(load)) == load
    by_tokens = load_to_pb(load)
    del by_tokens.curve_rows[:]  # a worker that measures by tokens alone
    assert load_from_pb(by_tokens).curve == ((1.0, 60.0, 0.15), (1.0, 40.0, 0.2))


def test_decode_costs_follow_the_steps_of_a_token_a_row_whatever_their_rows():
    load = EngineLoad(
        (
            (1.0, 1.0, 0.020),
            (2.0, 2.0, 0.026),
            (2.0, 12.0, 0.060),  # a sync of committed tokens: not a decode step
            (6.0, 6.0, 0.037),
        )
    )
    assert list(load.decode_costs(np.array([1.0, 4.0, 8.0]))) == pytest.approx(
        [0.020, 0.026 + 2 * 0.011 / 4, 0.037 + 2 * 0.011 / 4]
    )
    assert list(EngineLoad(((4.0, 12.0, 0.1),)).decode_costs(np.array([2.0]))) == [0.1]


def test_a_decode_step_is_priced_by_the_decode_steps_where_its_range_of_rows_has_one():
    # Logged by the CPU target at 4 sessions: the range of 3-4 rows holds
    # the decode steps (3-4 tokens) and verifies of a draft or two a row.
    load = EngineLoad(
        ((1.0, 1.0, 0.0516), (3.0, 3.0, 0.0521), (3.0, 8.0, 0.0725), (4.0, 20.0, 0.1))
    )
    assert load.step_cost(4.0, rows=4.0) == pytest.approx(
        0.0521 + 0.0204 / 5
    )  # the verifies' slope
    assert load.decode_cost(4.0) == pytest.approx(0.0521 + 0.0005 / 2)
    assert load.decode_cost(16.0) is None  # no decode step of 9-16 rows measured
    assert EngineLoad(((4.0, 20.0, 0.1),)).decode_cost(4.0) is None


def feed(meter: LoadMeter, *steps: tuple[int, int, float]) -> None:
    for rows, tokens, seconds in steps:
        meter.begin()
        meter.stepped(rows=rows, tokens=tokens, seconds=seconds)


@pytest.mark.parametrize("stale", ["fewer tokens", "more tokens"])
def test_of_two_points_that_disagree_the_older_leaves_the_surface(stale):
    """In a range of rows a step of more tokens never costs less: where two
    points say it does, the one measured longer ago goes (at 8 streams on
    the CPU a decode point kept a batch's first, slow steps while every
    session drafted, and K = 0 looked dearer than drafting)."""
    meter = LoadMeter()
    decode, verify = (8, 8, 0.115), (8, 12, 0.104)
    feed(meter, *((decode, verify) if stale == "fewer tokens" else (verify, decode)))
    fresh = verify if stale == "fewer tokens" else decode
    assert meter.load.curve == (tuple(map(float, fresh)),)
    # Once agreeing, both stay.
    feed(meter, (8, 8, 0.090) if stale == "fewer tokens" else (8, 12, 0.140))
    assert len(meter.load.curve) == 2


def test_of_two_decode_points_that_disagree_the_older_leaves_the_surface():
    """Decode steps, a token a row, never cost less for more rows."""
    meter = LoadMeter()
    feed(meter, (2, 2, 0.030), (4, 4, 0.020), (1, 1, 0.015))
    assert [point[0] for point in meter.load.curve] == [1.0, 4.0]


def test_beyond_the_last_point_the_slope_spans_at_least_a_doubling():
    # 63 and 65 tokens are medians of two ranges: their slope is noise.
    load = EngineLoad(((4.0, 8.0, 0.10), (4.0, 63.0, 0.18), (4.0, 65.0, 0.28)))
    assert load.step_cost(129) == pytest.approx(0.28 + 64 * (0.28 - 0.10) / 57)
