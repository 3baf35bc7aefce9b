"""One session's adaptive K: how many tokens it drafts next round.

Its K is its share of the plan of the target replica it runs on
(:mod:`outrider.coordinator.adaptive.cost_model`), and never more than the
target's CUDA graphs hold. The plan weighs its drafts by its acceptance α:
its own drafting rounds, drawn toward what every session has seen. At
K = 0 a session learns nothing of its α, so every ``probe_every`` rounds
it drafts one token to look again — unless the look could not change the
answer: its α is already known from every session's rounds on the same
evidence, or a first draft would not pay even at a far better α.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from outrider.coordinator.adaptive.cost_model import CostModel
from outrider.coordinator.adaptive.planner import Bid

LEARNING_K = 4
"""K of a round drafted to learn what drafting costs, before any was measured."""
PRIOR_TOKENS = 8.0
"""The weight, in judged draft tokens, of the deployment's acceptance in
each session's estimate: a session's own few rounds alone are noisy."""


def adaptive_k_max(k_max: int, graphed_tokens_per_row: int) -> int:
    """The largest K adaptive rounds choose: ``k_max``, but within the
    target's CUDA graphs where it has them (``graphed_tokens_per_row``, 0:
    none). A verify of more tokens a row runs eagerly, many times slower
    than a replay (docs/benchmark.md#a-steps-cost), and its step curve — by
    tokens per step — cannot tell such a step from one of as many tokens
    spread over graphed rows."""
    if graphed_tokens_per_row <= 0:
        return k_max
    return min(k_max, graphed_tokens_per_row - 1)


@dataclass
class AdaptiveK:
    """The adaptive K of one session: its acceptance estimate, and its K
    from its cost model's plan of every adaptive session on its target
    replica (``close`` leaves it, :meth:`move` changes it)."""

    k_max: int
    costs: CostModel
    pipeline: bool = False
    """Rounds are pipelined: their costs follow the pipelined model."""
    probe_every: int = 8
    """Rounds at K = 0 between two probes."""
    decay: float = 0.9
    """Weight of older rounds in the session's own counts."""
    accepted: float = 0.0
    rejected: float = 0.0
    """The session's drafting rounds (decayed sums): accepted drafts, and
    rejected ones."""
    rounds_at_zero: int = 0
    """Rounds at K = 0 since the last that drafted."""
    k_last: int | None = None
    """The K of this session's last verified round (its share of the load)."""
    evidence: int | None = None
    offered: int | None = None
    """What the drafter offers for the next round, where it knows before
    drafting (a lookup's drafts, :meth:`offer`): the evidence its drafts rest
    on, and how many there are. None: a draft model's, as many as asked, on
    no evidence."""

    key: int = field(init=False)
    """Its key in its cost model's plan."""

    def __post_init__(self) -> None:
        self.key = self.costs.join(self)

    def close(self) -> None:
        self.costs.leave(self.key)

    def move(self, costs: CostModel) -> None:
        """The session runs on the engine ``costs`` models now: it is planned
        with the sessions there."""
        if costs is not self.costs:
            self.costs.leave(self.key)
            self.costs = costs
            self.key = costs.join(self)

    def offer(self, evidence: int | None, tokens: int | None) -> None:
        """The drafter has ``tokens`` drafts for the next round, on
        ``evidence`` (None, None: the draft model drafts it)."""
        if (evidence, tokens) != (self.evidence, self.offered):
            self.evidence, self.offered = evidence, tokens
            self.costs.changed()

    @property
    def k_most(self) -> int:
        """The most drafts its next round can have."""
        return self.k_max if self.offered is None else min(self.k_max, self.offered)

    @property
    def alpha(self) -> float:
        """Its per-token acceptance (:attr:`model_alpha`) — or, for drafts
        on evidence, the acceptance of the first draft that every session's
        drafts on the same evidence had: that says more of the next drafts
        than the session's past does (:meth:`gains`)."""
        if self.evidence is not None:
            return float(self.gains(1)[0])
        return self.model_alpha

    @property
    def model_alpha(self) -> float:
        """The per-token acceptance of its draft model's drafts: its own
        rounds', drawn toward what every session of the deployment has seen
        (its drafter's typical α; 0.5 before any) by :data:`PRIOR_TOKENS`
        judged drafts."""
        prior = self.costs.acceptance.alpha_or_prior
        judged = self.accepted + self.rejected + PRIOR_TOKENS
        return (self.accepted + PRIOR_TOKENS * prior) / judged

    def gains(self, k: int) -> np.ndarray:
        """What each of its next ``k`` drafts adds to the tokens its round
        commits: the chance that it and every draft before it are accepted,
        α^j — or, for drafts on evidence, what every session's drafts on
        the same evidence had at each depth
        (:meth:`outrider.coordinator.adaptive.acceptance.Acceptance.survival_of`)."""
        if self.evidence is not None:
            return self.costs.acceptance.survival_of(self.evidence, k, PRIOR_TOKENS)
        return self.alpha ** np.arange(1, k + 1)

    def choose(self, limit: int, *, may_probe: bool = True) -> int:
        """K for the next round, at most ``limit`` (the room left). A session
        whose draft model has not opened does not probe (``may_probe``
        False): its look would first pay the draft's prefill — on cores
        the draft shares with the target, in every session's steps — to
        learn what the deployment's record already says of it."""
        k_max = min(self.k_most, limit)
        if k_max <= 0:
            return 0
        looked_up = self.evidence is not None  # (its drafts cost no draft step)
        if not self.costs.measured or not (looked_up or self.costs.draft_measured):
            return min(k_max, LEARNING_K)  # draft, and learn what a round costs
        plan = self.costs.plan()
        k = min(plan.ks.get(self.key, 0), k_max)
        if k > 0:
            self.rounds_at_zero = 0
            return k
        if not may_probe or self.alpha_known or 1.0 - (1.0 - self.alpha) / 2.0 <= plan.price:
            return 0  # a look would teach nothing, or not pay even at a far better α
        self.rounds_at_zero += 1
        if self.rounds_at_zero < self.probe_every:
            return 0
        self.rounds_at_zero = 0
        return 1

    @property
    def alpha_known(self) -> bool:
        """Whether its α is known without looking: its drafts rest on
        evidence (:meth:`offer`) that the deployment's drafts have been
        judged on, in :data:`PRIOR_TOKENS` rounds at least — every session's
        drafting rounds keep that record, where a probe would add one."""
        if self.evidence is None:
            return False
        return self.costs.acceptance.judged_on(self.evidence) >= PRIOR_TOKENS

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Updates its draft model's α with one round of its drafts: their
        accepted drafts, and the rejected one (drafts on evidence are
        counted by depth for every session: :meth:`gains`)."""
        self.k_last = num_drafts
        if not num_drafts or self.evidence is not None:
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1 if num_accepted < num_drafts else 0)

    def bid(self) -> Bid:
        """What the plan knows of it (:class:`outrider.coordinator.adaptive.planner.Bid`)."""
        return Bid(
            key=self.key,
            gains=tuple(float(g) for g in self.gains(self.k_most)),
            alpha=self.alpha,
            k_last=self.k_last or 0,
            pipelined=self.pipeline,
            looked_up=self.evidence is not None,
        )
