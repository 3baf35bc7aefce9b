"""Adaptive K: how many tokens to draft next round.

With per-token acceptance α and K drafts, a round commits

    E(K) = (1 − α^(K+1)) / (1 − α)          (E = K + 1 when α = 1)

tokens (Leviathan et al. 2023) and costs

    T(K) = K·t_draft + t_verify(K) + t_rpc(2)

with two RPCs on the critical path (propose, verify). Pipelined
(docs/design.md#pipelined-rounds),
the draft drafts the next round — K + 1 steps, its guess of the bonus token
first — while the target verifies this one, so a round whose speculation
held (a hit, probability α^(K+1)) costs

    T_hit(K) = max(t_verify(K) + t_rpc(1), (K+1)·t_draft)

and a miss drafts afresh first: T(K) = T_hit(K) + (1 − α^(K+1))·(K·t_draft +
t_rpc(2) − t_rpc(1)).

The policy drafts the K in 0..K_max that maximises E(K) / T(K) — down to
K = 0 (target only) when speculation does not pay. α is estimated per session
(it depends on the text); the costs are properties of the deployment, so one
:class:`CostModel` per coordinator learns them from every session's rounds.

A cost is only as good as its last measurement: once every session drafts,
nobody measures a target-only round any more, and a stale t_verify(0) can
hold every session at a K that no longer pays. So when no K = 0 round was
seen in ``refresh_rounds`` rounds, one session runs one (a probe).

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
        self.value = (
            sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample
        )


@dataclass
class CostModel:
    """Measured costs of a round's parts, in seconds, shared by sessions."""

    decay: float = 0.9
    refresh_rounds: int = 64
    """Rounds after which the cost of a target-only round is measured again."""
    draft_per_token: _Ema = field(init=False)
    prefill_per_token: _Ema = field(init=False)
    verify: dict[int, _Ema] = field(init=False)
    overhead: dict[bool, _Ema] = field(init=False)
    """Keyed by whether the round waited for a draft RPC (two RPCs or one)."""
    accepted: _Ema = field(init=False)
    judged: _Ema = field(init=False)
    """Per drafting round: accepted drafts, and those plus the rejected one."""
    rounds: int = field(init=False, default=0)
    target_seen: int = field(init=False, default=0)
    """The round that last measured (or was chosen to measure) t_verify(0)."""

    def __post_init__(self) -> None:
        self.draft_per_token = _Ema(self.decay)
        self.prefill_per_token = _Ema(self.decay)
        self.accepted, self.judged = _Ema(self.decay), _Ema(self.decay)
        self.verify = {}
        self.overhead = {False: _Ema(self.decay), True: _Ema(self.decay)}

    def observe(
        self,
        *,
        num_drafts: int,
        draft_s: float,
        verify_s: float,
        overhead_s: float,
        drafted: bool,
        draft_steps: int | None = None,
        num_accepted: int | None = None,
    ) -> None:
        """One round: ``draft_steps`` (default ``num_drafts``) draft steps took
        ``draft_s``; verifying ``num_drafts`` took ``verify_s`` and accepted
        ``num_accepted`` of them."""
        self.rounds += 1
        if num_drafts and num_accepted is not None:
            self.accepted.update(num_accepted)
            self.judged.update(num_accepted + (num_accepted < num_drafts))
        steps = num_drafts if draft_steps is None else draft_steps
        if steps:
            self.draft_per_token.update(draft_s / steps)
        self.verify.setdefault(num_drafts, _Ema(self.decay)).update(verify_s)
        if num_drafts == 0:
            self.target_seen = self.rounds
        self.overhead[drafted].update(overhead_s)

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance over every session's recent drafting rounds."""
        if not self.judged.value:
            return None
        return self.accepted.value / self.judged.value

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A target session opened on ``tokens`` tokens in ``seconds``."""
        self.prefill_per_token.update(seconds / max(1, tokens))

    def prefill_cost(self, tokens: int) -> float | None:
        """What opening a target session on ``tokens`` tokens should cost."""
        per_token = self.prefill_per_token.value
        return None if per_token is None else per_token * tokens

    def claim_target_probe(self) -> bool:
        """True (once per ``refresh_rounds``) when t_verify(0) is stale and
        the caller should run a target-only round to measure it again."""
        if 0 not in self.verify or self.rounds - self.target_seen <= self.refresh_rounds:
            return False
        self.target_seen = self.rounds
        return True

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

    def rpc_cost(self, drafted: bool) -> float:
        """t_rpc with two RPCs on the critical path (``drafted``) or one."""
        overhead = self.overhead[drafted].value
        if overhead is None:
            overhead = self.overhead[not drafted].value or 0.0
        return overhead

    def round_cost(self, k: int, *, hit_rate: float | None = None) -> float | None:
        """T(K): synchronous, or pipelined given the chance that a round's
        speculation holds (``hit_rate``)."""
        verify = self.verify_cost(k)
        if verify is None:
            return None
        t_draft = self.draft_per_token.value or 0.0
        if k == 0:
            return verify + self.rpc_cost(False)
        if hit_rate is None:
            return k * t_draft + verify + self.rpc_cost(True)
        hit = max(verify + self.rpc_cost(False), (k + 1) * t_draft)
        return hit + (1.0 - hit_rate) * (k * t_draft + self.rpc_cost(True) - self.rpc_cost(False))


@dataclass
class AdaptiveK:
    """Chooses K for one session's next round."""

    k_max: int
    costs: CostModel
    pipeline: bool = False
    """Rounds are pipelined: their costs follow the pipelined model."""
    probe_every: int = 8
    decay: float = 0.8
    """Weight of older rounds in the acceptance estimate."""
    # A weak prior worth two rounds: the acceptance every session of this
    # deployment has seen (its drafter's typical α), else α = 0.5, until the
    # session's own rounds say otherwise.
    accepted: float = 1.0
    rejected: float = 1.0
    rounds_at_zero: int = 0
    target_probe: bool = False
    """This session runs the next target-only round that refreshes t_verify(0)."""

    def __post_init__(self) -> None:
        if (alpha := self.costs.alpha) is not None:
            self.accepted, self.rejected = 2.0 * alpha, 2.0 * (1.0 - alpha)

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
        if self.target_probe or self.costs.claim_target_probe():
            self.target_probe = True  # until the round has run
            return 0
        best_k = self._best_k(self.alpha, k_max)
        if best_k > 0:
            self.rounds_at_zero = 0
            return best_k
        if self._best_k(1.0, k_max) == 0:
            return 0  # drafting would not pay even if every draft were accepted
        self.rounds_at_zero += 1
        return 1 if self.rounds_at_zero % self.probe_every == 0 else 0

    def _best_k(self, alpha: float, k_max: int) -> int:
        def rate(k: int) -> float:
            hit_rate = alpha ** (k + 1) if self.pipeline else None
            return expected_tokens(alpha, k) / self.costs.round_cost(k, hit_rate=hit_rate)

        return max(range(k_max + 1), key=rate)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Updates α with one round: its accepted drafts, and the rejected one."""
        if not num_drafts:
            self.target_probe = False
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (1 if num_accepted < num_drafts else 0)
