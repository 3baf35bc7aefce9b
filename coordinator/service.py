"""gRPC servicer of the coordinator: validate and translate the request,
run the round loop, translate its deltas back."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from outrider.config import Recovery, StructuredOutputLimits
from outrider.coordinator.adaptive.cost_model import CostModels
from outrider.coordinator.chat_template import ChatMessage
from outrider.coordinator.metrics import CoordinatorMetrics
from outrider.coordinator.request_stats import Stats
from outrider.coordinator.requests import (
    GenerationRequest,
    RequestBuilder,
    RequestParams,
    SpeculationDefaults,
)
from outrider.coordinator.round_loop import Delta, generate
from outrider.coordinator.served_models import Models
from outrider.coordinator.workers.protocol import DraftClient, TargetClient, WorkerInfo
from outrider.drafters.lookup import Lookup
from outrider.errors import InvalidArgument
from outrider.sampling_params import StructuredOutput, Verification
from outrider.speculation import TokenLogprobs
from outrider.v1 import coordinator_pb2 as pb
from outrider.v1 import coordinator_pb2_grpc
from outrider.wire import VERIFICATION_TO_PB, requested_verification

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        models: Models,
        target: TargetClient,
        draft: DraftClient | Lookup | None,
        defaults: SpeculationDefaults,
        draft_info: WorkerInfo | None = None,
        recovery: Recovery = Recovery(),
        metrics: CoordinatorMetrics | None = None,
        lookup: Lookup | None = None,
        limits: StructuredOutputLimits = StructuredOutputLimits(),
    ) -> None:
        self.models = models
        self.target = target
        self.draft = draft
        self.lookup = lookup
        """A lookup beside the draft workers (suffix decoding): each round
        drafts by whichever pays (:mod:`outrider.coordinator.round_loop`)."""
        self.defaults = defaults
        self.draft_info = draft_info
        self.recovery = recovery
        self.metrics = metrics
        # Round costs are each target replica's, taught by every session on it.
        self.costs = CostModels()
        self.requests = RequestBuilder(models, defaults, drafts=draft is not None, limits=limits)

    def deltas(self, request: GenerationRequest, received: float) -> AsyncIterator[Delta]:
        """Runs the round loop on a request (recorded in the metrics, if any).
        ``received``: ``time.perf_counter()`` when the request arrived."""
        deltas = generate(
            request,
            self.models,
            self.target,
            self.draft,
            self.costs,
            self.recovery,
            self.lookup,
        )
        return self.metrics.track(deltas, received) if self.metrics else deltas

    def request_from_pb(self, request: pb.GenerateRequest) -> GenerationRequest:
        return self.requests.build(params_from_pb(request))

    async def deltas_from_pb(self, request: pb.GenerateRequest) -> AsyncIterator[Delta]:
        received = time.perf_counter()
        params = params_from_pb(request)
        await self.requests.compile(params.structured_output)
        return self.deltas(self.requests.build(params), received)

    async def Generate(self, request: pb.GenerateRequest, context):
        async for delta in await self.deltas_from_pb(request):
            yield delta_to_pb(delta)

    async def Complete(self, request: pb.GenerateRequest, context) -> pb.CompleteResponse:
        text, token_ids, logprobs = [], [], []
        async for delta in await self.deltas_from_pb(request):
            text.append(delta.text)
            token_ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)
        assert delta.finish_reason is not None and delta.stats is not None  # the last delta's
        return pb.CompleteResponse(
            text="".join(text),
            token_ids=token_ids,
            finish_reason=FINISH_REASONS[delta.finish_reason],
            stats=stats_to_pb(delta.stats),
            logprobs=logprobs_to_pb(logprobs),
        )

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        target, draft = self.models.target, self.draft_info
        return pb.ModelInfo(
            target_model=target.model,
            draft_model=draft.model if draft else "",
            drafter=draft.drafter if draft else "",
            vocab_size=target.vocab_size,
            max_context_length=target.max_context,
            default_num_speculative_tokens=self.defaults.default_num_speculative_tokens,
            max_num_speculative_tokens=self.defaults.max_num_speculative_tokens,
            default_max_new_tokens=self.defaults.default_max_new_tokens,
            default_adaptive=self.defaults.default_adaptive,
            default_pipeline=self.defaults.default_pipeline,
            target_device=target.device,
            target_dtype=target.dtype,
            draft_device=draft.device if draft else "",
            draft_dtype=draft.dtype if draft else "",
        )


# --- from_pb -----------------------------------------------------------------


def params_from_pb(request: pb.GenerateRequest) -> RequestParams:
    kind = request.WhichOneof("prompt")
    sampling, speculation = request.sampling, request.speculation
    return RequestParams(
        text=request.text if kind == "text" else None,
        messages=[ChatMessage(m.role, m.content) for m in request.chat.messages]
        if kind == "chat"
        else None,
        token_ids=list(request.token_ids.ids) if kind == "token_ids" else None,
        max_new_tokens=sampling.max_new_tokens or None,  # 0: the server's default
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        min_tokens=sampling.min_tokens,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        min_p=sampling.min_p,
        seed=sampling.seed if sampling.HasField("seed") else None,
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        structured_output=structured_output_from_pb(sampling.structured_output)
        if sampling.HasField("structured_output")
        else None,
        verification=requested_verification(speculation.verification),
        num_speculative_tokens=speculation.num_speculative_tokens
        if speculation.HasField("num_speculative_tokens")
        else None,
        adaptive=speculation.adaptive,
        pipeline=speculation.pipeline if speculation.HasField("pipeline") else None,
        request_id=request.request_id or None,
    )


def structured_output_from_pb(message: pb.StructuredOutput) -> StructuredOutput:
    try:
        return StructuredOutput(message.kind, message.spec)
    except ValueError as exc:
        raise InvalidArgument(str(exc), param="sampling.structured_output.kind") from None


# --- to_pb -------------------------------------------------------------------


def stats_to_pb(stats: Stats) -> pb.GenerationStats:
    return pb.GenerationStats(
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        rounds=stats.rounds,
        num_drafts=stats.num_drafts,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        accepted_per_position=stats.accepted_per_position,
        mean_acceptance_length=stats.mean_acceptance_length,
        acceptance_rate=stats.acceptance_rate,
        draft_time_s=stats.draft_time_s,
        verify_time_s=stats.verify_time_s,
        overhead_time_s=stats.overhead_time_s,
        time_to_first_token_s=stats.time_to_first_token_s,
        total_time_s=stats.total_time_s,
        num_speculative_tokens=stats.num_speculative_tokens,
        seed=stats.seed,
        verification=VERIFICATION_TO_PB[Verification(stats.verification)],
        draft_probs_bytes=stats.draft_probs_bytes,
        adaptive=stats.adaptive,
        overhead_s_p50=stats.overhead_s_p50,
        pipeline=stats.pipeline,
        speculation_hits=stats.speculation_hits,
        speculation_misses=stats.speculation_misses,
        critical_path_overhead_s_p50=stats.critical_path_overhead_s_p50,
        rounds_by_k=stats.rounds_by_k,
        proposed_tokens=stats.proposed_tokens,
        cached_prompt_tokens=stats.cached_prompt_tokens,
    )


def logprobs_to_pb(logprobs: Sequence[TokenLogprobs]) -> list[pb.TokenLogprobs]:
    return [
        pb.TokenLogprobs(
            logprob=t.logprob,
            top_token_ids=[token for token, _ in t.top],
            top_logprobs=[logprob for _, logprob in t.top],
        )
        for t in logprobs
    ]


def delta_to_pb(delta: Delta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        text=delta.text, token_ids=delta.token_ids, logprobs=logprobs_to_pb(delta.logprobs)
    )
    if delta.finish_reason is not None:
        assert delta.stats is not None  # the last delta carries both
        response.finish_reason = FINISH_REASONS[delta.finish_reason]
        response.stats.CopyFrom(stats_to_pb(delta.stats))
    return response
