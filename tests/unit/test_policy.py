"""Adaptive K on hand-made costs, where the best K is known."""

import pytest

from coordinator.policy import AdaptiveK, CostModel, expected_tokens


def costs(*, draft: float, verify: dict[int, float], overhead: float = 0.0) -> CostModel:
    model = CostModel(decay=0.0)  # no smoothing: the last sample is the value
    for k, seconds in verify.items():
        model.observe(
            num_drafts=k, draft_s=draft * k, verify_s=seconds, overhead_s=overhead, drafted=k > 0
        )
    return model


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_free_drafts_and_flat_verify_draft_the_maximum():
    policy = AdaptiveK(8, costs(draft=0.0, verify={0: 1.0, 4: 1.0}))
    policy.accepted, policy.rejected = 9.0, 1.0
    assert policy.choose(limit=100) == 8


def test_hopeless_drafts_fall_back_to_target_only_and_probe():
    policy = AdaptiveK(8, costs(draft=0.3, verify={0: 1.0, 4: 1.45, 8: 1.85}))
    policy.accepted, policy.rejected = 0.0, 10.0
    choices = [policy.choose(limit=100) for _ in range(16)]
    assert choices.count(0) == 14 and choices.count(1) == 2  # a probe every 8th round


def test_a_draft_slower_than_the_target_is_never_consulted_again():
    # The bfloat16 target as its own draft on a CPU: every draft is accepted,
    # but a draft step costs more than a target step, so even α = 1 loses and
    # probing could not change the answer.
    policy = AdaptiveK(8, costs(draft=1.3, verify={0: 1.0, 4: 1.9, 8: 2.6}))
    policy.accepted, policy.rejected = 10.0, 0.0
    assert [policy.choose(limit=100) for _ in range(64)] == [0] * 64


def test_cpu_verify_costs_favour_a_middle_k():
    # CPU-like verify costs: a pass of 5 tokens costs 1.45 steps, of 9 tokens 1.85.
    policy = AdaptiveK(8, costs(draft=0.0, verify={0: 1.0, 4: 1.45, 8: 1.85}))
    policy.accepted, policy.rejected = 6.0, 4.0  # α = 0.6
    k = policy.choose(limit=100)
    assert 1 <= k <= 4
    best = max(range(9), key=lambda k: expected_tokens(0.6, k) / policy.costs.round_cost(k))
    assert k == best


def test_the_room_left_caps_k():
    policy = AdaptiveK(8, costs(draft=0.0, verify={0: 1.0, 4: 1.0}))
    policy.accepted, policy.rejected = 9.0, 1.0
    assert policy.choose(limit=3) == 3
    assert policy.choose(limit=0) == 0


def test_without_measurements_it_drafts_to_learn():
    assert AdaptiveK(6, CostModel()).choose(limit=100) == 6


def test_acceptance_estimate_follows_the_rounds():
    policy = AdaptiveK(4, CostModel())
    for _ in range(20):
        policy.observe(num_drafts=4, num_accepted=4)
    assert policy.alpha > 0.95
    for _ in range(20):
        policy.observe(num_drafts=4, num_accepted=0)
    assert policy.alpha < 0.1


def test_verify_cost_extrapolates_linearly_and_never_decreases():
    model = costs(draft=0.0, verify={0: 1.0, 4: 1.4})
    assert model.verify_cost(8) == pytest.approx(1.8)
    falling = costs(draft=0.0, verify={0: 1.0, 4: 0.9})
    assert falling.verify_cost(8) >= falling.verify_cost(4)


# --- pipelined rounds ---


def test_pipelined_round_cost_overlaps_the_draft_with_the_verify():
    model = costs(draft=0.1, verify={0: 1.0, 4: 1.4}, overhead=0.01)
    # Synchronous: 4 drafts, then the verify: 0.4 + 1.4 + 0.01.
    assert model.round_cost(4) == pytest.approx(1.81)
    # Every speculation holds: the verify hides the 5 draft steps (4 and the bonus guess).
    assert model.round_cost(4, hit_rate=1.0) == pytest.approx(1.41)
    # Half miss: a miss drafts its 4 tokens afresh first.
    assert model.round_cost(4, hit_rate=0.5) == pytest.approx(1.41 + 0.5 * 0.4)
    # A draft slower than the verify is the round's pace.
    slow = costs(draft=0.5, verify={0: 1.0, 4: 1.4}, overhead=0.01)
    assert slow.round_cost(4, hit_rate=1.0) == pytest.approx(2.5)


def test_pipelined_adaptive_k_follows_the_pipelined_costs():
    # α = 0.9, drafts 0.1 of a step, a verify 1 + 0.1·K steps. Synchronous
    # rounds pay every draft; pipelined ones hide them behind the verify but
    # a miss (1 − α^(K+1)) pays K of them afresh, which longer rounds risk more.
    model = costs(draft=0.1, verify={k: 1.0 + 0.1 * k for k in range(9)})
    synchronous, pipelined = AdaptiveK(8, model), AdaptiveK(8, model, pipeline=True)
    for policy in (synchronous, pipelined):
        policy.accepted, policy.rejected = 9.0, 1.0

    def best(hit_rate) -> int:
        return max(
            range(9),
            key=lambda k: expected_tokens(0.9, k) / model.round_cost(k, hit_rate=hit_rate(k)),
        )

    assert synchronous.choose(limit=100) == best(lambda k: None) == 7
    assert pipelined.choose(limit=100) == best(lambda k: 0.9 ** (k + 1)) == 6


def test_the_target_only_cost_is_measured_again_when_stale():
    # Every session drafts: nobody measures a target-only round, so now and
    # then one session runs one, and only one.
    model = costs(draft=0.0, verify={0: 1.0, 4: 1.0})
    model.refresh_rounds = 10
    sessions = [AdaptiveK(8, model) for _ in range(3)]
    for policy in sessions:
        policy.accepted, policy.rejected = 9.0, 1.0
    choices = []
    for _ in range(12):
        for policy in sessions:
            k = policy.choose(limit=100)
            choices.append(k)
            model.observe(num_drafts=k, draft_s=0.0, verify_s=1.0, overhead_s=0.0, drafted=k > 0)
            policy.observe(k, k)
    assert choices.count(0) == 3  # one probe in each 10 rounds after the first 10
    assert model.rounds - model.target_seen <= 10


def test_a_probe_chosen_for_a_speculation_runs_in_the_next_round():
    # Pipelined, the next round's K is chosen while this one is verified; a
    # probe chosen then holds until a target-only round has run.
    model = costs(draft=0.0, verify={0: 1.0, 4: 1.0})
    model.refresh_rounds = 0
    model.rounds += 1
    policy = AdaptiveK(8, model, pipeline=True)
    policy.accepted, policy.rejected = 9.0, 1.0
    assert policy.choose(limit=100) == 0  # chosen for the speculation: none is made
    assert policy.choose(limit=100) == 0  # the round itself
    policy.observe(0, 0)
    assert policy.choose(limit=100) == 8


def test_a_new_session_starts_from_the_acceptance_the_deployment_has_seen():
    # A drafter whose drafts are all accepted: a new session drafts the most
    # it pays from its first round, instead of starting at α = 0.5 (which
    # holds it at small K, or at K = 0 between probes, while its own rounds
    # teach it).
    model = costs(draft=0.3, verify={0: 1.0, 4: 1.4}, overhead=0.01)
    fresh = AdaptiveK(4, model)
    assert fresh.alpha == 0.5 and fresh.choose(limit=100) < 4
    model.observe(
        num_drafts=4, draft_s=1.2, verify_s=1.4, overhead_s=0.01, drafted=True, num_accepted=4
    )
    assert model.alpha == 1.0
    informed = AdaptiveK(4, model)
    assert informed.alpha == 1.0 and informed.choose(limit=100) == 4
    # One rejected draft in four (the default smoothing keeps every round's share).
    shared = CostModel()
    for accepted in (4, 3, 4, 3):
        shared.observe(
            num_drafts=4,
            draft_s=0.0,
            verify_s=1.0,
            overhead_s=0.0,
            drafted=True,
            num_accepted=accepted,
        )
    assert 0.8 < shared.alpha < 1.0
