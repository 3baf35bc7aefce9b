"""The cost model of each target replica: its step costs
(:mod:`outrider.coordinator.adaptive.step_costs`), the adaptive sessions that run
on it, and their plan (:func:`outrider.coordinator.adaptive.planner.plan`), made
again after a target step or when the sessions change. Sessions share
steps only with those on the same engine, so each target replica has its
own model; what the drafts had accepted is one record for all
(:mod:`outrider.coordinator.adaptive.acceptance`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from outrider.coordinator.adaptive.acceptance import Acceptance
from outrider.coordinator.adaptive.planner import Bid, Plan, plan
from outrider.coordinator.adaptive.step_costs import StepCosts
from outrider.logging import get_logger

log = get_logger(__name__)

PLANNING_SHARE = 0.1
"""The most of the coordinator's time planning takes: a plan is computed
again only once this share of the time since the last has passed its
computing. A plan of tens of sessions takes about as long as a GPU step
of a small target, on the core that runs every session's rounds."""
MAX_IDLE_MODELS = 16
"""Cost models of target replicas with no adaptive session kept, the most
recently used (:class:`CostModels`)."""
PLAN_ERROR = 0.1
"""How far a plan's goodput may be off what its rounds then make, with
many sessions beside the one deciding: the engines' step times drift by
up to 10% on a shared machine, and the others' rounds are theirs. A draft
opens only where it pays at the end of this error that favours K = 0, in
proportion to the others' share of the steps (none for a session alone)."""


class Bidder(Protocol):
    """A session the plan chooses K for (:class:`~.session.AdaptiveK`)."""

    def bid(self) -> Bid: ...


_keys = itertools.count()
"""Each joining session's key in its model's plan."""


@dataclass
class CostModel(StepCosts):
    """What rounds cost on one target replica (:class:`StepCosts`), what
    the drafts had accepted (the deployment's, shared with the other
    replicas' models), and the adaptive sessions on it, whose K it plans
    together."""

    planning_share: float = PLANNING_SHARE
    """The most of the coordinator's time planning may take (inf: plan
    whenever the load or the sessions changed)."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """What the drafts had accepted: the models', the same on every replica
    (:class:`CostModels` shares it)."""
    sessions: dict[int, Bidder] = field(init=False, default_factory=dict)
    """The adaptive sessions running now, by key, planned together."""
    _version: int = field(init=False, default=0)
    """Counts the joins, leaves and offers: a plan is for one set of
    sessions, each with what its drafter offers (:meth:`changed`)."""
    _plan: Plan | None = field(init=False, default=None)
    _planned_at: tuple[int, int] = field(init=False, default=(-1, -1))
    _planned_time: float = field(init=False, default=0.0)
    _planning_s: float = field(init=False, default=0.0)

    def observe(
        self,
        *,
        num_drafts: int,
        draft_s: float,
        overhead_s: float,
        drafted: bool,
        draft_steps: int | None = None,
        num_accepted: int | None = None,
        evidence: int | None = None,
    ) -> None:
        """One round: what it cost (:meth:`StepCosts.observe`), and that the
        target accepted ``num_accepted`` of ``num_drafts`` (drafted on
        ``evidence``, if the drafter has any: :meth:`Acceptance.observe`)."""
        if num_drafts and num_accepted is not None:
            self.acceptance.observe(num_drafts, num_accepted, evidence)
        super().observe(
            num_drafts=num_drafts,
            draft_s=draft_s,
            overhead_s=overhead_s,
            drafted=drafted,
            draft_steps=draft_steps,
        )

    # --- planning --------------------------------------------------------------

    def join(self, session: Bidder) -> int:
        """Plans ``session`` with the others from now on; its key in the plan."""
        key = next(_keys)
        self.sessions[key] = session
        self._version += 1
        return key

    def leave(self, key: int) -> None:
        if self.sessions.pop(key, None) is not None:
            self._version += 1

    def changed(self) -> None:
        """A session's offer changed (:meth:`~.session.AdaptiveK.offer`)."""
        self._version += 1

    def plan(self) -> Plan:
        """The K of every adaptive session that maximises the goodput
        (:func:`outrider.coordinator.adaptive.planner.plan`), made again after a
        target step or when the sessions change — but taking at most
        ``planning_share`` of the time (a session the plan does not know
        yet drafts nothing)."""
        stamp = (self.target.steps, self._version)
        now = time.perf_counter()
        due = now - self._planned_time >= self._planning_s / self.planning_share
        if self._plan is None or (stamp != self._planned_at and due):
            bids = [session.bid() for session in self.sessions.values()]
            self._plan = plan(bids, self)
            self._planned_at, self._planned_time = stamp, now
            self._planning_s = time.perf_counter() - now
        return self._plan

    def draft_prefill_pays(
        self,
        tokens: int,
        tokens_left: int,
        *,
        beside: bool = False,
        gains: Sequence[float] = (),
    ) -> bool:
        """Whether a draft session opened now on ``tokens`` tokens repays its
        prefill — which the round that first drafts waits for and, where the
        draft shares the target's cores, every session — or what of it
        outlasts the target's prefill where it runs ``beside`` it: the
        ``tokens_left`` still to come, made at the plan's goodput G rather
        than at K = 0's G₀, each at the end of its error ε (:data:`PLAN_ERROR`
        times the others' share of the target's R rows) that favours the
        other, must save more than the prefill costs:

            tokens_left · (1/(G₀(1 + ε)) − 1/(G(1 − ε))) > d(prefill).

        Nor more than it would save alone (its drafts' ``gains``): at a
        wave of new sessions the steps hold their prompts' prefills, which
        price K = 0 far above what it costs once they end, and drafting,
        which adds a few tokens to such steps, far below — on 2 CPU cores
        at 8 streams the plan priced K = 0 at 9.5 tok/s where it made 78.
        True before the draft's steps are measured: an open teaches them."""
        if self.draft is None or not self.draft.curve:
            return True
        plan = self.plan()
        if plan.goodput <= plan.target_only or plan.target_only <= 0:
            return False
        rows = max(1.0, self.target.rows_per_step, len(self.sessions))
        error = PLAN_ERROR * (1 - 1 / rows)
        prefill = self.draft_prefill_cost(tokens)
        if beside:
            prefill = max(0.0, prefill - (self.prefill_cost(tokens) or 0.0))
        saved = tokens_left * min(
            1 / (plan.target_only * (1 + error)) - 1 / (plan.goodput * (1 - error)),
            self._saved_alone(gains),
        )
        log.debug(
            "draft prefill priced",
            tokens=tokens,
            tokens_left=tokens_left,
            saved_ms=round(saved * 1e3, 1),
            prefill_ms=round(prefill * 1e3, 1),
            goodput=round(plan.goodput, 1),
            target_only=round(plan.target_only, 1),
        )
        return saved > prefill

    def _saved_alone(self, gains: Sequence[float]) -> float:
        """Seconds a token of a session alone saves drafting ``gains`` (what
        each of its drafts adds to a round) against K = 0 (inf: unknown)."""
        k = len(gains)
        if not k or not self.target.curve:
            return math.inf
        single = self.target.step_costs(np.array([1.0, k + 1.0]), 1.0)
        work = self.target.work_per_row_s
        drafting = k * float(self.draft_step_costs(np.array([1.0]))[0])
        at_zero = self.rpc_cost(False) + single[0] + work
        at_k = (self.rpc_cost(True) + drafting + single[1] + work) / (1.0 + sum(gains))
        return float(at_zero - at_k)


class CostModels:
    """A coordinator's cost models, one for each target replica its sessions
    run on: sessions share steps only with those on the same engine, and
    each engine reports its own costs and load. What the drafts had
    accepted is shared (:class:`outrider.coordinator.adaptive.acceptance.Acceptance`). The
    draft's costs are those of whichever draft replica answered a model's
    sessions last.

    Replicas come and go (under Kubernetes each new pod has a new address):
    past ``max_idle`` models that no adaptive session is planned with, the
    least recently used is forgotten. A replica whose model was forgotten
    measures its costs again, as a new one does."""

    def __init__(
        self, planning_share: float = PLANNING_SHARE, max_idle: int = MAX_IDLE_MODELS
    ) -> None:
        self.acceptance = Acceptance()
        self.planning_share = planning_share
        self.max_idle = max_idle
        self._by_replica: dict[str, CostModel] = {}
        """Target replica's address → its model, the last one used last."""

    def of(self, replica: str) -> CostModel:
        """The model of the sessions on the target replica at ``replica``."""
        if (costs := self._by_replica.pop(replica, None)) is not None:
            self._by_replica[replica] = costs  # (the last used, last)
            return costs
        costs = CostModel(planning_share=self.planning_share, acceptance=self.acceptance)
        self._by_replica[replica] = costs
        self._forget_idle()
        return costs

    def _forget_idle(self) -> None:
        """Forgets the least recently used models no session is planned
        with, past ``max_idle`` of them: once a model is added, the only
        time the map grows — not at every round's lookup."""
        idle = [replica for replica, costs in self._by_replica.items() if not costs.sessions]
        for replica in idle[: max(0, len(idle) - self.max_idle)]:
            del self._by_replica[replica]

    def likeliest(self) -> CostModel:
        """The model of a session yet to open: that of the replica with the
        most sessions, the last used among as many — before any session
        opened, one for every session until it opens."""
        if not self._by_replica:
            return self.of("")
        return max(reversed(self._by_replica.values()), key=lambda costs: len(costs.sessions))
