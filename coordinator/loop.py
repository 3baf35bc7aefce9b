"""The speculative round loop.

Each round: the draft proposes K tokens after the committed history, the
target scores them in one forward pass and returns how many it accepts plus
its recovered or bonus token, and the coordinator commits those tokens,
checks the stop conditions token by token, and streams the new text.

Pipelined (DESIGN §5), the draft drafts round i + 1 while the target
verifies round i, assuming round i commits its drafts and the draft's guess
of the bonus token; when the verdict matches, round i + 1 starts with its
drafts in hand, otherwise it drafts afresh. The target only ever verifies
drafts made in the committed context, so the output is the same.

The coordinator's ``history`` is the source of truth; the workers' caches
follow it (the draft syncs on the next propose, the target commits the same
tokens itself and says so through the committed length of the next round).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from coordinator.policy import AdaptiveK, CostModel
from coordinator.recovery import DraftLink, TargetLink
from coordinator.workers import DraftClient, TargetClient, WorkerInfo
from outrider.detokenize import TextStream
from outrider.logging import get_logger
from outrider.sampling import SamplingParams

log = get_logger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, in token space."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    num_speculative_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    adaptive: bool = False
    """Choose K per round (up to num_speculative_tokens)."""
    sampling: SamplingParams = SamplingParams()
    request_id: str = ""
    pipeline: bool = False
    """Draft round i + 1 while the target verifies round i (DESIGN §5)."""


@dataclass
class Stats:
    """Per-request statistics, in vLLM's vocabulary."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    num_drafts: int = 0
    """Rounds that verified at least one draft token (vLLM's drafts)."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    rpc_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0
    num_speculative_tokens: int = 0
    seed: int = 0
    verification: str = "greedy"
    draft_probs_bytes: int = 0
    """Bytes of q relayed from draft to target (rejection mode)."""
    adaptive: bool = False
    pipeline: bool = False
    speculation_hits: int = 0
    """Pipelined rounds whose drafts were drafted while the previous round was verified."""
    speculation_misses: int = 0
    """Pipelined rounds whose speculation was discarded (the verdict differed from its assumption)."""
    overheads_s: list[float] = field(default_factory=list, repr=False)
    """Per round: wall time outside the workers' compute (RPC + coordinator)."""
    critical_path_overheads_s: list[float] = field(default_factory=list, repr=False)
    """Per round: wall time beyond the target's compute (what a round costs
    beyond the verify itself: waiting for drafts, RPCs, the coordinator)."""

    def record_round(
        self,
        draft_tokens: Sequence[int],
        draft_probs: Sequence,
        num_accepted: int,
        *,
        draft_s: float,
        verify_s: float,
        overhead_s: float,
    ) -> None:
        self.rounds += 1
        self.num_drafts += bool(draft_tokens)
        self.draft_tokens += len(draft_tokens)
        self.accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        self.draft_probs_bytes += sum(q.nbytes for q in draft_probs)
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s
        self.rpc_time_s += overhead_s
        self.overheads_s.append(overhead_s)

    @property
    def overhead_s_p50(self) -> float:
        return statistics.median(self.overheads_s) if self.overheads_s else 0.0

    @property
    def critical_path_overhead_s_p50(self) -> float:
        return (
            statistics.median(self.critical_path_overheads_s)
            if self.critical_path_overheads_s
            else 0.0
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per round, the recovered or bonus token included."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class Delta:
    """What one round adds to the stream; the last one carries the outcome."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length"
    stats: Stats | None = None


@dataclass(frozen=True)
class Recovery:
    """How the loop rides out worker loss (``coordinator.recovery``)."""

    draft_deadline_s: float = 5.0
    """A draft answer later than this drops the round to K = 0."""
    draft_backoff_s: float = 0.5
    """First wait before a lost draft is reopened (doubling, up to 8 s)."""
    target_attempts: int = 6
    """Opens of a target session (with back-off) before a request fails."""
    verify_deadline_factor: float = 10.0
    verify_deadline_floor_s: float = 2.0
    """A verify with no verdict within max(floor, factor × its measured cost)
    reopens the session on another replica, like a lost one (a frozen
    target). Before any verify was measured, the session's prefill stands
    in for its cost. Opening a session is held to the same rule, from the
    measured prefill cost per token."""
    open_deadline_unmeasured_s: float = 60.0
    """How long an open may take while no prefill has been measured."""

    def verify_deadline_s(self, expected_s: float) -> float:
        return max(self.verify_deadline_floor_s, self.verify_deadline_factor * expected_s)

    def open_deadline_s(self, expected_s: float | None) -> float:
        return (
            self.open_deadline_unmeasured_s
            if expected_s is None
            else self.verify_deadline_s(expected_s)
        )


@dataclass(frozen=True)
class Models:
    """What the loop needs to know about the served models."""

    tokenizer: object
    eos_token_ids: frozenset[int]
    target: WorkerInfo


async def generate(
    request: GenerationRequest,
    models: Models,
    target: TargetClient,
    draft: DraftClient | None,
    costs: CostModel | None = None,
    recovery: Recovery = Recovery(),
) -> AsyncIterator[Delta]:
    started = time.perf_counter()
    costs = costs if costs is not None else CostModel()
    history = list(request.prompt_ids)
    max_len = min(len(history) + request.max_new_tokens, models.target.max_context)
    k_max = request.num_speculative_tokens if draft is not None else 0
    stats = Stats(
        prompt_tokens=len(history),
        accepted_per_position=[0] * k_max,
        num_speculative_tokens=k_max,
        seed=request.sampling.seed,
        verification=request.sampling.verification.value,
        adaptive=request.adaptive and k_max > 0,
        pipeline=request.pipeline and k_max > 0,
    )
    policy = AdaptiveK(k_max, costs, pipeline=stats.pipeline) if stats.adaptive else None
    stop_ids = request.stop_token_ids | (
        frozenset() if request.ignore_eos else models.eos_token_ids
    )
    text = TextStream(models.tokenizer, request.prompt_ids, request.stop)

    # 1. Open the target session: it prefills the prompt. The draft session
    #    opens at the first round that drafts.
    target_link = TargetLink(
        target,
        request_id=request.request_id,
        sampling=request.sampling,
        attempts=recovery.target_attempts,
        open_deadline_s=lambda tokens: recovery.open_deadline_s(costs.prefill_cost(tokens)),
    )
    draft_link = (
        DraftLink(
            draft,
            request_id=request.request_id,
            target=models.target,
            sampling=request.sampling,
            deadline_s=recovery.draft_deadline_s,
            backoff_s=recovery.draft_backoff_s,
        )
        if k_max > 0
        else None
    )
    prefill_s = await target_link.open(history)
    stats.verify_time_s += prefill_s
    costs.observe_prefill(len(history), prefill_s)

    def choose_k(history_len: int) -> int:
        # Never draft past the length limit: a round commits up to K + 1.
        room = max_len - history_len - 1
        return policy.choose(room) if policy else max(0, min(k_max, room))

    try:
        finish_reason = None
        while finish_reason is None:
            round_started = time.perf_counter()

            # 2. Draft. A pipelined round's drafts may be ready: drafted while
            #    the last round was verified, on the assumption that it would
            #    commit what it did (a hit). Otherwise sync the tokens
            #    committed since the last propose and propose up to k tokens
            #    (with q, when the draft sampled them). A lost draft proposes
            #    nothing: the round is target-only. Time spent opening a
            #    session (a prefill) is the draft's, but not what a round of
            #    K drafts costs, so the costs leave it out.
            proposal, hit, open_s = None, None, 0.0
            if draft_link is not None:
                proposal, hit = await draft_link.speculated(history)
                if hit is not None:
                    stats.speculation_hits += hit
                    stats.speculation_misses += not hit
                if proposal is None and (k := choose_k(len(history))) > 0:
                    proposal, open_s = await draft_link.propose(history, k)
            draft_tokens = proposal.draft_tokens if proposal else []
            draft_probs = proposal.draft_probs if proposal else []
            draft_s = proposal.compute_s if proposal else 0.0
            drafted_s = time.perf_counter() - round_started

            # 3. Verify all drafts in one target pass of len(drafts) + 1
            #    positions. Pipelined, the draft meanwhile drafts the next
            #    round as if these drafts were accepted whole — unless the
            #    round ends the stream if they are.
            if stats.pipeline:
                assumed_len = len(history) + len(draft_tokens) + 1
                if assumed_len < max_len and not stop_ids.intersection(draft_tokens):
                    if (k_next := choose_k(assumed_len)) > 0:
                        draft_link.speculate(history, draft_tokens, k_next)
            expected_s = costs.verify_cost(len(draft_tokens)) or prefill_s
            verdict, reopen_s = await target_link.verify(
                history, draft_tokens, draft_probs, recovery.verify_deadline_s(expected_s)
            )
            stats.verify_time_s += reopen_s

            # 4. Commit the accepted drafts and the recovered/bonus token;
            #    learn from the round. On the critical path the draft cost
            #    what the round waited for it: all of its compute when it
            #    drafted now, only what outlasted the last verify on a hit.
            committed = [*draft_tokens[: verdict.num_accepted], verdict.next_token]
            round_s = time.perf_counter() - round_started
            waited_s = min(drafted_s, draft_s) if hit else draft_s
            overhead_s = max(0.0, round_s - open_s - waited_s - verdict.compute_s - reopen_s)
            stats.critical_path_overheads_s.append(round_s - verdict.compute_s)
            stats.record_round(
                draft_tokens,
                draft_probs,
                verdict.num_accepted,
                draft_s=open_s + draft_s,
                verify_s=verdict.compute_s,
                overhead_s=overhead_s,
            )
            costs.observe(
                num_drafts=len(draft_tokens),
                draft_s=draft_s,
                draft_steps=len(draft_tokens) + bool(proposal and proposal.guess is not None),
                num_accepted=verdict.num_accepted,
                verify_s=verdict.compute_s,
                overhead_s=overhead_s,
                drafted=proposal is not None and not hit,
            )
            if policy:
                policy.observe(len(draft_tokens), verdict.num_accepted)

            # 5. Stop conditions, token by token: nothing after a stop is emitted.
            new_text, new_ids = [], []
            for token in committed:
                history.append(token)
                new_ids.append(token)
                new_text.append(text.add(token))
                if token in stop_ids or text.stopped is not None:
                    finish_reason = "stop"
                elif len(history) >= max_len:
                    finish_reason = "length"
                if finish_reason is not None:
                    break

            # 6. Stream.
            if finish_reason is not None and text.stopped is None:
                new_text.append(text.finish())
            if stats.rounds == 1:
                stats.time_to_first_token_s = time.perf_counter() - started
            stats.generated_tokens = len(history) - stats.prompt_tokens
            if finish_reason is None:
                yield Delta("".join(new_text), new_ids)
            else:
                stats.total_time_s = time.perf_counter() - started
                log.info(
                    "generation finished",
                    finish_reason=finish_reason,
                    generated_tokens=stats.generated_tokens,
                    rounds=stats.rounds,
                    mean_acceptance_length=round(stats.mean_acceptance_length, 3),
                )
                yield Delta("".join(new_text), new_ids, finish_reason, stats)
    finally:
        # 7. Close both sessions: the workers free their caches at once.
        await target_link.close()
        if draft_link is not None:
            await draft_link.close()


def eos_token_ids(tokenizer, generation_config) -> frozenset[int]:
    """End-of-sequence ids: the generation config's, plus the tokenizer's."""
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Sequence):
        ids.update(int(i) for i in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
