"""What rounds cost and what an assignment of K to the sessions commits: the
cost model of adaptive K (:mod:`coordinator.policy`), which plans every
session's K together for the deployment's goodput — committed tokens per
second across all sessions — with each request's latency as the tie-break
(docs/design.md#speculation-under-load).

With per-token acceptance α and K drafts, a round commits

    E(K) = (1 − α^(K+1)) / (1 − α)          (E = K + 1 when α = 1)

tokens (Leviathan et al. 2023); its j-th draft adds α^j of them — in
general S(j), the chance that it and every draft before it are accepted,
which for drafts copied from the history (prompt lookup) is measured depth
by depth: they come in runs, the first often rejected and the fourth
almost never once the third was (:mod:`coordinator.acceptance`). Sessions
share steps: the target verifies every session's round in one forward pass
of T = Σ (K_i + 1) tokens in R rows (one a session), which costs c(T; R);
the draft drafts in steps of every session drafting, n_j rows of a token
at the j-th draft of a round, each costing d(n_j). Both costs are measured
by the engines themselves, by rows and tokens, and reported with every
answer (``outrider.load``), each with the engine's own work between its
forward passes (answering, starting and scheduling calls), w a row for the
target and w_d for the draft, which every row of a step waits for: w·R of
a target step, whatever the K in it, is most of a round where a step is a
few milliseconds of GPU time and tens of rows. The coordinator adds its
overhead o (RPCs and its own loop, measured per round). So a round costs

    C = o + Σ_j (d(n_j) + w_d·n_j) + c(T; R) + w·R

and the goodput of an assignment of K_i to the sessions is

    G = Σ_i E_i(K_i) / C.

:class:`CostModel.plan` maximises G over the coordinator's adaptive
sessions on one target replica (:class:`CostModels`), the others in the
engines' steps held as the engines last saw them. A session's tokens are
worth the most in order (S_i(1) ≥ S_i(2) ≥ …), so the drafts of every
session are sorted by what each adds, S_i(j), and the best assignment is
the best prefix of that order: its cost is a sum of increments along it (a
token, a draft row, or a new draft step), so every prefix is priced in one
pass. A draft token is drafted while its S_i(j) beats what it adds to
everyone's round. On a GPU c is nearly flat up to a few hundred tokens, so
drafting is almost free at low load and K shrinks as T grows; on a CPU c
is linear from the first token, so under load drafting pays only where α
is high and drafts are cheap — K = 0 when it does not pay at all. A
session alone is priced exactly as E(K) / (o + K·(d(1) + w_d) + c(K + 1; 1)
+ w), its own best rate. Among assignments of the same goodput (within
:data:`TIE`), the shortest round wins: every session gets its tokens
soonest.

Pipelined (docs/design.md#pipelined-rounds), the draft drafts the next
round — K + 1 steps, its guess of the bonus token first — while the target
verifies this one, so a round whose speculation holds (probability
α^(K+1)) costs o₁ + max(c(T), D(K + 1)), and a miss first drafts afresh:

    C_p = o₁ + max(c(T), D_spec) + miss · (D + o₂ − o₁)

with miss the sessions' mean chance of a miss.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from coordinator.acceptance import Acceptance
from outrider.load import DECODE_TOKENS_PER_ROW, WINDOW, EngineLoad
from outrider.logging import get_logger

if TYPE_CHECKING:
    from coordinator.policy import AdaptiveK

log = get_logger(__name__)

TIE = 0.01
"""Goodputs this close count as equal; then latency decides."""
DRAFT_STALE_S = 10.0
"""Seconds without a draft answer after which a session alone measures
the draft's costs again (:meth:`CostModel.explores`)."""
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
up to 10% from minute to minute on a shared machine, the plan prices K = 0
and drafting from different steps, and the others' rounds, waits and
drafts are theirs. A draft opens only where it pays at the end of this
error that favours K = 0, in proportion to the share of the others in the
steps — none for a session alone, whose plan met its rounds: where
drafting gains a few percent, the prefill of a draft that gains nothing
is a loss, and sessions that draft slow those beside them that do not
(docs/design.md#adaptive-k)."""


def expected_tokens(alpha: float, k: float) -> float:
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
        if self.value is None:
            self.value = sample
        else:
            self.value = self.decay * self.value + (1 - self.decay) * sample


class _Median:
    """The median of the last :data:`WINDOW` samples. A rare sample far off
    the others (a round whose draft ran a shape's first, eager, step, many
    times its usual drafts) says nothing of the rounds to come, and a mean
    would carry it for dozens of rounds — for ever, where the price it sets
    stops the drafting whose samples would replace it."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)

    def update(self, sample: float) -> None:
        self.samples.append(sample)

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


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


@dataclass(frozen=True)
class Plan:
    """K for each adaptive session, and what the assignment is worth."""

    ks: dict[int, int]
    """``id`` of each session's :class:`AdaptiveK` → its K."""
    goodput: float
    """Tokens per second of the whole step (its own sessions and the others)."""
    price: float
    """What one more draft token would have to add (its S(j)) to pay for itself."""
    target_only: float
    """The goodput with every one of these sessions at K = 0."""


@dataclass
class CostModel:
    """What rounds cost and what they commit, shared by a coordinator's
    sessions on one target replica: the engines' step curves and load as
    they last reported them, and what the coordinator measures itself (its
    overhead; the deployment's acceptance, shared with the other replicas'
    models). It plans the K of its adaptive sessions together."""

    decay: float = 0.9
    planning_share: float = PLANNING_SHARE
    """The most of the coordinator's time planning may take (inf: plan
    whenever the load or the sessions changed)."""
    target: EngineLoad = field(default_factory=EngineLoad)
    """The target engine's curve and load, from its latest answer (the
    round loop keeps it current)."""
    draft: EngineLoad | None = None
    """The draft engine's; None for prompt lookup (or before any answer)."""
    draft_at: float = field(init=False, default_factory=time.perf_counter)
    """When the draft last answered (:meth:`draft_answered`)."""
    draft_per_token: _Ema = field(init=False)
    """Draft compute per drafted token, where the draft reports no curve."""
    draft_extra: _Median = field(init=False)
    """What a round's drafts took beyond their steps' prices on the draft's
    curve: its first step feeds the tokens the last round committed that
    the draft has not seen — two, the last draft and the bonus token, where
    every draft was accepted — and a round of one draft pays it as one of K
    does. Priced as a fixed cost of a drafting round."""
    prefill_per_token: _Ema = field(init=False)
    overhead: dict[bool, _Floor] = field(init=False)
    """Keyed by whether the round waited for a draft RPC (two RPCs or one).
    Its floor: under load a round's overhead also holds the time its calls
    waited behind other sessions' steps, which is those sessions' work —
    already priced in the step costs — not a cost of this round that more
    drafts would spread."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """What the drafts had accepted: the models', the same on every replica
    (:class:`CostModels` shares it)."""
    sessions: dict[int, AdaptiveK] = field(init=False, default_factory=dict)
    """The adaptive sessions running now, planned together."""
    _version: int = field(init=False, default=0)
    """Counts the joins, leaves and offers: a plan is for one set of
    sessions, each with what its drafter offers (:meth:`changed`)."""
    _plan: Plan | None = field(init=False, default=None)
    _planned_at: tuple[int, int] = field(init=False, default=(-1, -1))
    _planned_time: float = field(init=False, default=0.0)
    _planning_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.draft_per_token = _Ema(self.decay)
        self.draft_extra = _Median()
        self.prefill_per_token = _Ema(self.decay)
        self.overhead = {False: _Floor(), True: _Floor()}

    # --- learning --------------------------------------------------------------

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
        """One round: ``draft_steps`` (default ``num_drafts``) draft steps
        took ``draft_s``; the target accepted ``num_accepted`` of ``num_drafts``
        (drafted on ``evidence``, if the drafter has any: :meth:`Acceptance.observe`)."""
        if num_drafts and num_accepted is not None:
            self.acceptance.observe(num_drafts, num_accepted, evidence)
        steps = num_drafts if draft_steps is None else draft_steps
        if steps:
            self.draft_per_token.update(draft_s / steps)
            if drafted and self.draft is not None and self.draft.curve:
                rows = max(1.0, self.draft.rows_per_step)
                priced = steps * float(self.draft_step_costs(np.array([rows]))[0])
                self.draft_extra.update(max(0.0, draft_s - priced))
        self.overhead[drafted].update(overhead_s)

    def draft_answered(self, load: EngineLoad | None) -> None:
        """The draft answered a round, with its costs and load if it reports them."""
        if load is not None:
            self.draft = load
        self.draft_at = time.perf_counter()

    @property
    def explores(self) -> bool:
        """Whether the session alone is to measure the draft's costs again, as
        though they were unknown: no draft has answered for
        :data:`DRAFT_STALE_S` (every session at K = 0 or target-only), so
        its curve is of steps run then — maybe while something else held the
        cores — and no answer would ever correct it. Only a session alone
        in the target's steps does: under load a round of many drafts beside
        target-only sessions would hold their steps (or, on shared cores,
        overlap them), and there drafting rarely pays."""
        return (
            self.draft is not None
            and bool(self.draft.curve)
            and time.perf_counter() - self.draft_at >= DRAFT_STALE_S
            and self.alone
        )

    @property
    def alone(self) -> bool:
        """Whether one adaptive session runs, alone in the target's steps."""
        return len(self.sessions) <= 1 and self.target.rows_per_step <= 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A target session opened on ``tokens`` tokens in ``seconds``."""
        self.prefill_per_token.update(seconds / max(1, tokens))

    # --- costs -----------------------------------------------------------------

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

    def draft_prefill_pays(
        self, tokens: int, tokens_left: int, *, beside: bool = False, others_draft: bool = False
    ) -> bool:
        """Whether a draft session opened now on ``tokens`` tokens repays its
        prefill, which the round that first drafts waits for (and, where the
        draft shares the target's cores, every session) — what of it outlasts
        the target's prefill where it runs ``beside`` it: the ``tokens_left``
        tokens still to come, made at the plan's goodput G rather than at
        K = 0's G₀, must save more than the prefill costs — each goodput
        taken at the end of its error that favours the other, since an open
        draft is not undone: ε = :data:`PLAN_ERROR` · (1 − 1/R) with R the
        rows of the target's steps (these sessions' at least),

            tokens_left · (1/(G₀(1 + ε)) − 1/(G(1 − ε))) > d(prefill).

        Where the draft shares the target's cores and ``others_draft`` (in
        the coordinator's lockstep), a session without a draft has no round
        that costs the deployment only its row: it waits in the others'
        phases, a token a phase, or its steps run beside their drafts,
        slowing both. There the prefill is the price of joining them, and
        the draft opens wherever drafting pays at the end of the error,
        G(1 − ε) > G₀(1 + ε).

        A session whose draft never opened does not probe it either: its
        acceptance is the deployment's. True before the draft's steps are
        measured, and where the session alone is to measure them again
        (:attr:`explores`): an open teaches them."""
        if self.draft is None or not self.draft.curve or self.explores:
            return True
        plan = self.plan()
        if plan.goodput <= plan.target_only or plan.target_only <= 0:
            return False
        error = PLAN_ERROR * (1 - 1 / max(1.0, self.target.rows_per_step, len(self.sessions)))
        worst_target_only = plan.target_only * (1 + error)
        worst_goodput = plan.goodput * (1 - error)
        if others_draft:
            return worst_goodput > worst_target_only
        prefill = self.draft.step_cost(tokens, rows=1) or 0.0
        if beside:
            prefill = max(0.0, prefill - (self.prefill_cost(tokens) or 0.0))
        saved = tokens_left * (1 / worst_target_only - 1 / worst_goodput)
        log.debug(
            "draft prefill priced",
            saved_ms=round(saved * 1e3, 1),
            prefill_ms=round(prefill * 1e3, 1),
            goodput=round(plan.goodput, 1),
            target_only=round(plan.target_only, 1),
        )
        return saved > prefill

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

    # --- planning --------------------------------------------------------------

    def join(self, session: AdaptiveK) -> None:
        self.sessions[id(session)] = session
        self._version += 1

    def leave(self, session: AdaptiveK) -> None:
        if self.sessions.pop(id(session), None) is not None:
            self._version += 1

    def changed(self) -> None:
        """A session's offer changed (:meth:`coordinator.policy.AdaptiveK.offer`)."""
        self._version += 1

    def plan(self) -> Plan:
        """The K of every adaptive session that maximises the goodput (see
        the module docstring), recomputed after a target step or when the
        sessions change — but taking at most ``planning_share`` of the time
        (a session the plan does not know yet drafts nothing)."""
        stamp = (self.target.steps, self._version)
        now = time.perf_counter()
        due = now - self._planned_time >= self._planning_s / self.planning_share
        if self._plan is None or (stamp != self._planned_at and due):
            self._plan = self._best_plan(list(self.sessions.values()))
            self._planned_at, self._planned_time = stamp, now
            self._planning_s = time.perf_counter() - now
        return self._plan

    def _best_plan(self, sessions: list[AdaptiveK]) -> Plan:
        n = len(sessions)
        if n == 0:
            return Plan({}, 0.0, 1.0, 0.0)
        alphas = np.array([s.alpha for s in sessions])
        k_max = np.array([s.k_most for s in sessions])

        # The others in the target's steps: its load less these sessions'
        # share, a row each (of one token for a session yet to verify: what
        # its prefill adds to the load is no round's).
        shares = [s.k_last or 0 for s in sessions]
        rows = max(0.0, self.target.rows_per_step - n)
        tokens = max(0.0, self.target.tokens_per_step - sum(k + 1 for k in shares))
        if rows < 0.5:
            rows = tokens = 0.0
        drafting_now = sum(1 for k in shares if k)
        other_drafting = max(0.0, (self.draft.rows_per_step if self.draft else 0.0) - drafting_now)
        other_depth = tokens / rows - 1.0 if rows else 0.0  # their drafts per round
        # A round of theirs commits a token. Their tokens past a row's one
        # are priced but not credited: they may be another coordinator's
        # drafts, or as well this one's past in the engine's median step —
        # its sessions' earlier K, a prefill — which commits nothing now.
        base = _Base(
            committed=rows + n,
            rows=rows + n,
            tokens=tokens + n,
            sessions=n,
            pipelined=any(s.pipeline for s in sessions),
        )

        # Every draft token of every session, best first: (session, depth, what
        # it adds to the tokens committed), and what it adds to the draft: a
        # row in the step at its depth, or a step of its own where there was none.
        owner = np.repeat(np.arange(n), k_max)
        depth = np.concatenate([np.arange(1, k + 1) for k in k_max]) if k_max.sum() else owner
        gain = np.concatenate([s.gains(k) for s, k in zip(sessions, k_max, strict=True)])
        order = np.lexsort((owner, depth, -gain))
        # (Less than TIE of a token each: the plan without them is as good.)
        order = order[gain[order] >= TIE]
        owner, depth, gain = owner[order], depth[order], gain[order]
        rows_before = np.where(depth <= other_depth, other_drafting, 0.0) + _rank_within(depth)
        draft_add = self.draft_step_costs(rows_before + 1) - self.draft_step_costs(rows_before)
        draft_add = np.maximum(draft_add, 0.0)  # a row never makes a step cheaper

        # A deep draft costs a draft step every session waits for, so the best
        # prefix is sought under every cap on the depth (K = cap for all is one):
        # the prefixes of the tokens each cap keeps, one row of the tables a cap.
        kept = depth[None, :] <= np.arange(int(depth.max(initial=0)) + 1)[:, None]
        goodput, cost = self._prefixes(base, kept, alphas, owner, depth, gain, draft_add)
        target_only = float(goodput[0, 0])  # every cap's first prefix: no drafts
        near = goodput >= goodput.max(axis=1, keepdims=True) * (1 - TIE)
        ends = np.argmin(np.where(near, cost, np.inf), axis=1)  # ties: the shortest round
        position = np.arange(len(owner))
        best: tuple[float, float, np.ndarray] | None = None
        for cap, end in enumerate(ends):
            rate, seconds = float(goodput[cap, end]), float(cost[cap, end])
            if (
                best is None
                or rate > best[0] * (1 + TIE)
                or (rate >= best[0] * (1 - TIE) and seconds < best[1])
            ):
                best = (rate, seconds, owner[kept[cap] & (position < end)])
        assert best is not None
        goodput_best, _, chosen = best
        ks = np.bincount(chosen, minlength=n)

        # What a first draft of a session now at K = 0 would have to add to pay
        # for itself: the goodput it would cost (a token in the step, a row in
        # the first draft step — or that step, where none drafts yet).
        drafting_first = other_drafting + int((ks > 0).sum())
        token = self.target.step_costs(
            np.array([base.tokens + ks.sum(), base.tokens + ks.sum() + 1]), base.rows
        )
        row = self.draft_step_costs(np.array([drafting_first, drafting_first + 1]))
        first_step = (self.draft_extra.value or 0.0) if drafting_first == 0 else 0.0
        added = max(0.0, np.diff(token)[0]) + max(0.0, np.diff(row)[0]) + first_step
        price = goodput_best * float(added)
        if log.is_enabled_for(logging.DEBUG):  # (its arguments are built only to be written)
            self._log_plan(ks, alphas, goodput_best, target_only, rows, tokens)
        ks_of = {id(s): int(k) for s, k in zip(sessions, ks, strict=True)}
        return Plan(ks_of, goodput_best, price, target_only)

    def _log_plan(
        self,
        ks: np.ndarray,
        alphas: np.ndarray,
        goodput: float,
        target_only: float,
        rows: float,
        tokens: float,
    ) -> None:
        log.debug(
            "plan",
            ks=ks.tolist(),
            alphas=[round(float(a), 3) for a in alphas],
            offers=[(s.evidence, s.offered) for s in self.sessions.values()],
            goodput=round(goodput, 1),
            target_only=round(target_only, 1),
            others=(round(rows, 1), round(tokens, 1)),
            target=[(r, t, round(s * 1e3, 1)) for r, t, s in self.target.curve],
            draft=[(r, t, round(s * 1e3, 1)) for r, t, s in self.draft.curve]
            if self.draft
            else None,
            overhead=(round(self.rpc_cost(False) * 1e3, 1), round(self.rpc_cost(True) * 1e3, 1)),
            draft_extra=round((self.draft_extra.value or 0.0) * 1e3, 1),
            work_per_row=(
                round(self.target.work_per_row_s * 1e3, 2),
                round(self.draft.work_per_row_s * 1e3, 2) if self.draft else None,
            ),
        )

    def _prefixes(
        self,
        base: _Base,
        kept: np.ndarray,
        alphas: np.ndarray,
        owner: np.ndarray,
        depth: np.ndarray,
        gain: np.ndarray,
        draft_add: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Goodput and round cost of every prefix of the tokens each cap keeps
        (a row of ``kept`` a cap): column 0 the empty prefix, column i + 1 the
        prefix that ends with token i (where the cap keeps it; elsewhere no
        goodput and no end)."""
        drafts = np.cumsum(kept, axis=1)
        committed = base.committed + np.cumsum(gain * kept, axis=1)
        drafting = np.cumsum(draft_add * kept, axis=1) + (self.draft_extra.value or 0.0)
        # A verify's cost depends only on how many drafts it holds.
        verify = self._verify_costs(base, len(gain))
        one_rpc, two_rpcs = self.rpc_cost(False), self.rpc_cost(True)
        if base.pipelined:
            # A speculation drafts one step more (the guess) beside the verify;
            # a miss drafts afresh first.
            guess = draft_add[0] if len(draft_add) else 0.0
            miss = np.cumsum(_miss_increments(alphas, owner, depth) * kept, axis=1) / base.sessions
            cost = (
                one_rpc
                + np.maximum(verify[drafts], drafting + guess)
                + miss * (drafting + two_rpcs - one_rpc)
            )
        else:
            cost = two_rpcs + drafting + verify[drafts]
        empty = np.full((len(kept), 1), one_rpc + verify[0])
        cost = np.concatenate([empty, np.where(kept, cost, np.inf)], axis=1)
        committed = np.concatenate([np.full_like(empty, base.committed), committed], axis=1)
        return committed / np.maximum(cost, 1e-9), cost

    def _verify_costs(self, base: _Base, most: int) -> np.ndarray:
        """What the target's step costs with 0 .. ``most`` drafts in it."""
        steps = self.target.step_costs(base.tokens + np.arange(most + 1.0), base.rows)
        if base.tokens < DECODE_TOKENS_PER_ROW * base.rows:
            # No drafts: a decode step, a token a row.
            if (decode := self.target.decode_cost(base.rows)) is not None:
                steps[0] = decode
        # Every row of the step waits for the engine's work on all of them.
        return np.maximum.accumulate(steps) + self.target.work_per_row_s * base.rows


class CostModels:
    """A coordinator's cost models, one for each target replica its sessions
    run on: sessions share steps only with those on the same engine, and
    each engine reports its own costs and load. What the drafts had
    accepted is shared (:class:`coordinator.acceptance.Acceptance`). The
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


@dataclass(frozen=True)
class _Base:
    """What every assignment has: the others' and these sessions' K = 0 rounds."""

    committed: float
    rows: float
    tokens: float
    sessions: int
    pipelined: bool


def _rank_within(groups: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements share its group."""
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    counts = np.diff(np.r_[starts, len(groups)])
    ranks = np.empty(len(groups), dtype=float)
    ranks[order] = np.arange(len(groups)) - np.repeat(starts, counts)
    return ranks


def _miss_increments(alphas: np.ndarray, owner: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """What each token adds to the sessions' summed chance that a speculation
    misses (1 − α^(K+1) for a session drafting K > 0, none for one that
    does not): its session's chance at its depth less that at the depth before."""
    before = np.where(depth > 1, 1.0 - alphas[owner] ** depth, 0.0)
    after = 1.0 - alphas[owner] ** (depth + 1)
    return after - before
