"""What one request measured, and a set of requests summed (pure)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Measurement:
    """One request of one configuration."""

    token_ids: tuple[int, ...]
    prompt_tokens: int
    wall_s: float
    rounds: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    draft_time_s: float | None = None
    """The worker times are ``None`` where there is no split (Hugging Face)."""
    verify_time_s: float | None = None
    rpc_time_s: float | None = None
    overhead_s: float | None = None
    """Coordinator overhead per round: the server's median (``overhead_s_p50``) or, from a server that does not report it, the mean."""
    adaptive: bool = False

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


def measurement_from_stats(token_ids: Sequence[int], stats: Any, wall_s: float) -> Measurement:
    """From Outrider's statistics: the client's ``GenerationStats`` or the proto's (same field names)."""
    rounds = int(stats.rounds)
    overhead = float(getattr(stats, "overhead_s_p50", 0.0) or 0.0)
    if overhead <= 0.0 and rounds:
        overhead = stats.rpc_time_s / rounds
    return Measurement(
        token_ids=tuple(token_ids),
        prompt_tokens=int(stats.prompt_tokens),
        wall_s=wall_s,
        rounds=rounds,
        draft_tokens=int(stats.draft_tokens),
        accepted_tokens=int(stats.accepted_tokens),
        accepted_per_position=tuple(int(n) for n in stats.accepted_per_position),
        draft_time_s=float(stats.draft_time_s),
        verify_time_s=float(stats.verify_time_s),
        rpc_time_s=float(stats.rpc_time_s),
        overhead_s=overhead if rounds else None,
        adaptive=bool(getattr(stats, "adaptive", False)),
    )


@dataclass(frozen=True)
class Totals:
    """A set of measurements, summed."""

    prompts: int
    generated_tokens: int
    wall_s: float
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    draft_time_s: float | None
    verify_time_s: float | None
    rpc_time_s: float | None
    overhead_s_p50: float | None
    """Median over the requests of their per-round overhead."""

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per round, the recovered or bonus token included."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else None

    def per_round_ms(self, seconds: float | None) -> float | None:
        return 1000.0 * seconds / self.rounds if seconds is not None and self.rounds else None


def _sum_optional(values: Iterable[float | None]) -> float | None:
    values = list(values)
    return None if not values or any(v is None for v in values) else float(sum(values))


def aggregate(measurements: Sequence[Measurement]) -> Totals:
    """Sums; the per-position histograms are added position by position."""
    width = max((len(m.accepted_per_position) for m in measurements), default=0)
    per_position = [0] * width
    for m in measurements:
        for i, n in enumerate(m.accepted_per_position):
            per_position[i] += n
    overheads = [m.overhead_s for m in measurements if m.overhead_s is not None]
    return Totals(
        prompts=len(measurements),
        generated_tokens=sum(m.generated_tokens for m in measurements),
        wall_s=sum(m.wall_s for m in measurements),
        rounds=sum(m.rounds for m in measurements),
        draft_tokens=sum(m.draft_tokens for m in measurements),
        accepted_tokens=sum(m.accepted_tokens for m in measurements),
        accepted_per_position=tuple(per_position),
        draft_time_s=_sum_optional(m.draft_time_s for m in measurements),
        verify_time_s=_sum_optional(m.verify_time_s for m in measurements),
        rpc_time_s=_sum_optional(m.rpc_time_s for m in measurements),
        overhead_s_p50=statistics.median(overheads) if overheads else None,
    )
