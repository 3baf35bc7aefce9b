"""The speculative round loop (docs/design.md#the-round).

Each round: the draft proposes K tokens after the committed history, the
target scores them in one forward pass and returns how many it accepts plus
its recovered or bonus token, and the coordinator commits those tokens,
checks the stop conditions token by token, and streams the new text.

Pipelined (docs/design.md#pipelined-rounds), the draft drafts round i + 1
while the target verifies round i, assuming round i commits its drafts and
the draft's guess of the bonus token; when the verdict matches, round i + 1
starts with its drafts in hand, otherwise it drafts afresh. The target only
ever verifies drafts made in the committed context, so the output is the same.

The coordinator's ``history`` is the source of truth; the workers' caches
follow it (the draft syncs on the next propose, the target commits the same
tokens itself and says so through the committed length of the next round).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from outrider.config import Recovery
from outrider.coordinator.adaptive.cost_model import CostModels
from outrider.coordinator.adaptive.session import PRIOR_TOKENS, AdaptiveK, adaptive_k_max
from outrider.coordinator.detokenize import TextStream
from outrider.coordinator.request_stats import RoundRecord, Stats
from outrider.coordinator.requests import GenerationRequest
from outrider.coordinator.served_models import Models
from outrider.coordinator.workers.draft_link import DraftLink
from outrider.coordinator.workers.protocol import DraftClient, Judged, TargetClient
from outrider.coordinator.workers.target_link import TargetLink
from outrider.drafters.lookup import NO_MATCH, Lookup
from outrider.engine_load import EngineLoad
from outrider.logging import get_logger
from outrider.speculation import Proposal, TokenLogprobs, Verdict

log = get_logger(__name__)


@dataclass
class Delta:
    """What one round adds to the stream; the last one carries the outcome."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length"
    stats: Stats | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """When the request asked for them: one per token id, in their order."""


async def generate(
    request: GenerationRequest,
    models: Models,
    target: TargetClient,
    draft: DraftClient | Lookup | None,
    costs: CostModels | None = None,
    recovery: Recovery = Recovery(),
    lookup: Lookup | None = None,
) -> AsyncIterator[Delta]:
    """Runs ``request`` round by round, yielding what each round streams;
    ``draft``: the draft workers, a lookup in this process (prompt lookup,
    suffix decoding), or none; ``lookup``: a lookup beside the draft
    workers, each round drafted by whichever pays (:meth:`Generation.look_up`)."""
    generation = Generation(request, models, target, draft, costs or CostModels(), recovery, lookup)
    try:
        # 1. Open: the target prefills the prompt and draws the first token,
        #    streamed at once; a draft model's session opens beside it, or
        #    at the first round that drafts.
        yield generation.finish(await generation.open())
        while generation.finish_reason is None:
            record = RoundRecord()
            proposal = await generation.draft(record)  # 2. draft, or take the speculation
            generation.speculate(proposal)  # (pipelined: draft the next round meanwhile)
            judged = await generation.verify(proposal, record)  # 3. verify in one target pass
            delta = generation.commit(judged.proposal, judged.verdict)  # 4. commit; stop by token
            generation.account(proposal, judged, record, delta)  # 5. learn from the round
            yield generation.finish(delta)  # 6. stream (the last delta carries the outcome)
    finally:
        await generation.close()  # 7. close both sessions: the workers free their caches


def _stats(request: GenerationRequest, num_speculative_tokens: int, *, pipeline: bool) -> Stats:
    """A generation's statistics before its first round."""
    return Stats(
        prompt_tokens=len(request.prompt_ids),
        accepted_per_position=[0] * num_speculative_tokens,
        num_speculative_tokens=num_speculative_tokens,
        seed=request.sampling.seed,
        verification=request.sampling.verification.value,
        adaptive=request.adaptive and num_speculative_tokens > 0,
        pipeline=pipeline and num_speculative_tokens > 0,
    )


class Generation:
    """One request's run through the round loop: its history, its worker
    sessions, its speculation policy and its statistics."""

    def __init__(
        self,
        request: GenerationRequest,
        models: Models,
        target: TargetClient,
        draft: DraftClient | Lookup | None,
        costs: CostModels,
        recovery: Recovery,
        lookup: Lookup | None = None,
    ) -> None:
        if isinstance(draft, Lookup):
            draft, lookup = None, draft
        self.request = request
        self.cost_models = costs
        self.costs = costs.likeliest()
        """The cost model of the target replica the session runs on."""
        self.recovery = recovery
        self.started = time.perf_counter()
        self.history = list(request.prompt_ids)
        self.max_len = min(len(self.history) + request.max_new_tokens, models.target.max_context)
        k = request.num_speculative_tokens if draft is not None or lookup is not None else 0
        self.lookup = lookup.index(len(self.history)) if lookup and k > 0 else None
        self.match = NO_MATCH
        """The draft the lookup offers after the history (:meth:`look_up`)."""
        if request.adaptive:
            k = adaptive_k_max(k, models.target.graphed_tokens_per_row)
        self.num_speculative_tokens = k
        """The request's K (0 without a drafter): each round's, or under
        adaptive K the most a round drafts."""
        # (A lookup takes microseconds: there is nothing to overlap.)
        self.stats = _stats(request, k, pipeline=request.pipeline and self.lookup is None)
        self.policy = (
            AdaptiveK(k, self.costs, pipeline=self.stats.pipeline) if self.stats.adaptive else None
        )
        eos = frozenset() if request.ignore_eos else models.eos_token_ids
        self.stop_ids = request.stop_token_ids | eos
        self.draft_beside = models.draft_prefills_beside
        self.text = TextStream(
            models.tokenizer,
            request.prompt_ids,
            request.stop,
            stop_token_ids=self.stop_ids,
            min_tokens=request.sampling.min_tokens,
            include_stop=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
        )
        self.finish_reason: str | None = None
        self.prefill_s: float = 0.0
        self.target = self._target_link(target)
        self.drafts = self._draft_link(draft, models) if k > 0 else None
        if self.drafts is not None:
            self.target.hidden_state_layers = models.hidden_state_layers
        self.by_lookup = self.lookup is not None and self.drafts is None
        """Whether the next round drafts the lookup's offer (:meth:`look_up`)."""

    def _target_link(self, target: TargetClient) -> TargetLink:
        """The session on the target workers, reopened within the recovery's deadlines."""
        request, recovery = self.request, self.recovery
        return TargetLink(
            target,
            request_id=request.request_id,
            sampling=request.sampling,
            attempts=recovery.target_attempts,
            open_deadline_s=lambda tokens: recovery.open_deadline_s(
                self.costs.prefill_cost(tokens)
            ),
        )

    def _draft_link(self, draft: DraftClient | None, models: Models) -> DraftLink | None:
        """The session on the draft workers (none for a lookup alone, which
        drafts here)."""
        if draft is None:
            return None
        request, recovery = self.request, self.recovery
        return DraftLink(
            draft,
            request_id=request.request_id,
            target=models.target,
            sampling=request.sampling,
            deadline_s=recovery.draft_deadline_s,
            backoff_s=recovery.draft_backoff_s,
            on_open=lambda tokens, seconds: self.costs.observe_draft_prefill(tokens, seconds),
        )

    async def open(self) -> Delta:
        """Opens the target session on the prompt: the target prefills it
        and draws the token after it, as a round with no drafts would; that
        round's delta. A draft model's prefill starts at once, beside the
        target's (unless drafting does not pay now), so drafting can start
        from the second round — or, where the two would share CPU cores, at
        the first round that drafts, so that the first token comes as fast
        as without a draft (:meth:`open_draft`)."""
        record = RoundRecord()
        self.open_draft()
        reply = await self.target.open(self.history, first_token=True)
        assert reply.value is not None, "a target asked for the first token answers it"
        if self.drafts is not None:
            self.drafts.received(reply.hidden_states)
        record.verify_s = self.prefill_s = reply.compute_s
        self.placed(reply.load)
        self.stats.cached_prompt_tokens = reply.cached_tokens
        self.costs.observe_prefill(len(self.history) - reply.cached_tokens, reply.compute_s)
        verdict = reply.value
        delta = self.commit(None, verdict)
        record.ended()
        log.debug(
            "first round",
            prompt_tokens=len(self.request.prompt_ids),
            round_ms=round(record.round_s * 1e3, 2),
            prefill_ms=round(reply.compute_s * 1e3, 2),
        )
        self.stats.record_round(None, verdict, record, streamed=len(delta.token_ids))
        if self.policy is not None:
            self.policy.observe(num_drafts=0, num_accepted=0)  # its row in the target's steps
        self.look_up()
        return delta

    def placed(self, load: EngineLoad | None) -> None:
        """After the target's answer: takes the cost model of the target
        replica the session runs on (reopened, maybe on another), where it
        is planned with the sessions there, and the ``load`` that replica
        reported with its answer, if any."""
        assert self.target.session is not None  # (open)
        self.costs = self.cost_models.of(self.target.session.address)
        if self.policy is not None:
            self.policy.move(self.costs)
        if load is not None:
            self.costs.target = load

    def open_draft(self) -> None:
        """Starts the draft session's prefill beside the target's, if the
        session will draft and the two do not share CPU cores
        (``Models.draft_prefills_beside``); else the draft opens at the
        first round that drafts, so that a session that never drafts never
        costs the draft worker a prefill."""
        if self.drafts is None or not self.draft_beside:
            return
        if self.choose_k(len(self.history) + 1, beside=True) > 0:
            self.drafts.open_soon(self.history)

    def choose_k(self, history_len: int, beside: bool = False) -> int:
        """K for a round after ``history_len`` tokens: never past the length
        limit (a round commits up to K + 1). A session whose draft model has
        not opened neither probes nor opens it where the tokens still to
        come would not repay its prefill (``CostModel.draft_prefill_pays``;
        ``beside``: asked as the target prefills, beside which it would
        run)."""
        room = max(0, self.max_len - history_len - 1)
        if self.by_lookup:
            room = min(room, len(self.match.tokens))  # what the lookup offers
        if self.policy is None:
            return min(self.num_speculative_tokens, room)
        unopened = not self.by_lookup and self.drafts is not None and not self.drafts.begun
        k = self.policy.choose(room, may_probe=not unopened)
        if unopened and k > 0:
            tokens_left = self.max_len - history_len
            gains = self.policy.gains(k).tolist()
            if not self.costs.draft_prefill_pays(
                history_len, tokens_left, beside=beside, gains=gains
            ):
                return 0
        return k

    async def draft(self, record: RoundRecord) -> Proposal | None:
        """This round's proposal: the speculation's when it holds (a hit),
        else a fresh one (syncing the tokens committed since the last round).
        None when the round does not draft: K = 0, or the draft is lost."""
        if self.by_lookup:
            record.k = self.choose_k(len(self.history))
            record.drafted()
            drafts = self.match.tokens[: record.k]
            return Proposal(drafts, follows_len=len(self.history)) if drafts else None
        if self.drafts is None:
            return None
        reply, record.hit = await self.drafts.speculated(self.history)
        if record.hit is not None:
            self.stats.speculation_hits += record.hit
            self.stats.speculation_misses += not record.hit
        if reply is not None:
            record.k = len(reply.value.tokens)
        else:
            k = self.choose_k(len(self.history))
            if k > 0:
                record.k = k
                reply, record.open_s = await self.drafts.propose(self.history, k)
        record.draft_s = reply.compute_s if reply else 0.0
        if reply is not None:
            self.costs.draft_answered(reply.load)
        record.drafted()
        return reply.value if reply else None

    def speculate(self, proposal: Proposal | None) -> None:
        """Pipelined: asks the draft for the next round as if this round's
        drafts were accepted whole — unless the round ends the stream if they
        are (a stop or EOS among them, or the length limit)."""
        if not self.stats.pipeline or self.drafts is None:
            return
        drafts = proposal.tokens if proposal else []
        assumed_len = len(self.history) + len(drafts) + 1
        if assumed_len < self.max_len and not self.stop_ids.intersection(drafts):
            if (k := self.choose_k(assumed_len)) > 0:
                self.drafts.speculate(self.history, drafts, k)

    async def verify(self, proposal: Proposal | None, record: RoundRecord) -> Judged:
        """The target's verdict on the drafts (none: a target-only round) —
        all of them, or a prefix when its step had no room for the rest —
        reopening a lost or frozen target session on the history."""
        drafts = proposal or Proposal([])
        expected_s = self.costs.verify_cost(len(drafts.tokens)) or self.prefill_s
        reply, record.reopen_s = await self.target.verify(
            self.history, drafts, self.recovery.verify_deadline_s(expected_s)
        )
        record.verify_s, record.queued_s = reply.compute_s, reply.queued_s
        self.placed(reply.load)
        if self.drafts is not None:
            self.drafts.received(reply.hidden_states)
        self.stats.verify_time_s += record.reopen_s
        return reply.value

    def commit(self, proposal: Proposal | None, verdict: Verdict) -> Delta:
        """Appends the accepted drafts and the recovered or bonus token to the
        history, checking the stop conditions token by token (the text stream
        decides stops: stop strings, stop token ids and EOS, past
        ``min_tokens``): nothing after a stop is committed or streamed."""
        drafts = proposal.tokens if proposal else []
        delta = Delta("", [])
        text = []
        for i, token in enumerate([*drafts[: verdict.num_accepted], verdict.next_token]):
            self.history.append(token)
            delta.token_ids.append(token)
            delta.logprobs.extend(verdict.logprobs[i : i + 1])
            text.append(self.text.add(token))
            if self.text.ended:
                delta.finish_reason = "stop"
            elif len(self.history) >= self.max_len:
                delta.finish_reason = "length"
            if delta.finish_reason is not None:
                break
        if delta.finish_reason is not None:
            text.append(self.text.finish())
        delta.text = "".join(text)
        self.finish_reason = delta.finish_reason
        return delta

    def look_up(self) -> None:
        """The lookup's draft after the history (prompt lookup's, suffix
        decoding's), looked up as soon as a round has committed: each
        session's offer (its evidence and length) is known to the plan of K
        before any of them asks (:mod:`outrider.drafters.lookup`). At the end, the
        lookup is told the history the session ended with."""
        if self.lookup is None:
            return
        if self.finish_reason is not None:
            self.lookup.ended(self.history)
            return
        self.match = self.lookup.match(self.history, self.num_speculative_tokens)
        if self.drafts is not None:
            self.by_lookup = self.lookup_pays()
        if self.policy is not None:
            if self.by_lookup:
                self.policy.offer(self.match.n, len(self.match.tokens))
            else:
                self.policy.offer(None, None)

    def lookup_pays(self) -> bool:
        """Whether the lookup's offer makes more tokens a second than the
        draft model's drafts, each at its best K for a session alone
        (:meth:`outrider.coordinator.adaptive.step_costs.StepCosts.best_rate_alone`):
        the offer's drafts are priced by what drafts on its evidence had
        accepted, depth by depth, and cost no draft step; the model's, a
        step each, by its per-token α — as Arctic Inference sets suffix
        drafts against its speculator's, by score against length."""
        if not self.match.tokens:
            return False
        acceptance = self.costs.acceptance
        offered = acceptance.survival_of(self.match.n, len(self.match.tokens), PRIOR_TOKENS)
        alpha = self.policy.model_alpha if self.policy is not None else acceptance.alpha_or_prior
        modelled = alpha ** np.arange(1.0, self.num_speculative_tokens + 1)
        return self.costs.best_rate_alone(offered, drafted=False) >= self.costs.best_rate_alone(
            modelled, drafted=True
        )

    def account(
        self, proposal: Proposal | None, judged: Judged, record: RoundRecord, delta: Delta
    ) -> None:
        """Records the round in the statistics, as far as the client got its
        tokens, and teaches the cost model and the policy what it cost and
        what it accepted; with a lookup, looks the next draft up."""
        drafted = proposal.tokens if proposal else []
        verified, verdict = len(judged.proposal.tokens), judged.verdict
        record.ended()
        log.debug(
            "round",
            k=record.k,
            verified=verified,
            accepted=verdict.num_accepted,
            round_ms=round(record.round_s * 1e3, 2),
            drafted_ms=round(record.drafted_s * 1e3, 2),
            draft_ms=round(record.draft_s * 1e3, 2),
            open_ms=round(record.open_s * 1e3, 2),
            verify_ms=round(record.verify_s * 1e3, 2),
        )
        self.stats.record_round(
            proposal, verdict, record, streamed=len(delta.token_ids), verified=verified
        )
        self.costs.observe(
            num_drafts=verified,
            draft_s=record.draft_s,
            draft_steps=0
            if self.by_lookup
            else len(drafted) + bool(proposal and proposal.guess is not None),
            num_accepted=verdict.num_accepted,
            overhead_s=record.overhead_s,
            drafted=proposal is not None and not record.hit and not self.by_lookup,
            evidence=self.match.n if self.by_lookup else None,
        )
        if self.policy:
            self.policy.observe(verified, verdict.num_accepted)
        self.look_up()

    def finish(self, delta: Delta) -> Delta:
        """The round's delta, with the statistics when it is the last."""
        stats = self.stats
        if stats.rounds == 1:
            stats.time_to_first_token_s = time.perf_counter() - self.started
        if delta.finish_reason is None:
            return delta
        stats.total_time_s = time.perf_counter() - self.started
        log.info(
            "generation finished",
            finish_reason=delta.finish_reason,
            generated_tokens=stats.generated_tokens,
            rounds=stats.rounds,
            mean_acceptance_length=round(stats.mean_acceptance_length, 3),
        )
        delta.stats = stats
        return delta

    async def close(self) -> None:
        """Ends both sessions: closed when the generation finished (the
        workers count them done), cut otherwise (a failure, or the client
        went away). The workers free their caches either way."""
        if self.policy is not None:
            self.policy.close()
        finished = self.finish_reason is not None
        self.target.close(finished=finished)
        if self.drafts is not None:
            await self.drafts.close(finished=finished)
