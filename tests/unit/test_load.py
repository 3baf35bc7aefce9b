"""What an engine reports of itself (outrider.load)."""

import pytest

from outrider.load import EngineLoad, LoadMeter


def test_the_curve_keeps_one_point_per_power_of_two_range_at_its_average_tokens():
    meter = LoadMeter()
    for tokens, seconds in ((1, 0.01), (3, 0.02), (4, 0.04), (100, 0.5)):
        meter.begin()
        meter.stepped(rows=1, tokens=tokens, seconds=seconds)
    load = meter.load
    # 3 and 4 share the range (2, 4]: their average (decay 0.9) is one point.
    assert [round(t, 3) for t, _ in load.curve] == [1.0, 3.1, 100.0]
    assert load.curve[1][1] == pytest.approx(0.9 * 0.02 + 0.1 * 0.04)
    assert load.steps == 4


def test_the_heartbeat_counts_a_step_as_soon_as_it_begins():
    meter = LoadMeter()
    meter.begin()  # a long step, still running
    assert meter.load.steps == 1 and meter.load.curve == ()


def test_load_averages_the_tokens_and_rows_of_recent_steps():
    meter = LoadMeter()
    meter.stepped(rows=8, tokens=40, seconds=0.1)
    assert (meter.load.tokens_per_step, meter.load.rows_per_step) == (40, 8)
    meter.stepped(rows=4, tokens=20, seconds=0.1)
    assert meter.load.rows_per_step == pytest.approx(0.9 * 8 + 0.1 * 4)


def test_step_cost_is_flat_before_the_first_point_and_follows_the_last_slope_after():
    load = EngineLoad(((4.0, 1.0), (8.0, 2.0)))
    assert load.step_cost(1) == 1.0
    assert load.step_cost(6) == 1.5
    assert load.step_cost(12) == 3.0
    single = EngineLoad(((4.0, 1.0),))
    assert single.step_cost(8) == 2.0  # one point: proportional beyond it


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
