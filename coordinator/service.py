"""gRPC servicer of the coordinator: validate and translate the request,
run the round loop, translate its deltas back."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from coordinator.loop import Delta, GenerationRequest, Models, generate
from coordinator.metrics import CoordinatorMetrics
from coordinator.policy import CostModel
from coordinator.stats import Stats
from coordinator.workers import DraftClient, TargetClient, WorkerInfo
from outrider.config import Recovery
from outrider.errors import InvalidArgument
from outrider.logging import bind_contextvars, get_contextvars
from outrider.sampling_params import SamplingParams, Verification
from outrider.v1 import coordinator_pb2 as pb
from outrider.v1 import coordinator_pb2_grpc
from outrider.validation import check_request_id
from outrider.wire import VERIFICATION_TO_PB, verification_from_pb

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


@dataclass(frozen=True)
class SpeculationPolicy:
    default_k: int
    max_k: int
    default_max_new_tokens: int
    default_adaptive: bool = False
    """Requests that leave K unset choose it per round (up to max_k)."""
    default_pipeline: bool = False
    """Requests that leave pipeline unset run pipelined."""


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        models: Models,
        target: TargetClient,
        draft: DraftClient | None,
        policy: SpeculationPolicy,
        draft_info: WorkerInfo | None = None,
        recovery: Recovery = Recovery(),
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.models = models
        self.target = target
        self.draft = draft
        self.policy = policy
        self.draft_info = draft_info
        self.recovery = recovery
        self.metrics = metrics
        # Round costs are the deployment's: every session teaches adaptive K.
        self.costs = CostModel()

    def deltas(self, request: pb.GenerateRequest) -> AsyncIterator[Delta]:
        """Runs the round loop on a request (recorded in the metrics, if any)."""
        received = time.perf_counter()
        deltas = generate(
            self.request_from_pb(request),
            self.models,
            self.target,
            self.draft,
            self.costs,
            self.recovery,
        )
        return self.metrics.track(deltas, received) if self.metrics else deltas

    async def Generate(self, request: pb.GenerateRequest, context):
        async for delta in self.deltas(request):
            yield delta_to_pb(delta)

    async def Complete(self, request: pb.GenerateRequest, context) -> pb.CompleteResponse:
        text, token_ids = [], []
        async for delta in self.deltas(request):
            text.append(delta.text)
            token_ids.extend(delta.token_ids)
        return pb.CompleteResponse(
            text="".join(text),
            token_ids=token_ids,
            finish_reason=FINISH_REASONS[delta.finish_reason],
            stats=stats_to_pb(delta.stats),
        )

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        target, draft = self.models.target, self.draft_info
        return pb.ModelInfo(
            target_model=target.model,
            draft_model=draft.model if draft else "",
            drafter=draft.drafter if draft else "",
            vocab_size=target.vocab_size,
            max_context_length=target.max_context,
            default_num_speculative_tokens=self.policy.default_k,
            max_num_speculative_tokens=self.policy.max_k,
            default_max_new_tokens=self.policy.default_max_new_tokens,
            default_adaptive=self.policy.default_adaptive,
            default_pipeline=self.policy.default_pipeline,
            target_device=target.device,
            target_dtype=target.dtype,
            draft_device=draft.device if draft else "",
            draft_dtype=draft.dtype if draft else "",
        )

    # --- from_pb -------------------------------------------------------------

    def request_from_pb(self, request: pb.GenerateRequest) -> GenerationRequest:
        # One id per request, in every log line of all three services: the
        # client's if it sent one, else the one the interceptor made up.
        if request.request_id:
            check_request_id(request.request_id)
            bind_contextvars(request_id=request.request_id)
        request_id = get_contextvars().get("request_id") or uuid.uuid4().hex[:16]
        prompt_ids = self.prompt_ids(request)
        target = self.models.target
        if len(prompt_ids) >= target.max_context:
            raise InvalidArgument(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds "
                f"{target.max_context}, which leaves no room to generate; shorten the prompt"
            )

        sampling = request.sampling
        room = target.max_context - len(prompt_ids)
        max_new_tokens = sampling.max_new_tokens or min(self.policy.default_max_new_tokens, room)
        if max_new_tokens > room:
            raise InvalidArgument(
                f"max_new_tokens = {max_new_tokens} does not fit: the prompt has {len(prompt_ids)} "
                f"tokens and the context holds {target.max_context}, so at most {room} can be generated"
            )
        if len(sampling.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(
                f"{len(sampling.stop)} stop strings given; at most {MAX_STOP_STRINGS} are allowed"
            )
        for i, stop in enumerate(sampling.stop):
            if not stop or len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidArgument(
                    f"stop[{i}] must have 1 to {MAX_STOP_STRING_CHARS} characters, it has {len(stop)}"
                )
        if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                f"{len(sampling.stop_token_ids)} stop token ids given; at most {MAX_STOP_TOKEN_IDS} are allowed"
            )
        self.check_token_ids(sampling.stop_token_ids, "stop_token_ids")

        # A K the request sets wins; else adaptive (asked, or the server's
        # default) drafts up to max_k; else the server's default K.
        speculation = request.speculation
        adaptive = False
        if speculation.HasField("num_speculative_tokens"):
            k = speculation.num_speculative_tokens
            if k > self.policy.max_k:
                raise InvalidArgument(
                    f"num_speculative_tokens = {k} is above this server's maximum of {self.policy.max_k}"
                )
        elif speculation.adaptive or self.policy.default_adaptive:
            k, adaptive = self.policy.max_k, True
        else:
            k = self.policy.default_k
        if self.draft is None:
            k = 0
        # Pipelining overlaps drafting with verifying: without drafts
        # (K = 0, no draft worker) there is nothing to overlap.
        pipeline = (
            speculation.pipeline
            if speculation.HasField("pipeline")
            else self.policy.default_pipeline
        )
        pipeline = pipeline and k > 0

        try:
            sampling_params = SamplingParams(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
                min_p=sampling.min_p,
                # Unseeded requests get a fresh seed, reported in the stats for replay.
                seed=sampling.seed if sampling.HasField("seed") else secrets.randbits(63),
                verification=verification_from_pb(
                    request.speculation.verification, temperature=sampling.temperature
                ),
            )
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

        return GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_new_tokens=max_new_tokens,
            num_speculative_tokens=k,
            stop=tuple(sampling.stop),
            stop_token_ids=frozenset(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            adaptive=adaptive,
            sampling=sampling_params,
            request_id=request_id,
            pipeline=pipeline,
        )

    def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        tokenizer = self.models.tokenizer
        if kind == "text":
            if not request.text:
                raise InvalidArgument("the prompt text is empty")
            ids = tokenizer(request.text)["input_ids"]
        elif kind == "chat":
            messages = request.chat.messages
            if not messages:
                raise InvalidArgument("the chat has no messages")
            for i, m in enumerate(messages):
                if m.role not in CHAT_ROLES:
                    raise InvalidArgument(
                        f"chat.messages[{i}].role = {m.role!r}; use one of {', '.join(sorted(CHAT_ROLES))}"
                    )
            if getattr(tokenizer, "chat_template", None) is None:
                raise InvalidArgument(
                    "the target's tokenizer has no chat template: send a text prompt instead"
                )
            ids = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise InvalidArgument("token_ids.ids is empty: send at least one token id")
            self.check_token_ids(ids, "token_ids.ids")
        else:
            raise InvalidArgument("the request has no prompt: set text, chat or token_ids")
        if not ids:
            raise InvalidArgument("the prompt is empty after tokenization")
        return list(ids)

    def check_token_ids(self, ids, what: str) -> None:
        vocab = self.models.target.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise InvalidArgument(
                    f"{what}[{i}] = {token} is outside the vocabulary [0, {vocab})"
                )


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
    )


def delta_to_pb(delta: Delta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(text=delta.text, token_ids=delta.token_ids)
    if delta.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[delta.finish_reason]
        response.stats.CopyFrom(stats_to_pb(delta.stats))
    return response
