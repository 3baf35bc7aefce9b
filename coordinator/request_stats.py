"""What a request's rounds cost and accepted: one round's record
(:class:`RoundRecord`) and the request's statistics (:class:`Stats`), in
vLLM's vocabulary (``outrider.target_worker.verify``: draft, accepted, recovered and bonus
tokens)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from outrider.speculation import Proposal, Verdict


@dataclass
class RoundRecord:
    """One round: the K it asked for, and where its wall time went."""

    k: int = 0
    """The draft tokens the round asked for (0: target-only)."""
    started: float = field(default_factory=time.perf_counter)
    open_s: float = 0.0
    """Opening the draft session (its prefill), when this round did."""
    draft_s: float = 0.0
    """The draft worker's compute for this round's drafts."""
    drafted_s: float = 0.0
    """Wall time until the drafts were in hand."""
    reopen_s: float = 0.0
    """Prefilling a target session reopened after a loss."""
    verify_s: float = 0.0
    """The target worker's compute for the verdict."""
    queued_s: float = 0.0
    """How long the verify waited at the target for its engine to take it:
    behind the rest of a step of other sessions under way — their work,
    priced in the step costs, not this round's overhead."""
    round_s: float = 0.0
    hit: bool | None = None
    """Pipelined: whether the drafts were drafted during the last verify."""

    def drafted(self) -> None:
        self.drafted_s = time.perf_counter() - self.started

    def ended(self) -> None:
        self.round_s = time.perf_counter() - self.started

    @property
    def waited_for_draft_s(self) -> float:
        """What the round waited for its drafts' compute: all of it when they
        were drafted now, only what outlasted the last verify on a hit."""
        return min(self.drafted_s, self.draft_s) if self.hit else self.draft_s

    @property
    def overhead_s(self) -> float:
        """Wall time outside the workers' compute and the other sessions'
        work — the steps the verify waited behind — priced as such: RPCs and
        the coordinator."""
        compute = self.open_s + self.waited_for_draft_s + self.verify_s + self.reopen_s
        return max(0.0, self.round_s - compute - self.queued_s)

    @property
    def critical_path_s(self) -> float:
        """Wall time beyond the target's verify — its compute and its wait
        behind other sessions' steps, as :attr:`Stats.verify_time_s` counts
        it: waiting for drafts, RPCs, the coordinator."""
        return self.round_s - self.verify_s - self.queued_s


@dataclass
class Stats:
    """Per-request statistics. They describe the tokens the client got: a
    round cut short by a stop counts only the positions before the cut."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Of those, the tokens the target found in its prefix cache (at the first open)."""
    generated_tokens: int = 0
    rounds: int = 0
    num_drafts: int = 0
    """Rounds that verified at least one draft token (vLLM's drafts)."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    overhead_time_s: float = 0.0
    """Wall time outside the workers' compute (RPCs and the coordinator)."""
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
    """Pipelined rounds whose speculation was discarded (the verdict differed
    from its assumption)."""
    rounds_by_k: list[int] = field(default_factory=list)
    """``rounds_by_k[K]``: rounds that asked for K drafts."""
    proposed_tokens: int = 0
    """Draft tokens proposed (``draft_tokens`` counts those verified)."""
    overheads_s: list[float] = field(default_factory=list, repr=False)
    """Per round: :attr:`RoundRecord.overhead_s`."""
    critical_path_overheads_s: list[float] = field(default_factory=list, repr=False)
    """Per round: :attr:`RoundRecord.critical_path_s`."""

    def record_round(
        self,
        proposal: Proposal | None,
        verdict: Verdict,
        times: RoundRecord,
        *,
        streamed: int,
        verified: int | None = None,
    ) -> None:
        """One round that streamed ``streamed`` tokens: its accepted drafts
        and the recovered or bonus token, unless a stop cut it inside the
        accepted drafts, when only the drafts before the cut count. The
        target verified ``verified`` of the proposal's drafts (None: all)."""
        drafts = proposal.tokens if proposal else []
        accepted = verdict.num_accepted
        judged = len(drafts) if verified is None else verified
        if streamed <= accepted:  # cut inside the accepted drafts
            accepted = judged = streamed
        self.rounds += 1
        self.generated_tokens += streamed
        self.proposed_tokens += len(drafts)
        if times.k >= len(self.rounds_by_k):
            self.rounds_by_k.extend([0] * (times.k + 1 - len(self.rounds_by_k)))
        self.rounds_by_k[times.k] += 1
        self.num_drafts += bool(judged)
        self.draft_tokens += judged
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        self.draft_probs_bytes += sum(q.nbytes for q in proposal.probs) if proposal else 0
        self.draft_time_s += times.open_s + times.draft_s
        self.verify_time_s += times.verify_s + times.queued_s
        self.overhead_time_s += times.overhead_s
        self.overheads_s.append(times.overhead_s)
        self.critical_path_overheads_s.append(times.critical_path_s)

    @property
    def overhead_s_p50(self) -> float:
        return statistics.median(self.overheads_s) if self.overheads_s else 0.0

    @property
    def critical_path_overhead_s_p50(self) -> float:
        paths = self.critical_path_overheads_s
        return statistics.median(paths) if paths else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens the client got per round: the accepted drafts plus the
        recovered or bonus token (fewer in a round a stop cut short)."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
