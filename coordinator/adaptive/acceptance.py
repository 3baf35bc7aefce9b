"""What the drafts had accepted: every session's drafting rounds, decayed,
for the whole deployment and, where the drafter knows what its drafts rest
on (prompt lookup: the n of its match), depth by depth for each such
evidence — what the plan of K (:mod:`outrider.coordinator.adaptive.planner`) weighs each
session's drafts by. A property of the draft and target models, the same
on every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEPLOYMENT_DECAY = 0.99
"""Weight of older rounds in the deployment's acceptance (per round of
any session): it is every session's prior, so it forgets slowly."""
PRIOR_ALPHA = 0.5
"""The per-token acceptance assumed of drafts before any is judged."""


@dataclass
class Acceptance:
    """What every session's drafting rounds had accepted (decayed sums, by
    :data:`DEPLOYMENT_DECAY` a round): a property of the draft and target
    models, the same on every replica."""

    accepted: float = 0.0
    judged: float = 0.0
    """Accepted drafts, and those plus the rejected ones, of the rounds
    drafted on no evidence (a model's)."""
    accepted_on_evidence: float = 0.0
    judged_on_evidence: float = 0.0
    """The same of the rounds drafted on evidence (a lookup's), whatever it was."""
    by_evidence: dict[int, Depths] = field(default_factory=dict)
    """The drafts judged and accepted at each depth, by the evidence the
    drafter had for them before drafting them (prompt lookup: the n of its
    match)."""

    def observe(self, num_drafts: int, num_accepted: int, evidence: int | None = None) -> None:
        """A round accepted ``num_accepted`` of ``num_drafts`` drafted on
        ``evidence``: counted by depth under its evidence, or where it has
        none (a model's drafts) in :attr:`alpha` — which then prices a
        model's drafts, whatever a lookup beside it drafts
        (:mod:`outrider.coordinator.round_loop`)."""
        judged = num_accepted + (num_accepted < num_drafts)
        if evidence is not None:
            self.by_evidence.setdefault(evidence, Depths()).observe(num_drafts, num_accepted)
            self.accepted_on_evidence = DEPLOYMENT_DECAY * self.accepted_on_evidence + num_accepted
            self.judged_on_evidence = DEPLOYMENT_DECAY * self.judged_on_evidence + judged
            return
        self.accepted = DEPLOYMENT_DECAY * self.accepted + num_accepted
        self.judged = DEPLOYMENT_DECAY * self.judged + judged

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance over every session's recent drafting rounds
        on no evidence."""
        return self.accepted / self.judged if self.judged else None

    @property
    def alpha_or_prior(self) -> float:
        """:attr:`alpha`, or :data:`PRIOR_ALPHA` before any such round."""
        return PRIOR_ALPHA if self.alpha is None else self.alpha

    def judged_on(self, evidence: int) -> float:
        """Rounds whose first draft, drafted on ``evidence``, was judged (decayed)."""
        depths = self.by_evidence.get(evidence)
        return depths.judged[0] if depths else 0.0

    def survival_of(self, evidence: int, k: int, prior_weight: float) -> np.ndarray:
        """The chance that the j-th draft drafted on ``evidence`` and every
        one before it are accepted, for j = 1 .. ``k``: the product of each
        depth's acceptance once the drafts before it were, as every
        session's recent rounds on that evidence had it, each drawn by
        ``prior_weight`` judged drafts toward the depth's before it — the
        first toward the per-token acceptance of every draft on evidence
        (0.5 before any: a model's α says nothing of them). Drafts copied from
        the history come in runs, the first often rejected and a later one
        rarely once those before it were: no per-token rate prices both
        (docs/design.md#adaptive-k)."""
        depths = self.by_evidence.get(evidence, Depths())
        conditional = (
            self.accepted_on_evidence / self.judged_on_evidence
            if self.judged_on_evidence
            else PRIOR_ALPHA
        )
        survival = np.empty(k)
        for j in range(k):
            judged = depths.judged[j] if j < len(depths.judged) else 0.0
            accepted = depths.accepted[j] if j < len(depths.accepted) else 0.0
            conditional = (accepted + prior_weight * conditional) / (judged + prior_weight)
            survival[j] = conditional * (survival[j - 1] if j else 1.0)
        return survival


@dataclass
class Depths:
    """Drafts on one evidence by depth (decayed sums, by
    :data:`DEPLOYMENT_DECAY` a round on it): at each depth j (from 0), the
    rounds that judged their j-th draft — drafted it, and accepted every
    one before it — and those that accepted it."""

    judged: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A round accepted ``num_accepted`` of its ``num_drafts`` drafts."""
        missing = num_drafts - len(self.judged)
        self.judged.extend([0.0] * missing)
        self.accepted.extend([0.0] * missing)
        judged = min(num_accepted + 1, num_drafts)  # the accepted, and the first rejected
        for j in range(len(self.judged)):
            self.judged[j] = DEPLOYMENT_DECAY * self.judged[j] + (j < judged)
            self.accepted[j] = DEPLOYMENT_DECAY * self.accepted[j] + (j < num_accepted)
