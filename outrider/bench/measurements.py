"""What one request measured, and a set of requests summed (pure)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar


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
    overhead_time_s: float | None = None
    overhead_s: float | None = None
    """Coordinator overhead per round: the server's median
    (``overhead_s_p50``) or, from a server that does not report it, the mean."""
    adaptive: bool = False
    num_drafts: int = 0
    """Rounds that verified at least one draft token (the others were target-only)."""
    pipeline: bool = False
    """Whether the rounds were pipelined (the server's statistics say so)."""
    speculation_hits: int = 0
    """Pipelined rounds whose verdict matched the draft's assumption: the
    next drafts were ready at once."""
    speculation_misses: int = 0
    """Pipelined rounds whose verdict did not: the draft drafted afresh from
    the committed history."""
    critical_path_overhead_s: float | None = None
    """The server's median per round of the wall time beyond the target's
    verify compute (waiting for drafts, RPCs, the coordinator's work); None
    where the server does not report it."""

    repeats: tuple[Measurement, ...] = ()
    """The other requests of the same configuration and prompt, where this
    one is their median (``--repeat``)."""

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


R = TypeVar("R")


def median_run(runs: Sequence[R], slowness: Callable[[R], float]) -> tuple[R, tuple[R, ...]]:
    """The run of median ``slowness`` (of two in the middle, the slower), and
    the others: what ``--repeat`` reports, and what it holds as repeats."""
    ordered = sorted(runs, key=slowness)
    median = ordered[len(ordered) // 2]
    return median, tuple(r for r in ordered if r is not median)


def median_measurement(measurements: Sequence[Measurement]) -> Measurement:
    """The request of median wall time, holding the others as its ``repeats``."""
    median, others = median_run(measurements, lambda m: m.wall_s)
    return replace(median, repeats=others)


def measurement_from_stats(token_ids: Sequence[int], stats: Any, wall_s: float) -> Measurement:
    """From Outrider's statistics: the client's ``GenerationStats`` or the
    proto's (same field names)."""
    rounds = int(stats.rounds)
    overhead = float(getattr(stats, "overhead_s_p50", 0.0) or 0.0)
    if overhead <= 0.0 and rounds:
        overhead = stats.overhead_time_s / rounds
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
        overhead_time_s=float(stats.overhead_time_s),
        overhead_s=overhead if rounds else None,
        adaptive=bool(getattr(stats, "adaptive", False)),
        num_drafts=int(getattr(stats, "num_drafts", 0)),
        pipeline=bool(getattr(stats, "pipeline", False)),
        speculation_hits=int(getattr(stats, "speculation_hits", 0)),
        speculation_misses=int(getattr(stats, "speculation_misses", 0)),
        critical_path_overhead_s=_critical_path(stats, rounds),
    )


def _critical_path(stats: Any, rounds: int) -> float | None:
    """``critical_path_overhead_s_p50``; None without rounds or from a server
    that does not report it (0)."""
    value = float(getattr(stats, "critical_path_overhead_s_p50", 0.0) or 0.0)
    return value if rounds and value > 0.0 else None


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
    overhead_time_s: float | None
    overhead_s_p50: float | None
    """Median over the requests of their per-round overhead."""
    num_drafts: int = 0
    speculation_hits: int = 0
    speculation_misses: int = 0
    critical_path_overhead_s_p50: float | None = None
    """Median over the requests of their median per-round critical-path overhead
    (the servers report a median per request, not each round's value)."""

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

    @property
    def speculation_hit_rate(self) -> float | None:
        """hits / (hits + misses); None where no round was pipelined."""
        speculated = self.speculation_hits + self.speculation_misses
        return self.speculation_hits / speculated if speculated else None

    def per_round_ms(self, seconds: float | None) -> float | None:
        return 1000.0 * seconds / self.rounds if seconds is not None and self.rounds else None


def _sum_optional(values: Iterable[float | None]) -> float | None:
    values = list(values)
    present = [v for v in values if v is not None]
    return float(sum(present)) if values and len(present) == len(values) else None


def aggregate(measurements: Sequence[Measurement]) -> Totals:
    """Sums; the per-position histograms are added position by position."""
    width = max((len(m.accepted_per_position) for m in measurements), default=0)
    per_position = [0] * width
    for m in measurements:
        for i, n in enumerate(m.accepted_per_position):
            per_position[i] += n
    overheads = [m.overhead_s for m in measurements if m.overhead_s is not None]
    critical_paths = [
        m.critical_path_overhead_s for m in measurements if m.critical_path_overhead_s is not None
    ]
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
        overhead_time_s=_sum_optional(m.overhead_time_s for m in measurements),
        overhead_s_p50=statistics.median(overheads) if overheads else None,
        num_drafts=sum(m.num_drafts for m in measurements),
        speculation_hits=sum(m.speculation_hits for m in measurements),
        speculation_misses=sum(m.speculation_misses for m in measurements),
        critical_path_overhead_s_p50=statistics.median(critical_paths) if critical_paths else None,
    )
