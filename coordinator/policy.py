"""Adaptive K: how many tokens to draft next round.

With per-token acceptance α and K drafts, a round commits

    E(K) = (1 − α^(K+1)) / (1 − α)          (E = K + 1 when α = 1)

tokens (Leviathan et al. 2023) and costs

    T(K) = K·t_draft + t_verify(K) + t_overhead(K)

so the policy drafts the K in 0..K_max that maximises E(K) / T(K) — down to
K = 0 (target only) when speculation does not pay. α is estimated per session
(it depends on the text); the costs are properties of the deployment, so one
:class:`CostModel` per coordinator learns them from every session's rounds.

While K = 0, nothing is learnt about α; every ``probe_every`` rounds the
policy drafts one token to look again — unless drafting would not pay even
with every draft accepted (a draft as slow as the target), when looking
again cannot change the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: int) -> float:
    """E(K): tokens one round commits, the recovered or bonus token included."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class _Ema:
    """Exponential moving average that starts at its first sample."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.value: float | None = None

    def update(self, sample: float) -> None:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample


@dataclass
class CostModel:
    """Measured costs of a round's parts, in seconds, shared by sessions."""

    decay: float = 0.9
    draft_per_token: _Ema = field(init=False)
    verify: dict[int, _Ema] = field(init=False)
    overhead: dict[bool, _Ema] = field(init=False)
    """Keyed by whether the round called the draft (one RPC or two)."""

    def __post_init__(self) -> None:
        self.draft_per_token = _Ema(self.decay)
        self.verify = {}
        self.overhead = {False: _Ema(self.decay), True: _Ema(self.decay)}

    def observe(self, *, num_drafts: int, draft_s: float, verify_s: float, overhead_s: float, drafted: bool) -> None:
        if num_drafts:
            self.draft_per_token.update(draft_s / num_drafts)
        self.verify.setdefault(num_drafts, _Ema(self.decay)).update(verify_s)
        self.overhead[drafted].update(overhead_s)

    def verify_cost(self, k: int) -> float | None:
        """t_verify(K): measured, else the least-squares line through the
        measured sizes (flat through a single one: optimistic, so K gets tried)."""
        if k in self.verify:
            return self.verify[k].value
        points = [(n, e.value) for n, e in self.verify.items()]
        if not points:
            return None
        mean_k = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((n - mean_k) ** 2 for n, _ in points)
        slope = 0.0 if spread == 0 else sum((n - mean_k) * (t - mean_t) for n, t in points) / spread
        return mean_t + max(0.0, slope) * (k - mean_k)

    def round_cost(self, k: int) -> float | None:
        verify = self.verify_cost(k)
        if verify is None:
            return None
        draft = (self.draft_per_token.value or 0.0) * k
        overhead = self.overhead[k > 0].value
        if overhead is None:
            overhead = self.overhead[k == 0].value or 0.0
        return draft + verify + overhead


@dataclass
class AdaptiveK:
    """Chooses K for one session's next round."""

    k_max: int
    costs: CostModel
    probe_every: int = 8
    decay: float = 0.8
    """Weight of older rounds in the acceptance estimate."""
    # A weak prior: α ≈ 0.5 until rounds say otherwise.
    accepted: float = 1.0
    rejected: float = 1.0
    rounds_at_zero: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, limit: int) -> int:
        """K for the next round, at most ``limit`` (the room left)."""
        k_max = min(self.k_max, limit)
        if k_max <= 0:
            return 0
        if self.costs.round_cost(0) is None or self.costs.draft_per_token.value is None:
            return k_max  # nothing measured yet: draft, and learn the costs
        best_k = self._best_k(self.alpha, k_max)
        if best_k > 0:
            self.rounds_at_zero = 0
            return best_k
        if self._best_k(1.0, k_max) == 0:
            return 0  # drafting would not pay even if every draft were accepted
        self.rounds_at_zero += 1
        return 1 if self.rounds_at_zero % self.probe_every == 0 else 0

    def _best_k(self, alpha: float, k_max: int) -> int:
        return max(range(k_max + 1), key=lambda k: expected_tokens(alpha, k) / self.costs.round_cost(k))

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Updates α with one round: its accepted drafts, and the rejected one."""
        if not num_drafts:
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1 if num_accepted < num_drafts else 0)
