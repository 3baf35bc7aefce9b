"""What rounds cost, as adaptive K (:mod:`outrider.coordinator.adaptive`) prices
them: the target's and the draft's step costs by rows and tokens, which the
engines measure and report with every answer (``outrider.engine_load``), each
with the engine's own work between its forward passes; and what the
coordinator measures itself — its overhead per round, and the target's
prefill per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from outrider.engine_load import DECODE_TOKENS_PER_ROW, EngineLoad


class _Ema:
    """Exponential moving average that starts at its first sample."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.value: float | None = None

    def update(self, sample: float) -> None:
        if self.value is None:
            self.value = sample
        else:
            self.value = self.decay * self.value + (1 - self.decay) * sample


class _Floor:
    """The floor of a noisy sample: follows a lower sample quickly and a
    higher one slowly, so it settles near the low end of the samples."""

    DOWN, UP = 0.5, 0.02

    def __init__(self) -> None:
        self.value: float | None = None

    def update(self, sample: float) -> None:
        if self.value is None:
            self.value = sample
        else:
            self.value += (self.DOWN if sample < self.value else self.UP) * (sample - self.value)


@dataclass
class StepCosts:
    """What rounds cost on one target replica and its drafts: the engines'
    step curves and load as they last reported them, and what the
    coordinator measures itself."""

    decay: float = 0.9
    target: EngineLoad = field(default_factory=EngineLoad)
    """The target engine's curve and load, from its latest answer (the
    round loop keeps it current)."""
    draft: EngineLoad | None = None
    """The draft engine's; None for prompt lookup (or before any answer)."""
    draft_per_token: _Ema = field(init=False)
    """Draft compute per drafted token, where the draft reports no curve."""
    prefill_per_token: _Ema = field(init=False)
    draft_prefill_per_token: _Ema = field(init=False)
    """A draft model's prefill, measured by the draft at each open: its
    steps of a token a row say little of it (a 4-bit CPU kernel took 7.7 ms
    a token to prefill 160 tokens, four times the float32 target's)."""
    overhead: dict[bool, _Floor] = field(init=False)
    """Keyed by whether the round waited for a draft RPC (two RPCs or one).
    Its floor: under load a round's overhead also holds the time its calls
    waited behind other sessions' steps, which is those sessions' work —
    already priced in the step costs — not a cost of this round that more
    drafts would spread."""

    def __post_init__(self) -> None:
        self.draft_per_token = _Ema(self.decay)
        self.prefill_per_token = _Ema(self.decay)
        self.draft_prefill_per_token = _Ema(self.decay)
        self.overhead = {False: _Floor(), True: _Floor()}

    def observe(
        self,
        *,
        num_drafts: int,
        draft_s: float,
        overhead_s: float,
        drafted: bool,
        draft_steps: int | None = None,
    ) -> None:
        """One round: ``draft_steps`` (default ``num_drafts``) draft steps
        took ``draft_s``, and its overhead was ``overhead_s``."""
        steps = num_drafts if draft_steps is None else draft_steps
        if steps:
            self.draft_per_token.update(draft_s / steps)
        self.overhead[drafted].update(overhead_s)

    def draft_answered(self, load: EngineLoad | None) -> None:
        """The draft answered a round, with its costs and load if it reports them."""
        if load is not None:
            self.draft = load

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A target session opened on ``tokens`` tokens in ``seconds``."""
        self.prefill_per_token.update(seconds / max(1, tokens))

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        """A draft session opened on ``tokens`` tokens in ``seconds``."""
        self.draft_prefill_per_token.update(seconds / max(1, tokens))

    def draft_prefill_cost(self, tokens: int) -> float:
        """What opening a draft session on ``tokens`` tokens should cost: the
        dearer of what the opens took a token and the draft's step surface."""
        surface = self.draft.step_cost(tokens, rows=1) if self.draft else None
        per_token = self.draft_prefill_per_token.value
        return max(surface or 0.0, (per_token or 0.0) * tokens)

    @property
    def measured(self) -> bool:
        """Whether the target's step cost is known (a round has run)."""
        return bool(self.target.curve)

    @property
    def draft_measured(self) -> bool:
        """Whether a draft step's cost is known (a round has drafted)."""
        return bool(self.draft and self.draft.curve) or self.draft_per_token.value is not None

    def prefill_cost(self, tokens: int) -> float | None:
        """What opening a target session on ``tokens`` tokens should cost."""
        per_token = self.prefill_per_token.value
        return None if per_token is None else per_token * tokens

    def verify_cost(self, k: int) -> float | None:
        """What a verify of K drafts should take now: a step at the current
        load, and the engine's work on the step's rows around it."""
        if not self.measured:
            return None
        load = self.target
        rows = max(load.rows_per_step, 1.0)
        step = load.step_cost(max(load.tokens_per_step, 1.0) + k, rows)
        assert step is not None  # (measured)
        return step + load.work_per_row_s * rows

    def rpc_cost(self, drafted: bool) -> float:
        """o: a round's overhead with two RPCs on its critical path (``drafted``) or one."""
        overhead = self.overhead[drafted].value
        if overhead is None:
            overhead = self.overhead[not drafted].value or 0.0
        return overhead

    def best_rate_alone(self, gains: np.ndarray, *, drafted: bool) -> float:
        """The most tokens a second a session alone makes with a prefix of
        drafts that add ``gains`` to its round (S(j) of each; the empty
        prefix too: K = 0), ``drafted`` by the draft model a step each, or
        looked up for nothing — or, before the target's steps are measured,
        the most tokens a round. A round of K costs
        o + K·(d(1) + w_d) + c(K + 1; 1) + w (:mod:`outrider.coordinator.adaptive.planner`)."""
        k = np.arange(len(gains) + 1.0)
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(gains)])
        if not self.measured:
            return float(tokens.max())
        cost = self.target.step_costs(k + 1.0, 1.0) + self.target.work_per_row_s
        cost = cost + np.where(k > 0, self.rpc_cost(drafted), self.rpc_cost(False))
        if drafted:
            cost = cost + k * float(self.draft_step_costs(np.array([1.0]))[0])
        return float((tokens / np.maximum(cost, 1e-9)).max())

    def draft_step_costs(self, rows: np.ndarray) -> np.ndarray:
        """d(n) of draft steps of ``rows`` rows (0 rows: no step), the draft
        engine's work on the rows around each included: along its steps of a
        token a row, but no dearer than a step of as many tokens in the rows
        measured nearest. Where its steps of a token a row were measured at
        fewer rows only, their curve runs on proportionally from a lone
        point, or on the slope of a step slowed by something else — far
        above what the draft's steps of more rows took
        (docs/design.md#speculation-under-load)."""
        rows = np.asarray(rows, dtype=float)
        if self.draft is not None and self.draft.curve:
            stepping = np.maximum(rows, 1.0)
            decode = np.minimum(
                self.draft.decode_costs(stepping), self.draft.step_costs(stepping, stepping)
            )
            costs = decode + self.draft.work_per_row_s * stepping
        else:
            costs = np.full_like(rows, self.draft_per_token.value or 0.0)
        return np.where(rows > 0, costs, 0.0)

    def verify_costs(self, tokens: float, rows: float, most: int) -> np.ndarray:
        """What the target's step of ``tokens`` tokens in ``rows`` rows costs
        with 0 .. ``most`` drafts more in it."""
        steps = self.target.step_costs(tokens + np.arange(most + 1.0), rows)
        if tokens < DECODE_TOKENS_PER_ROW * rows:
            # No drafts: a decode step, a token a row.
            if (decode := self.target.decode_cost(rows)) is not None:
                steps[0] = decode
        # Every row of the step waits for the engine's work on all of them.
        return np.maximum.accumulate(steps) + self.target.work_per_row_s * rows
