"""Adaptive K on hand-made costs, where the best K is known."""

import dataclasses
import math

import numpy as np
import pytest

from outrider.coordinator.adaptive.cost_model import PLAN_ERROR, CostModel, CostModels
from outrider.coordinator.adaptive.planner import TIE
from outrider.coordinator.adaptive.session import LEARNING_K, AdaptiveK, adaptive_k_max
from outrider.engine_load import EngineLoad


def expected_tokens(alpha: float, k: float) -> float:
    """E(K), the tokens a round commits (the papers' geometric sum): the
    reference the policy's choices are checked against."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def curve(cost, top: int = 1024, *, decode: bool = False) -> tuple[tuple[float, float, float], ...]:
    """An engine's measured curve: ``cost(tokens)`` at the powers of two,
    whatever the rows (in one row), or of decode steps (a token a row)."""
    counts = [float(1 << i) for i in range(top.bit_length())]
    return tuple((t if decode else 1.0, t, cost(t)) for t in counts)


def model(
    verify,
    *,
    draft=None,
    draft_per_token: float | None = None,
    overhead: float = 0.0,
    rows: float = 1.0,
    tokens: float | None = None,
) -> CostModel:
    """Costs as the engines would report them: a target step of T tokens
    costs ``verify(T)``; a draft step of n rows ``draft(n)`` (or a flat
    ``draft_per_token`` for a drafter without a curve)."""
    costs = CostModel(
        decay=0.0, planning_share=math.inf
    )  # no smoothing: the last sample is the value
    costs.target = EngineLoad(curve(verify), tokens if tokens is not None else rows, rows, 1)
    if draft is not None:
        costs.draft = EngineLoad(curve(draft, decode=True), 0.0, 0.0, 1)
    if draft_per_token is not None:
        costs.draft_per_token.update(draft_per_token)
    costs.overhead[False].update(overhead)
    costs.overhead[True].update(overhead)
    return costs


def session(costs: CostModel, alpha: float, k_max: int = 8, **kwargs) -> AdaptiveK:
    """A session that has run a round at K = 0 (one of the target's rows)."""
    policy = AdaptiveK(k_max, costs, **kwargs)
    policy.accepted, policy.rejected = 1e6 * alpha, 1e6 * (1 - alpha)  # known
    policy.k_last = 0
    return policy


def cpu(tokens: float) -> float:
    """A verify of 5 tokens costs 1.45 single steps, of 9 tokens 1.85."""
    return 0.9 + 0.1 * tokens


def test_free_drafts_and_a_flat_verify_draft_the_maximum():
    policy = session(model(lambda t: 1.0, draft_per_token=0.0), alpha=0.9)
    assert policy.choose(limit=100) == 8


def test_alone_the_choice_is_the_sessions_own_best_rate():
    costs = model(cpu, draft=lambda n: 0.2 + 0.01 * n, overhead=0.01)
    policy = session(costs, alpha=0.8)

    def rate(k: int) -> float:
        return expected_tokens(0.8, k) / (0.01 + k * 0.21 + cpu(k + 1))

    assert policy.choose(limit=100) == max(range(9), key=rate) == 3


def test_every_round_pays_the_target_engines_work_on_every_row_of_its_step():
    # A GPU-like target whose step costs what a draft step does, whatever
    # its tokens: at the steps' prices alone a round of no drafts wins, but
    # the engine's work between steps on each of the step's rows is paid
    # by every round whatever its K, and with it counted the drafts'
    # tokens are worth their steps — the more so the more rows share it.
    step, work, alpha = 3e-3, 1.5e-3, 0.96
    for rows in (1, 16):
        costs = model(lambda t: step, draft=lambda n: step, rows=rows)
        policies = [session(costs, alpha=alpha) for _ in range(rows)]

        def rates(work_per_row: float, rows: int = rows) -> np.ndarray:
            ks = np.arange(9)
            cost = ks * step + step + work_per_row * rows
            return rows * np.array([expected_tokens(alpha, k) for k in ks]) / cost

        assert policies[0].choose(limit=100) == np.argmax(rates(0.0)) == 0
        costs.target = dataclasses.replace(costs.target, work_per_row_s=work)
        costs._plan = None  # (planned again at the next target step)
        k = policies[0].choose(limit=100)
        assert k > 0 and rates(work)[k] >= rates(work).max() * (1 - TIE) > rates(work)[0] * 1.2
        assert costs.verify_cost(0) == pytest.approx(step + work * rows)


def test_a_draft_step_pays_the_draft_engines_work_on_its_rows():
    costs = model(lambda t: 0.01, draft=lambda n: 0.002)
    bare = costs.draft_step_costs(np.array([0.0, 1.0, 8.0]))
    costs.draft = dataclasses.replace(costs.draft, work_per_row_s=0.001)
    assert costs.draft_step_costs(np.array([0.0, 1.0, 8.0])) == pytest.approx(
        bare + [0.0, 0.001, 0.008]
    )


def test_a_draft_step_of_many_rows_costs_no_more_than_a_step_of_as_many_tokens():
    # Surfaces logged at 4 streams on 2 CPU cores: the draft's steps of a
    # token a row were measured at one row only, and their lone point priced
    # a step of 4 rows at 4 × 19.8 ms; a step of 4 rows of 2 tokens each
    # took 48.2 ms. Priced so, drafting looked hopeless at K = 0's 55 tok/s.
    ms = 1e-3
    costs = model(cpu)
    draft = ((1.0, 1.0, 19.8), (1.0, 2.0, 27.5), (1.0, 56.0, 172.9), (2.0, 4.0, 41.3))
    draft += ((2.0, 57.0, 449.0), (3.0, 60.0, 154.3), (4.0, 8.0, 48.2))
    costs.draft = EngineLoad(tuple((r, t, c * ms) for r, t, c in draft), 4.0, 4.0, 1)
    steps = costs.draft_step_costs(np.array([1.0, 2.0, 4.0]))
    assert steps == pytest.approx([19.8 * ms, 39.6 * ms, 48.2 * ms])
    # Where they were measured at as many rows, they price the step.
    costs.draft = EngineLoad(costs.draft.curve + ((4.0, 4.0, 37.0 * ms),), 4.0, 4.0, 1)
    assert costs.draft_step_costs(np.array([4.0]))[0] == pytest.approx(37.0 * ms)


def test_hopeless_drafts_fall_back_to_target_only_and_probe():
    policy = session(model(cpu, draft_per_token=0.05), alpha=0.0)
    choices = [policy.choose(limit=100) for _ in range(64)]
    # A probe every 8 rounds.
    assert [i for i, k in enumerate(choices) if k] == [7, 15, 23, 31, 39, 47, 55, 63]
    assert set(choices) == {0, 1}


def test_a_session_whose_draft_never_opened_does_not_probe():
    # Its probe would first pay the draft's prefill: on shared CPU cores, at
    # 8 sampled streams of 48 tokens, probes of sessions at K = 0 halved
    # every session's throughput (38.8 tok/s against target-only's 77.7).
    policy = session(model(cpu, draft_per_token=0.05), alpha=0.0)
    assert [policy.choose(limit=100, may_probe=False) for _ in range(64)] == [0] * 64
    assert policy.choose(limit=100) == 0  # its count of rounds at K = 0 starts afresh


def test_a_draft_opens_where_the_tokens_to_come_repay_its_prefill():
    # Alone: K = 0 commits a token in 1 s; K = 8 at α = 0.9 about 6.1 in
    # 2.6 s: each token to come saves about 0.58 s, against a prefill of 3 s.
    costs = model(cpu, overhead=0.0)
    assert costs.draft_prefill_pays(100, tokens_left=1)  # the draft's steps unknown: learn
    costs.draft = EngineLoad(((1.0, 1.0, 0.1), (1.0, 100.0, 3.0)))
    alone = session(costs, alpha=0.9)
    plan = costs.plan()
    saved_per_token = 1 / plan.target_only - 1 / plan.goodput
    assert 0.5 < saved_per_token < 0.6
    assert costs.draft_prefill_pays(100, tokens_left=6)  # 3.5 s saved
    assert not costs.draft_prefill_pays(100, tokens_left=5)  # 2.9 s
    # Opened beside the target's prefill of 2.5 s, the draft's holds the
    # first drafting round only by what it takes beyond that.
    costs.observe_prefill(100, 2.5)
    assert costs.draft_prefill_pays(100, tokens_left=1, beside=True)  # 0.58 s saved, 0.5 waited
    assert not costs.draft_prefill_pays(100, tokens_left=1)
    # A draft whose opens took 6 s for 100 tokens (a 4-bit CPU kernel's
    # prefill, dearer than its steps of a token say) needs twice the tokens.
    costs.observe_draft_prefill(100, 6.0)
    assert costs.draft_prefill_cost(100) == pytest.approx(6.0)
    assert not costs.draft_prefill_pays(100, tokens_left=6)
    assert costs.draft_prefill_pays(100, tokens_left=11)  # 6.4 s saved
    alone.close()


def test_beside_other_sessions_a_draft_pays_at_the_end_of_the_plans_error():
    # Three other rows in the target's steps: each goodput is taken 7.5%
    # (the others' share of 10%) toward the other's.
    costs = model(cpu, overhead=0.0, rows=4.0)
    costs.draft = EngineLoad(((1.0, 1.0, 0.01), (1.0, 100.0, 3.0)))
    policy = session(costs, alpha=0.95)
    plan = costs.plan()
    error = PLAN_ERROR * 3 / 4
    plain = 1 / plan.target_only - 1 / plan.goodput
    worst = 1 / (plan.target_only * (1 + error)) - 1 / (plan.goodput * (1 - error))
    assert 0 < worst < plain
    needed = math.ceil(3.0 / worst)
    assert needed > math.ceil(3.0 / plain)  # without the margin, fewer tokens would do
    assert costs.draft_prefill_pays(100, tokens_left=needed)
    assert not costs.draft_prefill_pays(100, tokens_left=needed - 1)
    policy.close()


def test_a_draft_slower_than_the_target_is_never_consulted_again():
    # The target itself in bfloat16 as its draft, on a CPU: every draft is
    # accepted, but a draft step costs more than a target step, so even α = 1
    # loses and probing could not change the answer.
    policy = session(model(cpu, draft_per_token=1.3), alpha=0.99)
    assert [policy.choose(limit=100) for _ in range(64)] == [0] * 64


def test_adaptive_k_stays_within_the_targets_cuda_graphs():
    assert adaptive_k_max(16, graphed_tokens_per_row=9) == 8
    assert adaptive_k_max(4, graphed_tokens_per_row=9) == 4
    assert adaptive_k_max(16, graphed_tokens_per_row=0) == 16  # no graphs: any K runs alike


def test_the_room_left_caps_k():
    policy = session(model(lambda t: 1.0, draft_per_token=0.0), alpha=0.9)
    assert policy.choose(limit=3) == 3
    assert policy.choose(limit=0) == 0


def test_without_measurements_it_drafts_to_learn():
    assert AdaptiveK(6, CostModel(planning_share=math.inf)).choose(limit=100) == LEARNING_K
    target_only = model(cpu)  # the target's steps are known, no draft step yet
    assert session(target_only, alpha=0.5).choose(limit=100) == LEARNING_K


def test_acceptance_estimate_follows_the_rounds_drawn_toward_the_deployments():
    costs = CostModel(planning_share=math.inf)
    policy = AdaptiveK(4, costs)

    def rounds(count: int, accepted: int) -> None:
        for _ in range(count):
            policy.observe(num_drafts=4, num_accepted=accepted)
            costs.observe(
                num_drafts=4, num_accepted=accepted, draft_s=0.1, overhead_s=0.0, drafted=True
            )

    assert policy.alpha == 0.5  # nothing seen yet
    rounds(20, accepted=4)
    assert policy.alpha == 1.0
    rounds(20, accepted=0)
    assert policy.alpha < 0.5  # the deployment forgets its better days slowly
    # A session whose drafts the target takes where others' it rejects:
    # its own rounds weigh more, the deployment's a little.
    lucky = AdaptiveK(4, costs)
    for _ in range(20):
        lucky.observe(num_drafts=4, num_accepted=4)
    assert costs.acceptance.alpha < lucky.alpha < 1.0 and lucky.alpha > 0.8


def test_a_new_session_starts_from_the_acceptance_the_deployment_has_seen():
    # A drafter whose drafts are all accepted: a new session drafts the most
    # it pays from its first round, instead of starting at α = 0.5.
    costs = model(cpu, draft_per_token=0.3, overhead=0.01)
    fresh = AdaptiveK(4, costs)
    fresh.k_last = 0
    assert fresh.alpha == 0.5 and fresh.choose(limit=100) < 4
    fresh.close()
    costs.observe(num_drafts=4, draft_s=1.2, overhead_s=0.01, drafted=True, num_accepted=4)
    assert costs.acceptance.alpha == 1.0
    informed = AdaptiveK(4, costs)
    informed.k_last = 0
    assert informed.choose(limit=100) == 4


# --- under load ---


def cpu_draft(rows: float) -> float:
    """A 4-bit copy of the target: about half a target step."""
    return 0.5 + 0.05 * rows


def test_a_cpu_step_shared_by_eight_sessions_makes_drafting_stop_paying():
    # Drafting at α = 0.8 pays alone on a CPU (linear step cost); with seven
    # other sessions in every step, a draft token costs everyone's round.
    alone = session(model(cpu, draft=cpu_draft), alpha=0.8)
    assert alone.choose(limit=100) > 0
    alone.close()
    crowd = model(cpu, draft=cpu_draft, rows=8.0)
    sessions = [session(crowd, alpha=0.8) for _ in range(8)]
    assert [policy.choose(limit=100) for policy in sessions] == [0] * 8


def test_a_flat_gpu_step_keeps_drafting_cheap_under_load():
    def gpu(tokens: float) -> float:
        return max(1.0, tokens / 256)

    crowd = model(gpu, draft=lambda n: 0.05, rows=8.0)
    sessions = [session(crowd, alpha=0.8) for _ in range(8)]
    ks = [policy.choose(limit=100) for policy in sessions]
    assert min(ks) >= 4


def test_the_other_sessions_of_the_step_count_even_when_another_coordinator_runs_them():
    # The target's steps hold 8 rows; this coordinator runs one of them.
    shared = model(cpu, draft=cpu_draft, rows=8.0)
    policy = session(shared, alpha=0.7)
    assert policy.choose(limit=100) == 0


def test_sessions_that_leave_are_planned_no_more():
    costs = model(cpu, draft_per_token=0.0)
    first, second = session(costs, alpha=0.9), session(costs, alpha=0.9)
    assert len(costs.plan().ks) == 2
    second.close()
    assert list(costs.plan().ks) == [first.key]


# --- pipelined rounds ---


def test_pipelined_costs_hide_the_drafts_behind_the_verify():
    # α = 0.9, a draft step 0.1 of a target step, a verify 1 + 0.1·K steps.
    # Synchronous rounds pay every draft; pipelined ones hide them behind the
    # verify, but a miss (1 − α^(K+1)) pays K of them afresh.
    costs = model(lambda t: 0.9 + 0.1 * t, draft_per_token=0.1)
    synchronous = session(costs, alpha=0.9)
    k_sync = synchronous.choose(limit=100)
    synchronous.close()
    pipelined = session(costs, alpha=0.9, pipeline=True)

    def sync_rate(k):
        return expected_tokens(0.9, k) / (k * 0.1 + 0.9 + 0.1 * (k + 1))

    def pipelined_rate(k):
        hit = 0.9 ** (k + 1)
        cost = max(0.9 + 0.1 * (k + 1), (k + 1) * 0.1 if k else 0.0) + (1 - hit) * k * 0.1
        return expected_tokens(0.9, k) / cost

    # The best rate, or one within TIE of it with a shorter round.
    assert sync_rate(k_sync) >= max(map(sync_rate, range(9))) * (1 - TIE)
    assert k_sync <= max(range(9), key=sync_rate)
    k_pipelined = pipelined.choose(limit=100)
    assert pipelined_rate(k_pipelined) >= max(map(pipelined_rate, range(9))) * (1 - TIE)
    assert pipelined_rate(k_pipelined) >= pipelined_rate(k_sync) * (1 - TIE)


def test_time_a_round_waited_behind_other_sessions_does_not_make_drafting_look_cheap():
    """Under load a round's overhead also holds the time its calls waited for
    other sessions' steps. Priced as a fixed cost of the round it would make
    long rounds look cheap (more drafts spread it); the model keeps the
    overhead's floor, so K stays what it is without the waits."""
    calm, loaded = model(cpu, draft=lambda n: 0.05), model(cpu, draft=lambda n: 0.05)
    for waited in [0.0, 2.0, 0.0, 3.0, 1.5, 0.0, 2.5] * 5:
        for drafted in (False, True):
            loaded.overhead[drafted].update(0.01 + waited)
            calm.overhead[drafted].update(0.01)
    assert loaded.rpc_cost(True) < 0.2  # the waits average 1.3
    ks = [session(costs, 0.8).choose(16) for costs in (calm, loaded)]
    assert ks[0] == ks[1]
    slow = model(cpu, draft=lambda n: 0.05, overhead=2.0)  # a real fixed cost is one
    assert session(slow, 0.8).choose(16) > ks[0]


def test_a_surface_measured_unevenly_never_makes_drafting_free():
    # Surfaces logged by a CPU run at 8 sessions. The draft's one step of
    # 3 rows was a 222-token prefill: priced as a decode step of 3-4 rows,
    # it made a fifth drafting row 0.4 s cheaper than a fourth, and the
    # plan's best round cost nothing.
    ms = 1e-3
    costs = model(cpu, overhead=2.4 * ms)
    costs.overhead[True].update(79.5 * ms)
    target = ((1, 1, 50.0), (1, 5, 59.8), (1, 67, 154.0), (4, 63, 182.6), (4, 65, 283.7))
    target += ((5, 15, 141.4), (6, 256, 427.8), (7, 7, 71.5))
    draft = ((1, 1, 19.8), (1, 56, 137.8), (2, 2, 26.4), (3, 222.5, 443.1), (6, 6, 37.1))
    costs.target = EngineLoad(tuple((r, t, c * ms) for r, t, c in target), 87.7, 11.5, 1)
    costs.draft = EngineLoad(tuple((r, t, c * ms) for r, t, c in draft), 3.5, 3.5, 1)
    sessions = [session(costs, alpha=0.986, k_max=16) for _ in range(8)]
    plan = costs.plan()
    ks = [plan.ks[s.key] for s in sessions]
    committed = 3.5 + sum(expected_tokens(0.986, k) for k in ks)
    verify = costs.target.step_cost(79.7 + sum(k + 1 for k in ks), rows=11.5)
    assert plan.goodput <= committed / (2.4 * ms + verify)


def test_target_only_is_priced_by_the_decode_steps_and_others_at_k0_commit_a_token_a_row():
    # One adaptive session among four rows of K = 0; the deployment's rounds
    # accepted every draft. The range of 3-4 rows mixes decode steps and
    # verifies, whose slope would price a decode step of 4 rows 4 ms dearer.
    ms = 1e-3
    costs = model(cpu, overhead=2 * ms)
    costs.observe(num_drafts=8, draft_s=0.2, overhead_s=2 * ms, drafted=True, num_accepted=8)
    target = ((1.0, 1.0, 51.6), (3.0, 3.0, 52.1), (3.0, 8.0, 72.5), (4.0, 20.0, 101.5))
    costs.target = EngineLoad(tuple((r, t, s * ms) for r, t, s in target), 4.0, 4.0, 1)
    alone = session(costs, alpha=0.9)
    decode = costs.target.decode_cost(4.0)
    assert decode is not None and decode < costs.target.step_cost(4.0, rows=4.0) - 3 * ms
    assert costs.plan().target_only == pytest.approx(4 / (2 * ms + decode))
    alone.close()


def test_tokens_of_the_others_past_a_row_each_are_priced_but_not_credited():
    # The target's median step still holds four rows of 10 tokens — these
    # sessions' rounds at K = 9 a moment ago — where three sessions remain
    # at K = 0: the fourth row's tokens commit nothing now.
    ms = 1e-3
    costs = model(cpu, overhead=2 * ms, rows=4.0, tokens=40.0)
    costs.observe(num_drafts=8, draft_s=0.2, overhead_s=2 * ms, drafted=True, num_accepted=8)
    sessions = [session(costs, alpha=0.98) for _ in range(3)]
    step = costs.target.step_cost(40.0, rows=4.0)  # (their 37 tokens and these 3)
    assert costs.plan().target_only == pytest.approx((1 + 3) / (2 * ms + step))
    for policy in sessions:
        policy.close()


def test_planning_takes_at_most_its_share_of_the_time(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(
        "outrider.coordinator.adaptive.cost_model.time.perf_counter", lambda: clock[0]
    )
    costs = model(cpu, draft_per_token=0.1)
    costs.planning_share = 0.1
    alone = session(costs, alpha=0.9)
    first = costs.plan()  # took "no time": the next may come at once
    costs.target = dataclasses.replace(costs.target, steps=2)
    assert costs.plan() is not first

    costs._planning_s = 0.002  # a plan of 2 ms: the next after 20 ms
    costs.target = dataclasses.replace(costs.target, steps=3)
    clock[0] += 0.010
    stale = costs.plan()
    assert stale is costs.plan() and costs._planned_at[0] == 2
    clock[0] += 0.010
    assert costs.plan() is not stale and costs._planned_at[0] == 3
    alone.close()


def test_a_session_yet_to_open_is_planned_with_the_busiest_replica():
    """Before its target session opens, a session is planned where most
    sessions run (the last used replica among as many): before any opened,
    with every other such session."""
    costs = CostModels(planning_share=math.inf)
    waiting = [AdaptiveK(4, costs.likeliest()) for _ in range(2)]
    assert waiting[0].costs is waiting[1].costs is costs.likeliest()
    for session in waiting:
        session.move(costs.of("a"))
    assert not costs.of("").sessions and len(costs.of("a").sessions) == 2
    busy = costs.of("a")
    assert costs.of("b") is not busy and costs.likeliest() is busy
    waiting[0].move(costs.of("b"))
    assert costs.likeliest() is costs.of("b")  # as many: the last used
    waiting[1].close()
    assert costs.likeliest() is costs.of("b") and not busy.sessions
    assert busy.acceptance is costs.of("b").acceptance


def test_models_of_replicas_gone_idle_are_forgotten_least_recently_used_first():
    """Pods come and go with new addresses: past ``max_idle`` models with no
    session planned, the least recently used is forgotten; a model a session
    is planned with never is, however long unused."""
    costs = CostModels(planning_share=math.inf, max_idle=2)
    planned = AdaptiveK(4, costs.of("pinned"))
    first = costs.of("pod-0")
    for pod in range(1, 6):
        costs.of(f"pod-{pod}")
    assert planned.costs is costs.of("pinned")
    assert costs.of("pod-0") is not first  # forgotten: measured again
    assert list(costs._by_replica) == ["pod-5", "pinned", "pod-0"]
    planned.close()
