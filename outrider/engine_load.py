"""What an engine tells the coordinator about itself: what a step costs as a
function of the rows and tokens in it, how loaded it is, and that it is alive.

The coordinator chooses each session's K from what its drafts add to the
step everyone shares (docs/design.md#speculation-under-load), so the engine
measures its own step cost rather than leaving a session to time its
verify: in a shared step a session's verify takes the step's time whatever
its own K. The cost is kept as a surface of points, one for each
power-of-two range of rows and of tokens: the median rows, tokens and
seconds of that range's last :data:`WINDOW` forward passes. Along the
tokens of one range of rows it follows a GPU's flat-then-linear shape and a
CPU's linear one alike; the rows keep apart steps of one shape that cost
differently — a one-row prefill of 60 tokens costs, on a CPU, about half a
verify of eight rows of 5. A median, not a mean: a rare step far off its
range's usual cost (a shape's first run, eager past the CUDA graphs) says
nothing of the steps the coordinator plans, and a mean would carry it for
dozens of steps — for ever, in a range no step comes back to.

``steps`` counts the forward passes begun since start, and ``running_s``
says how long the one under way has run: a worker whose count moves, or
whose step began lately, is busy, not frozen
(``outrider.coordinator.workers.grpc_client.answer_of``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

WINDOW = 15
"""Steps each median is taken over: of each range of the surface, and of
the load (the rows and tokens of the last steps)."""

DECODE_TOKENS_PER_ROW = 1.5
"""Fewer tokens a row than this make a decode step, a token a row (a
point of the surface is a median of its range's steps, which may mix)."""

Point = tuple[float, float, float]
"""``(rows, tokens, seconds)`` of a forward pass."""


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of an engine's costs and load."""

    curve: tuple[Point, ...] = ()
    """The step cost surface, by increasing rows, then tokens."""
    tokens_per_step: float = 0.0
    rows_per_step: float = 0.0
    steps: int = 0
    """Forward passes begun since the engine started."""
    running_s: float = 0.0
    """How long the step under way has run (0: none is)."""
    work_per_row_s: float = 0.0
    """The engine's own work between two forward passes — answering the
    last step's rows, starting the calls that came meanwhile, scheduling —
    per row of the step after it: the median of the last steps. Every row
    of a step waits for all of it, so a round pays it for each row of its
    step whatever its K; where a step is a few milliseconds of GPU time and
    tens of rows, it is most of a round."""

    def step_cost(self, tokens: float, rows: float = 1.0) -> float | None:
        """Seconds of a step of ``tokens`` tokens in ``rows`` rows; None
        before any step was measured."""
        if not self.curve:
            return None
        return float(self.step_costs(np.array([tokens], dtype=float), rows)[0])

    def step_costs(self, tokens: np.ndarray, rows: np.ndarray | float) -> np.ndarray:
        """Seconds of steps of ``tokens`` tokens in ``rows`` rows (zero
        before any step was measured): along the tokens of the measured
        range of rows nearest ``rows`` (the larger of two as near),
        interpolated, flat below its first point, on its last slope (over
        at least a doubling of the tokens) beyond its last, proportional
        beyond a lone point."""
        tokens, rows = np.broadcast_arrays(
            np.asarray(tokens, dtype=float), np.asarray(rows, dtype=float)
        )
        costs = np.zeros(tokens.shape)
        if not self.curve:
            return costs
        ranges = self._by_rows
        keys = list(ranges)  # increasing
        measured = np.log2(np.array(keys, dtype=float))
        # Each step's range of rows, then the measured range nearest it (the
        # larger of two as near): a few ranges whatever the rows asked (a
        # plan asks up to one count a session), each priced in one pass.
        own, index = np.unique(_ranges_of(rows), return_inverse=True)
        distance = np.abs(measured[None, :] - np.log2(own)[:, None])
        nearest = len(keys) - 1 - np.argmin(distance[:, ::-1], axis=1)
        step_range = nearest[index.reshape(rows.shape)]
        for i in np.unique(nearest):
            at = step_range == i
            costs[at] = _along_tokens(*ranges[keys[i]], tokens[at])
        return costs

    def decode_costs(self, rows: np.ndarray) -> np.ndarray:
        """Seconds of decode steps of ``rows`` rows of one token each (zero
        before any step was measured): along the points of such steps (a
        draft's proposals), whatever their rows; where there are none,
        :meth:`step_costs` of as many tokens."""
        rows = np.asarray(rows, dtype=float)
        if self._decode is None:
            return self.step_costs(rows, rows)
        return _along_tokens(*self._decode, rows)

    def decode_cost(self, rows: float) -> float | None:
        """Seconds of a decode step of ``rows`` rows, a token a row, along
        the decode steps' points — where one of them is in the range of
        ``rows``; else None (the points of a range of rows mix decode steps
        with verifies, dearer by their drafts)."""
        if self._decode is None or _range_of(rows) not in {_range_of(t) for t in self._decode[0]}:
            return None
        return float(self.decode_costs(np.array([float(rows)]))[0])

    @cached_property
    def _by_rows(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The surface's points by range of rows (increasing), each range's
        tokens and seconds by increasing tokens."""
        ranges: dict[int, list[Point]] = {}
        for point in self.curve:
            ranges.setdefault(_range_of(point[0]), []).append(point)
        return {key: _tokens_and_seconds(ranges[key]) for key in sorted(ranges)}

    @cached_property
    def _decode(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The tokens and seconds of the decode steps' points (a token a row)."""
        decode = [point for point in self.curve if _is_decode(point)]
        return _tokens_and_seconds(decode) if decode else None


def _is_decode(point: Point) -> bool:
    """Whether a point is of decode steps, a token a row."""
    return point[1] < DECODE_TOKENS_PER_ROW * point[0]


def _tokens_and_seconds(points: list[Point]) -> tuple[np.ndarray, np.ndarray]:
    """The tokens and seconds of ``points``, by increasing tokens."""
    ordered = sorted(points, key=lambda point: point[1])
    return np.array([p[1] for p in ordered]), np.array([p[2] for p in ordered])


def _along_tokens(xs: np.ndarray, ys: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The seconds at ``tokens`` of a range's points, tokens ``xs`` (increasing)
    and seconds ``ys``."""
    if len(xs) == 1:
        return np.where(tokens <= xs[0], ys[0], ys[0] * tokens / xs[0])
    # The last slope, over at least a doubling of the tokens: two points a
    # few tokens apart (two ranges' medians) would make noise a slope.
    base = np.flatnonzero(xs <= xs[-1] / 2)
    i = int(base[-1]) if len(base) else 0
    slope = max(0.0, (ys[-1] - ys[i]) / (xs[-1] - xs[i]))
    return np.where(tokens <= xs[-1], np.interp(tokens, xs, ys), ys[-1] + slope * (tokens - xs[-1]))


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
        self._buckets: dict[tuple[int, int], deque[Point]] = {}
        """Power-of-two ranges of rows and tokens → their last steps."""
        self._points: dict[tuple[int, int], Point] = {}
        """Power-of-two ranges of rows and tokens → their point of the surface."""
        self._measured_at: dict[tuple[int, int], int] = {}
        """Power-of-two ranges of rows and tokens → the step that last measured them."""
        self._recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)
        """The last steps' rows and tokens."""
        self._work: deque[float] = deque(maxlen=WINDOW)
        """The last steps' work per row (:attr:`EngineLoad.work_per_row_s`)."""
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

    def stepped(self, *, rows: int, tokens: int, seconds: float, work_s: float = 0.0) -> None:
        """A step ended: ``rows`` rows of ``tokens`` tokens took ``seconds``,
        after ``work_s`` of the engine's own work since the step before."""
        self._began_at = None
        key = (_range_of(rows), _range_of(tokens))
        bucket = self._buckets.setdefault(key, deque(maxlen=WINDOW))
        bucket.append((rows, tokens, seconds))
        self._points[key] = _median(bucket)
        self._measured_at[key] = self._steps
        self._recent.append((rows, tokens))
        self._work.append(work_s / max(1, rows))
        self._steps += 1
        curve = tuple(sorted(_consistent(self._points, self._measured_at)))
        rows_per_step = statistics.median(r for r, _ in self._recent)
        tokens_per_step = statistics.median(t for _, t in self._recent)
        self._snapshot = EngineLoad(
            curve,
            tokens_per_step,
            rows_per_step,
            self._steps,
            work_per_row_s=statistics.median(self._work),
        )


def _consistent(
    points: dict[tuple[int, int], Point], measured_at: dict[tuple[int, int], int]
) -> list[Point]:
    """The surface's points less those a fresher one contradicts: in a range
    of rows a step of more tokens never costs less, nor a step of a token a
    row of more rows. Where two points disagree, the one measured longer
    ago goes: a range no step has come back to since the machine or the
    load changed. Kept, it prices the steps between the two wrongly — a
    decode point that held a batch's first, slow steps while every session
    drafted sat above the verifies of more tokens since, and K = 0 looked
    dearer than drafting."""
    by_rows: dict[int, list[tuple[int, int]]] = {}
    for key in points:
        by_rows.setdefault(key[0], []).append(key)
    stale: set[tuple[int, int]] = set()
    for keys in by_rows.values():  # along the tokens
        by_tokens = sorted(keys, key=lambda k: points[k][1])
        stale |= _older_of_disagreeing(by_tokens, points, measured_at)
    decode = sorted((key for key in points if _is_decode(points[key])), key=lambda k: points[k][0])
    stale |= _older_of_disagreeing(decode, points, measured_at)  # along the rows
    return [point for key, point in points.items() if key not in stale]


def _older_of_disagreeing(
    ordered: list[tuple[int, int]],
    points: dict[tuple[int, int], Point],
    measured_at: dict[tuple[int, int], int],
) -> set[tuple[int, int]]:
    """Of ``ordered`` (by the size of their steps), those that cost more than
    a later, fresher one, or less than an earlier, fresher one."""
    stale: set[tuple[int, int]] = set()
    kept: list[tuple[int, int]] = []
    for key in ordered:
        while kept and points[kept[-1]][2] > points[key][2]:
            if measured_at[kept[-1]] > measured_at[key]:
                stale.add(key)
                break
            stale.add(kept.pop())
        else:
            kept.append(key)
    return stale


def _range_of(count: float) -> int:
    """The power of two at or above ``count``."""
    return 1 << max(0, math.ceil(count) - 1).bit_length()


def _ranges_of(counts: np.ndarray) -> np.ndarray:
    """:func:`_range_of` of each of ``counts``."""
    whole = np.maximum(np.ceil(counts), 1.0)
    return np.exp2(np.ceil(np.log2(whole))).astype(np.int64)


def _median(steps: deque[Point]) -> Point:
    """A range's point of the surface: its steps' median rows, tokens and seconds."""
    rows, tokens, seconds = zip(*steps, strict=True)
    return (
        float(statistics.median(rows)),
        float(statistics.median(tokens)),
        statistics.median(seconds),
    )
