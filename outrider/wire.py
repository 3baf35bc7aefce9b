"""Protobuf <-> domain conversions shared by the services (the edge)."""

from __future__ import annotations

from collections.abc import Sequence

from outrider.engine_load import EngineLoad
from outrider.errors import InvalidArgument
from outrider.hidden_states import NONE, HiddenStates
from outrider.sampling_params import SamplingParams, StructuredOutput, Verification
from outrider.speculation import CompactProbs, Proposal, TokenLogprobs, Verdict
from outrider.v1 import coordinator_pb2, worker_pb2

VERIFICATION_TO_PB = {
    Verification.GREEDY: coordinator_pb2.VERIFICATION_GREEDY,
    Verification.REJECTION: coordinator_pb2.VERIFICATION_REJECTION,
    Verification.GUMBEL: coordinator_pb2.VERIFICATION_GUMBEL,
}
VERIFICATION_FROM_PB: dict[int, Verification] = {int(v): k for k, v in VERIFICATION_TO_PB.items()}


def requested_verification(value: int) -> Verification | None:
    """The mode a message asks for; None when it leaves it UNSPECIFIED."""
    if value == coordinator_pb2.VERIFICATION_UNSPECIFIED:
        return None
    if value not in VERIFICATION_FROM_PB:
        raise InvalidArgument(f"unknown verification mode {value}: use greedy, rejection or gumbel")
    return VERIFICATION_FROM_PB[value]


def verification_from_pb(value: int, *, temperature: float) -> Verification:
    """Temperature 0 is greedy whatever was asked; UNSPECIFIED while sampling
    means rejection (:meth:`Verification.of_request`)."""
    return Verification.of_request(requested_verification(value), temperature)


def sampling_to_pb(params: SamplingParams) -> worker_pb2.Sampling:
    return worker_pb2.Sampling(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=params.seed,
        verification=VERIFICATION_TO_PB[params.verification],
        logprobs=params.logprobs,
        grammar=grammar_to_pb(params.structured_output),
        min_tokens=params.min_tokens,
        stop_token_ids=sorted(params.stop_token_ids),
        start=params.start,
    )


def sampling_from_pb(message: worker_pb2.Sampling) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=message.temperature,
            top_k=message.top_k,
            top_p=message.top_p or 1.0,
            min_p=message.min_p,
            seed=message.seed,
            verification=verification_from_pb(
                message.verification, temperature=message.temperature
            ),
            logprobs=message.logprobs if message.HasField("logprobs") else None,
            structured_output=StructuredOutput(message.grammar.kind, message.grammar.spec)
            if message.HasField("grammar")
            else None,
            min_tokens=message.min_tokens,
            stop_token_ids=frozenset(message.stop_token_ids),
            start=message.start,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def grammar_to_pb(output: StructuredOutput | None) -> worker_pb2.Grammar | None:
    if output is None:
        return None
    return worker_pb2.Grammar(kind=output.kind, spec=output.spec)


def probs_to_pb(rows: list[CompactProbs]) -> list[worker_pb2.DraftProbs]:
    return [worker_pb2.DraftProbs(token_ids=row.token_ids or b"", probs=row.probs) for row in rows]


def probs_from_pb(rows) -> list[CompactProbs]:
    return [CompactProbs(token_ids=row.token_ids or None, probs=row.probs) for row in rows]


def proposal_to_pb(
    proposal: Proposal, *, compute_s: float, load: EngineLoad | None = None
) -> worker_pb2.DraftProposal:
    return worker_pb2.DraftProposal(
        load=load_to_pb(load),
        draft_token_ids=proposal.tokens,
        draft_probs=probs_to_pb(proposal.probs),
        compute_s=compute_s,
        round_id=proposal.round_id,
        follows_len=proposal.follows_len,
        guess_token_id=proposal.guess,
    )


def proposal_from_pb(message: worker_pb2.DraftProposal) -> Proposal:
    return Proposal(
        tokens=list(message.draft_token_ids),
        probs=probs_from_pb(message.draft_probs),
        follows_len=message.follows_len,
        guess=message.guess_token_id if message.HasField("guess_token_id") else None,
        round_id=message.round_id,
    )


def verify_round_to_pb(committed_len: int, proposal: Proposal) -> worker_pb2.VerifyRound:
    return worker_pb2.VerifyRound(
        committed_len=committed_len,
        draft_token_ids=proposal.tokens,
        draft_probs=probs_to_pb(proposal.probs),
    )


def verdict_to_pb(
    verdict: Verdict,
    *,
    compute_s: float,
    queued_s: float,
    num_verified: int,
    load: EngineLoad | None = None,
    hidden_states: HiddenStates | None = None,
) -> worker_pb2.Verdict:
    return worker_pb2.Verdict(
        hidden_states=hidden_states_to_pb(hidden_states),
        num_accepted=verdict.num_accepted,
        next_token_id=verdict.next_token,
        compute_s=compute_s,
        queued_s=queued_s,
        num_verified=num_verified,
        load=load_to_pb(load),
        logprobs=logprobs_to_pb(verdict.logprobs),
    )


def verdict_from_pb(message: worker_pb2.Verdict) -> Verdict:
    return Verdict(
        num_accepted=message.num_accepted,
        next_token=message.next_token_id,
        logprobs=logprobs_from_pb(message.logprobs),
    )


def logprobs_to_pb(logprobs: Sequence[TokenLogprobs]) -> worker_pb2.Logprobs | None:
    if not logprobs:
        return None
    num_top = len(logprobs[0].top)
    return worker_pb2.Logprobs(
        token_logprobs=[t.logprob for t in logprobs],
        num_top=num_top,
        top_token_ids=[token for t in logprobs for token, _ in t.top],
        top_logprobs=[logprob for t in logprobs for _, logprob in t.top],
    )


def logprobs_from_pb(message: worker_pb2.Logprobs) -> tuple[TokenLogprobs, ...]:
    n = message.num_top
    top = list(zip(message.top_token_ids, message.top_logprobs, strict=True))
    if len(top) != n * len(message.token_logprobs):
        raise ValueError(
            f"logprobs list {len(top)} top entries for {len(message.token_logprobs)} tokens "
            f"of {n} each"
        )
    return tuple(
        TokenLogprobs(logprob, tuple(top[i * n : (i + 1) * n]))
        for i, logprob in enumerate(message.token_logprobs)
    )


def load_to_pb(load: EngineLoad | None) -> worker_pb2.EngineLoad | None:
    if load is None:
        return None
    return worker_pb2.EngineLoad(
        curve_rows=[rows for rows, _, _ in load.curve],
        curve_tokens=[tokens for _, tokens, _ in load.curve],
        curve_seconds=[seconds for _, _, seconds in load.curve],
        tokens_per_step=load.tokens_per_step,
        rows_per_step=load.rows_per_step,
        steps=load.steps,
        running_s=load.running_s,
        work_per_row_s=load.work_per_row_s,
    )


def load_from_pb(message: worker_pb2.EngineLoad) -> EngineLoad:
    return EngineLoad(
        curve=tuple(
            zip(
                message.curve_rows or [1.0] * len(message.curve_tokens),
                message.curve_tokens,
                message.curve_seconds,
                strict=True,
            )
        ),
        tokens_per_step=message.tokens_per_step,
        rows_per_step=message.rows_per_step,
        steps=message.steps,
        running_s=message.running_s,
        work_per_row_s=message.work_per_row_s,
    )


def hidden_states_to_pb(states: HiddenStates | None) -> worker_pb2.HiddenStates | None:
    if states is None or not states.rows:
        return None
    return worker_pb2.HiddenStates(bfloat16=states.data, rows=states.rows)


def hidden_states_from_pb(message: worker_pb2.HiddenStates) -> HiddenStates:
    return HiddenStates(message.bfloat16, message.rows) if message.rows else NONE
