"""The plan of K: how many tokens each adaptive session on one target
replica drafts next round, chosen together for the deployment's goodput —
committed tokens per second across all sessions — with each request's
latency as the tie-break (docs/design.md#speculation-under-load).

With per-token acceptance α and K drafts, a round commits

    E(K) = (1 − α^(K+1)) / (1 − α)          (E = K + 1 when α = 1)

tokens (Leviathan et al. 2023); its j-th draft adds α^j of them — in
general S(j), the chance that it and every draft before it are accepted,
which for drafts copied from the history (prompt lookup) is measured depth
by depth (:mod:`outrider.coordinator.adaptive.acceptance`). Sessions share steps:
the target verifies every session's round in one forward pass of
T = Σ (K_i + 1) tokens in R rows (one a session), which costs c(T; R); the
draft drafts in steps of every session drafting, n_j rows of a token at the
j-th draft of a round, each costing d(n_j) (drafts looked up in the
coordinator take no row); w and w_d are the engines' work
between steps per row, and o the coordinator's overhead
(:mod:`outrider.coordinator.adaptive.step_costs`). So a round costs

    C = o + Σ_j (d(n_j) + w_d·n_j) + c(T; R) + w·R

and the goodput of an assignment of K_i to the sessions is

    G = Σ_i E_i(K_i) / C.

:func:`plan` maximises G. A session's drafts are worth the most in order
(S_i(1) ≥ S_i(2) ≥ …), so the drafts of every session are sorted by what
each adds, and the best assignment is the best prefix of that order: its
cost is a sum of increments along it (a token, a draft row, or a new draft
step), so every prefix is priced in one pass. A draft token is drafted
while its S_i(j) beats what it adds to everyone's round. Among assignments
of the same goodput (within :data:`TIE`), the shortest round wins: every
session gets its tokens soonest. A session alone is priced exactly as
E(K) / (o + K·(d(1) + w_d) + c(K + 1; 1) + w), its own best rate.

Pipelined (docs/design.md#pipelined-rounds), the draft drafts the next
round — K + 1 steps, its guess of the bonus token first — while the target
verifies this one, so a round whose speculation holds (probability
α^(K+1)) costs o₁ + max(c(T), D(K + 1)), and a miss first drafts afresh:

    C_p = o₁ + max(c(T), D_spec) + miss · (D + o₂ − o₁)

with miss the sessions' mean chance of a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from outrider.coordinator.adaptive.step_costs import StepCosts
from outrider.logging import get_logger

log = get_logger(__name__)

TIE = 0.01
"""Goodputs this close count as equal; then latency decides."""


@dataclass(frozen=True)
class Bid:
    """What the plan knows of one session: what each draft it may make adds
    to its round's tokens, and its share of the load now."""

    key: int
    """The session's key in its replica's plan."""
    gains: tuple[float, ...]
    """S(j) for j = 1 .. the most drafts its next round can have."""
    alpha: float
    """Its per-token acceptance (a pipelined miss's chance: 1 − α^(K+1))."""
    k_last: int
    """The K of its last verified round: its share of the target's steps."""
    pipelined: bool = False
    looked_up: bool = False
    """Its drafts are looked up in the coordinator (:mod:`outrider.drafters.lookup`):
    they cost the draft no step."""


@dataclass(frozen=True)
class Plan:
    """K for each adaptive session, and what the assignment is worth."""

    ks: Mapping[int, int]
    """Each bid's key → its K."""
    goodput: float
    """Tokens per second of the whole step (its own sessions and the others)."""
    price: float
    """What one more draft token would have to add (its S(j)) to pay for itself."""
    target_only: float
    """The goodput with every one of these sessions at K = 0."""


NO_PLAN = Plan({}, 0.0, 1.0, 0.0)


def plan(bids: Sequence[Bid], costs: StepCosts) -> Plan:
    """The K of every bidding session that maximises the goodput (see the
    module docstring), the others in the engines' steps held as the engines
    last reported them."""
    if not bids:
        return NO_PLAN
    others = _Others.of(bids, costs)
    drafts = _Drafts.of(bids, others, costs)
    # A deep draft costs a draft step every session waits for, so the best
    # prefix is sought under every cap on the depth (K = cap for all is one):
    # the prefixes of the drafts each cap keeps, one row of the tables a cap.
    kept = drafts.depth[None, :] <= np.arange(int(drafts.depth.max(initial=0)) + 1)[:, None]
    goodput, cost = _prefixes(bids, others, drafts, kept, costs)
    goodput_best, chosen = _best_prefix(goodput, cost, kept, drafts.owner)
    ks = np.bincount(chosen, minlength=len(bids))
    price = goodput_best * _first_draft_cost(ks, others, costs)
    if log.is_enabled_for(logging.DEBUG):  # (its arguments are built only to be written)
        _log_plan(bids, ks, goodput_best, float(goodput[0, 0]), others, costs)
    ks_of = {bid.key: int(k) for bid, k in zip(bids, ks, strict=True)}
    # Every cap's first prefix is the same: no drafts.
    return Plan(ks_of, goodput_best, price, target_only=float(goodput[0, 0]))


@dataclass(frozen=True)
class _Others:
    """What every assignment has: the others in the engines' steps and these
    sessions' K = 0 rounds."""

    committed: float
    rows: float
    tokens: float
    sessions: int
    drafting: float
    """The others' rows in the draft's steps."""
    depth: float
    """The others' drafts per round."""

    @classmethod
    def of(cls, bids: Sequence[Bid], costs: StepCosts) -> _Others:
        # The target's load less these sessions' share, a row each (of one
        # token for a session yet to verify: what its prefill adds to the
        # load is no round's). A round of theirs commits a token. Their
        # tokens past a row's one are priced but not credited: they may be
        # another coordinator's drafts, or as well this one's past in the
        # engine's median step — its sessions' earlier K, a prefill — which
        # commits nothing now.
        n = len(bids)
        rows = max(0.0, costs.target.rows_per_step - n)
        tokens = max(0.0, costs.target.tokens_per_step - sum(b.k_last + 1 for b in bids))
        if rows < 0.5:
            rows = tokens = 0.0
        drafting_now = sum(1 for b in bids if b.k_last and not b.looked_up)
        draft_rows = costs.draft.rows_per_step if costs.draft else 0.0
        return cls(
            committed=rows + n,
            rows=rows + n,
            tokens=tokens + n,
            sessions=n,
            drafting=max(0.0, draft_rows - drafting_now),
            depth=tokens / rows - 1.0 if rows else 0.0,
        )


@dataclass(frozen=True)
class _Drafts:
    """Every draft token of every session, best first: its session, its
    depth, what it adds to the tokens committed, and what it adds to the
    draft — a row in the step at its depth, or a step of its own where
    there was none."""

    owner: np.ndarray
    depth: np.ndarray
    gain: np.ndarray
    draft_add: np.ndarray

    @classmethod
    def of(cls, bids: Sequence[Bid], others: _Others, costs: StepCosts) -> _Drafts:
        k_most = np.array([len(b.gains) for b in bids])
        owner = np.repeat(np.arange(len(bids)), k_most)
        depth = np.concatenate([np.arange(1, k + 1) for k in k_most]) if k_most.sum() else owner
        gain = np.concatenate([np.asarray(b.gains, dtype=float) for b in bids])
        order = np.lexsort((owner, depth, -gain))
        # (Less than TIE of a token each: the plan without them is as good.)
        order = order[gain[order] >= TIE]
        owner, depth, gain = owner[order], depth[order], gain[order]
        drafted = ~np.array([b.looked_up for b in bids], dtype=bool)[owner]
        ranks = _rank_within(np.where(drafted, depth, 0))  # (looked up: no row)
        rows_before = np.where(depth <= others.depth, others.drafting, 0.0) + ranks
        draft_add = costs.draft_step_costs(rows_before + 1) - costs.draft_step_costs(rows_before)
        # (A row never makes a step cheaper.)
        draft_add = np.where(drafted, np.maximum(draft_add, 0.0), 0.0)
        return cls(owner, depth, gain, draft_add)


def _prefixes(
    bids: Sequence[Bid], others: _Others, drafts: _Drafts, kept: np.ndarray, costs: StepCosts
) -> tuple[np.ndarray, np.ndarray]:
    """Goodput and round cost of every prefix of the drafts each cap keeps
    (a row of ``kept`` a cap): column 0 the empty prefix, column i + 1 the
    prefix that ends with draft i (where the cap keeps it; elsewhere no
    goodput and no end)."""
    count = np.cumsum(kept, axis=1)
    committed = others.committed + np.cumsum(drafts.gain * kept, axis=1)
    drafting = np.cumsum(drafts.draft_add * kept, axis=1)
    # A verify's cost depends only on how many drafts it holds.
    verify = costs.verify_costs(others.tokens, others.rows, len(drafts.gain))
    one_rpc, two_rpcs = costs.rpc_cost(False), costs.rpc_cost(True)
    if any(b.pipelined for b in bids):
        # A speculation drafts one step more (the guess) beside the verify;
        # a miss drafts afresh first.
        guess = drafts.draft_add[0] if len(drafts.draft_add) else 0.0
        alphas = np.array([b.alpha for b in bids])
        misses = _miss_increments(alphas, drafts.owner, drafts.depth)
        miss = np.cumsum(misses * kept, axis=1) / others.sessions
        cost = (
            one_rpc
            + np.maximum(verify[count], drafting + guess)
            + miss * (drafting + two_rpcs - one_rpc)
        )
    else:
        cost = two_rpcs + drafting + verify[count]
    empty = np.full((len(kept), 1), one_rpc + verify[0])
    cost = np.concatenate([empty, np.where(kept, cost, np.inf)], axis=1)
    committed = np.concatenate([np.full_like(empty, others.committed), committed], axis=1)
    return committed / np.maximum(cost, 1e-9), cost


def _best_prefix(
    goodput: np.ndarray, cost: np.ndarray, kept: np.ndarray, owner: np.ndarray
) -> tuple[float, np.ndarray]:
    """The best goodput of every cap's prefixes, and the owners of its
    drafts: among goodputs within :data:`TIE` of the best, the shortest
    round (every request's tokens soonest)."""
    near = goodput >= goodput.max(axis=1, keepdims=True) * (1 - TIE)
    ends = np.argmin(np.where(near, cost, np.inf), axis=1)  # ties: the shortest round
    position = np.arange(len(owner))
    best: tuple[float, float, np.ndarray] | None = None
    for cap, end in enumerate(ends):
        rate, seconds = float(goodput[cap, end]), float(cost[cap, end])
        if (
            best is None
            or rate > best[0] * (1 + TIE)
            or (rate >= best[0] * (1 - TIE) and seconds < best[1])
        ):
            best = (rate, seconds, owner[kept[cap] & (position < end)])
    assert best is not None  # (at least one cap)
    return best[0], best[2]


def _first_draft_cost(ks: np.ndarray, others: _Others, costs: StepCosts) -> float:
    """What a first draft of a session now at K = 0 would cost a round: a
    token in the step, and a row in the first draft step — or that step,
    where none drafts yet."""
    drafting_first = others.drafting + int((ks > 0).sum())
    tokens = others.tokens + ks.sum()
    token = costs.target.step_costs(np.array([tokens, tokens + 1]), others.rows)
    row = costs.draft_step_costs(np.array([drafting_first, drafting_first + 1]))
    return max(0.0, np.diff(token)[0]) + max(0.0, np.diff(row)[0])


def _log_plan(
    bids: Sequence[Bid],
    ks: np.ndarray,
    goodput: float,
    target_only: float,
    others: _Others,
    costs: StepCosts,
) -> None:
    log.debug(
        "plan",
        ks=ks.tolist(),
        alphas=[round(b.alpha, 3) for b in bids],
        offers=[len(b.gains) for b in bids],
        goodput=round(goodput, 1),
        target_only=round(target_only, 1),
        others=(round(others.rows - others.sessions, 1), round(others.tokens - others.sessions, 1)),
        target=[(r, t, round(s * 1e3, 1)) for r, t, s in costs.target.curve],
        draft=[(r, t, round(s * 1e3, 1)) for r, t, s in costs.draft.curve] if costs.draft else None,
        overhead=(round(costs.rpc_cost(False) * 1e3, 1), round(costs.rpc_cost(True) * 1e3, 1)),
        work_per_row=(
            round(costs.target.work_per_row_s * 1e3, 2),
            round(costs.draft.work_per_row_s * 1e3, 2) if costs.draft else None,
        ),
    )


def _rank_within(groups: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements share its group."""
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    counts = np.diff(np.r_[starts, len(groups)])
    ranks = np.empty(len(groups), dtype=float)
    ranks[order] = np.arange(len(groups)) - np.repeat(starts, counts)
    return ranks


def _miss_increments(alphas: np.ndarray, owner: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """What each draft adds to the sessions' summed chance that a speculation
    misses (1 − α^(K+1) for a session drafting K > 0, none for one that
    does not): its session's chance at its depth less that at the depth before."""
    before = np.where(depth > 1, 1.0 - alphas[owner] ** depth, 0.0)
    after = 1.0 - alphas[owner] ** (depth + 1)
    return after - before
