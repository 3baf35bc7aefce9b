"""What an engine tells the coordinator about itself: what a step costs as a
function of the tokens in it, how loaded it is, and that it is alive.

The coordinator chooses each session's K from what its drafts add to the
step everyone shares (docs/design.md#speculation-under-load), so the engine
measures its own step cost rather than leaving a session to time its
verify: in a shared step a session's verify takes the step's time whatever
its own K. The cost is kept as a curve — the moving average of a forward
pass's seconds for each power-of-two range of tokens, at the average tokens
seen in that range — which follows a GPU's flat-then-linear shape and a
CPU's linear one alike.

``steps`` counts the forward passes begun since start, and ``running_s``
says how long the one under way has run: a worker whose count moves, or
whose step began lately, is busy, not frozen (``coordinator.workers.answer_of``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

DECAY = 0.9
"""Weight of the past in each moving average (per step)."""


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of an engine's costs and load."""

    curve: tuple[tuple[float, float], ...] = ()
    """``(tokens, seconds)`` of a forward pass, by increasing tokens."""
    tokens_per_step: float = 0.0
    rows_per_step: float = 0.0
    steps: int = 0
    """Forward passes begun since the engine started."""
    running_s: float = 0.0
    """How long the step under way has run (0: none is)."""

    def step_cost(self, tokens: float) -> float | None:
        """Seconds of a step of ``tokens`` tokens, interpolated along the
        curve (flat below its first point, on its last slope beyond its
        last); None before any step was measured."""
        curve = self.curve
        if not curve:
            return None
        if tokens <= curve[0][0] or len(curve) == 1:
            first_tokens, first_s = curve[0]
            if tokens <= first_tokens:
                return first_s
            return first_s * tokens / first_tokens  # one point: proportional beyond it
        for (t0, s0), (t1, s1) in zip(curve, curve[1:], strict=False):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        (t0, s0), (t1, s1) = curve[-2], curve[-1]
        return s1 + max(0.0, (s1 - s0) / (t1 - t0)) * (tokens - t1)


class LoadMeter:
    """Measures an engine's steps (on its thread) and publishes
    :class:`EngineLoad` snapshots that any thread may read."""

    def __init__(self) -> None:
        self._begun = 0
        self._began_at: float | None = None
        self.reset()

    def reset(self) -> None:
        """Forgets the costs and load measured so far (a warm-up's); the
        heartbeat goes on counting."""
        self._buckets: dict[int, list[float]] = {}
        """Power-of-two range → [average tokens, average seconds]."""
        self._tokens = 0.0
        self._rows = 0.0
        self._steps = 0
        self._snapshot = EngineLoad()

    @property
    def load(self) -> EngineLoad:
        began_at = self._began_at  # one read: the engine thread may clear it meanwhile
        running_s = 0.0 if began_at is None else time.perf_counter() - began_at
        return replace(self._snapshot, steps=self._begun, running_s=running_s)

    def begin(self) -> None:
        """A step begins (its count is the engine's heartbeat)."""
        self._began_at = time.perf_counter()
        self._begun += 1

    def stepped(self, *, rows: int, tokens: int, seconds: float) -> None:
        """A step ended: ``rows`` rows of ``tokens`` tokens took ``seconds``."""
        self._began_at = None
        bucket = self._buckets.get(key := _range_of(tokens))
        if bucket is None:
            self._buckets[key] = [float(tokens), seconds]
        else:
            bucket[0] = DECAY * bucket[0] + (1 - DECAY) * tokens
            bucket[1] = DECAY * bucket[1] + (1 - DECAY) * seconds
        first = self._steps == 0
        self._tokens = tokens if first else DECAY * self._tokens + (1 - DECAY) * tokens
        self._rows = rows if first else DECAY * self._rows + (1 - DECAY) * rows
        self._steps += 1
        curve = tuple(sorted((t, s) for t, s in self._buckets.values()))
        self._snapshot = EngineLoad(curve, self._tokens, self._rows, self._steps)


def _range_of(tokens: int) -> int:
    """The power of two at or above ``tokens``."""
    return 1 << max(0, tokens - 1).bit_length()
