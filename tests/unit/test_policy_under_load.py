"""Adaptive K against a simulated engine, at every load: the goodput of the
K the policy chooses is within 5% of the best fixed K found by exhaustive
search, and never below target-only decoding's.

The simulated deployment runs synchronous rounds: every session's round is
verified in one target step of T = Σ (K_i + 1) tokens costing c(T); before
it, the draft runs one step per draft depth, each of the sessions drafting
that deep, n rows costing d(n). Two shapes of c: GPU-like (flat up to 256
tokens, linear after) and CPU-like (linear from the first token); and a
GPU whose engines work between steps on each row of a step (answering and
starting its calls) for a share of a millisecond, as a small target's on
an H100 do, where that work is most of a round at tens of sessions. The
engines report their curves, work and load as the real ones do; the
sessions choose one after another, each seeing the others' latest K.
"""

from __future__ import annotations

import math

import pytest

from outrider.coordinator.adaptive.cost_model import CostModel
from outrider.coordinator.adaptive.session import AdaptiveK
from outrider.engine_load import EngineLoad
from tests.unit.test_policy import expected_tokens

OVERHEAD_S = 0.001
SESSIONS = (1, 8, 32, 64)


def gpu_step(tokens: float) -> float:
    return 0.010 * max(1.0, tokens / 256)


def gpu_draft(rows: float) -> float:
    return 0.002 * max(1.0, rows / 64)


def cpu_step(tokens: float) -> float:
    return 0.060 * (0.9 + 0.1 * tokens)


def cpu_draft(rows: float) -> float:
    """A 4-bit copy of the target: about half a target step."""
    return 0.030 * (0.9 + 0.1 * rows)


def cheap_cpu_draft(rows: float) -> float:
    return 0.004 * (0.9 + 0.1 * rows)


TARGET_WORK_PER_ROW_S = 5e-4
DRAFT_WORK_PER_ROW_S = 5e-5

SHAPES = {
    "gpu": (gpu_step, gpu_draft, 0.0, 0.0),
    "gpu-busy-engines": (gpu_step, gpu_draft, TARGET_WORK_PER_ROW_S, DRAFT_WORK_PER_ROW_S),
    "cpu": (cpu_step, cpu_draft, 0.0, 0.0),
    "cpu-cheap-draft": (cpu_step, cheap_cpu_draft, 0.0, 0.0),
}
ALPHAS = {
    "alpha=0.6": lambda n: [0.6] * n,
    "alpha=0.95": lambda n: [0.95] * n,
    "mixed": lambda n: [0.3 + 0.65 * i / max(1, n - 1) for i in range(n)],
}


def measured(cost, top: int = 8192, *, decode: bool = False) -> tuple[tuple[float, ...], ...]:
    """The engine's report: ``cost`` at the powers of two, in one row (the
    target: its cost is by tokens alone), or a token a row (the draft)."""
    counts = [float(1 << i) for i in range(top.bit_length())]
    return tuple((t if decode else 1.0, t, cost(t)) for t in counts)


def round_seconds(ks: list[int], step, draft, work=0.0, draft_work=0.0) -> float:
    depth = max(ks, default=0)
    drafting = 0.0
    for j in range(1, depth + 1):
        rows = sum(1 for k in ks if k >= j)
        drafting += draft(rows) + draft_work * rows
    rpcs = 2 if depth else 1
    return rpcs * OVERHEAD_S + drafting + step(sum(k + 1 for k in ks)) + work * len(ks)


def goodput(alphas: list[float], ks: list[int], step, draft, work=0.0, draft_work=0.0) -> float:
    committed = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
    return committed / round_seconds(ks, step, draft, work, draft_work)


def run_policy(
    alphas: list[float],
    step,
    draft,
    work=0.0,
    draft_work=0.0,
    *,
    k_max: int = 8,
    rounds: int = 6,
) -> list[int]:
    """Every session chooses its K in turn, ``rounds`` times over, the
    engines reporting the load of the sessions' latest choices."""
    costs = CostModel(decay=0.0, planning_share=math.inf)
    costs.overhead[False].update(OVERHEAD_S)
    costs.overhead[True].update(2 * OVERHEAD_S)
    sessions = []
    for alpha in alphas:
        policy = AdaptiveK(k_max, costs)
        policy.accepted, policy.rejected = 1e6 * alpha, 1e6 * (1 - alpha)  # known
        policy.k_last = 0
        sessions.append(policy)
    ks = [0] * len(alphas)
    steps = 0
    for _ in range(rounds):
        for i, policy in enumerate(sessions):
            steps += 1
            drafting = sum(1 for k in ks if k)
            costs.target = EngineLoad(
                measured(step), sum(k + 1 for k in ks), len(ks), steps, work_per_row_s=work
            )
            costs.draft = EngineLoad(
                measured(draft, decode=True), drafting, drafting, steps, work_per_row_s=draft_work
            )
            ks[i] = policy.choose(limit=100)
            policy.k_last = ks[i]
    return ks


@pytest.mark.parametrize("alphas", list(ALPHAS), ids=list(ALPHAS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("sessions", SESSIONS)
def test_the_chosen_k_is_within_5_percent_of_the_best_fixed_k_and_never_below_target_only(
    shape, sessions, alphas
):
    engines = SHAPES[shape]
    alpha = ALPHAS[alphas](sessions)
    ks = run_policy(alpha, *engines)
    chosen = goodput(alpha, ks, *engines)
    fixed = {k: goodput(alpha, [k] * sessions, *engines) for k in range(9)}
    best_k = max(fixed, key=fixed.__getitem__)
    print(
        f"{shape:16} {sessions:3} sessions {alphas:10}  chosen K {min(ks)}..{max(ks)}: "
        f"{chosen:9.1f} tok/s  best fixed K={best_k}: {fixed[best_k]:9.1f}  "
        f"({chosen / fixed[best_k]:.3f}×, {chosen / fixed[0]:.2f}× K=0)"
    )
    assert chosen >= 0.95 * fixed[best_k]
    assert chosen >= fixed[0] * (1 - 1e-9)
