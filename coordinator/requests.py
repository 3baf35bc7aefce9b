"""Requests as the coordinator's APIs receive them, validated once into the
round loop's :class:`GenerationRequest`.

The gRPC servicer (``outrider.coordinator.service``) and the OpenAI-compatible HTTP
API (``outrider.coordinator.openai``) each translate what they received into
:class:`RequestParams` — no protobuf, no JSON — and :class:`RequestBuilder`
checks it against the served model and the server's speculation defaults: the
prompt (text, chat messages through the target's chat template, or token
ids), the room left in the context, stop strings and token ids, min_tokens, K, adaptive
K, pipelining, the sampling parameters and the structured output (within
this server's :class:`StructuredOutputLimits`, compiled by the grammar
engine the workers run). A bad field raises InvalidArgument naming it as the
receiving API does (:class:`FieldNames`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from outrider.config import StructuredOutputLimits
from outrider.coordinator.chat_template import ChatMessage, render
from outrider.coordinator.served_models import Models
from outrider.errors import InvalidArgument
from outrider.logging import bind_contextvars, get_contextvars
from outrider.sampling_params import SamplingParams, StructuredOutput, Verification
from outrider.validation import check_request_id

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "verification",
    "logprobs",
)
"""The fields whose checks SamplingParams makes (its messages start with the name)."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, in token space."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    num_speculative_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    """The stop string or stop token that ends the text is part of it."""
    skip_special_tokens: bool = True
    """Special tokens are not text."""
    adaptive: bool = False
    """Choose K per round (up to num_speculative_tokens)."""
    sampling: SamplingParams = SamplingParams()
    request_id: str = ""
    pipeline: bool = False
    """Draft round i + 1 while the target verifies round i."""


@dataclass(frozen=True)
class SpeculationDefaults:
    """What a request that leaves speculation unset gets: this server's flags."""

    default_num_speculative_tokens: int
    max_num_speculative_tokens: int
    default_max_new_tokens: int
    default_adaptive: bool = False
    """Requests that leave K unset choose it per round (up to max_num_speculative_tokens)."""
    default_pipeline: bool = False
    """Requests that leave pipeline unset run pipelined."""


@dataclass(frozen=True)
class RequestParams:
    """A request as an API received it, not yet validated. The prompt is the
    one of ``text``, ``messages`` and ``token_ids`` that is set."""

    text: str | None = None
    """Raw text, tokenized exactly as ``tokenizer(text)`` does."""
    messages: Sequence[ChatMessage] | None = None
    """Chat messages, rendered with the target's chat template."""
    tools: Sequence[dict[str, Any]] = ()
    """OpenAI's tool objects the chat template lists for the model (chat only)."""
    token_ids: Sequence[int] | None = None
    max_new_tokens: int | None = None
    """None: the server's default, within the room the context leaves."""
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    """None: a fresh seed, reported in the statistics for replay."""
    logprobs: int | None = None
    """Report the target's log-probabilities of the generated tokens, with
    this many most likely tokens each; None: none."""
    structured_output: StructuredOutput | None = None
    """What the output must follow (its ``start`` is set here); None: anything."""
    verification: Verification | None = None
    """None: rejection when sampling (:meth:`Verification.of_request`)."""
    num_speculative_tokens: int | None = None
    """None: adaptive if asked (or the server's default), else the server's K."""
    adaptive: bool = False
    pipeline: bool | None = None
    """None: the server's default."""
    request_id: str | None = None
    """Bound into every log line of the request; None: the one already bound, or a new one."""


@dataclass(frozen=True)
class FieldNames:
    """What the receiving API calls the fields whose names differ between
    the APIs (the gRPC API's by default)."""

    text: str = "text"
    messages: str = "chat.messages"
    token_ids: str = "token_ids.ids"
    max_new_tokens: str = "max_new_tokens"
    structured_output: str = "sampling.structured_output"


class RequestBuilder:
    """Validates :class:`RequestParams` against the served model and the
    speculation defaults of this coordinator (``drafts``: it has a draft worker)."""

    def __init__(
        self,
        models: Models,
        defaults: SpeculationDefaults,
        *,
        drafts: bool,
        limits: StructuredOutputLimits = StructuredOutputLimits(),
    ) -> None:
        self.models = models
        self.defaults = defaults
        self.drafts = drafts
        self.limits = limits

    def build(self, params: RequestParams, names: FieldNames = FieldNames()) -> GenerationRequest:
        request_id = self.request_id(params)
        self.check_tools(params.tools)  # before the chat template writes them all out
        prompt_ids = self.prompt_ids(params, names)
        max_new_tokens = self.max_new_tokens(params, len(prompt_ids), names)
        self.check_stops(params)
        self.check_min_tokens(params.min_tokens, max_new_tokens, names)
        k, adaptive, pipeline = self.speculation(params)
        if params.structured_output is not None:
            self.check_structured_output(params.structured_output, names)
        eos = frozenset() if params.ignore_eos else self.models.eos_token_ids
        sampling = dataclasses.replace(
            self.sampling(params),
            structured_output=params.structured_output,
            min_tokens=params.min_tokens,
            # What min_tokens holds back on the target: only what would end the text.
            stop_token_ids=frozenset(params.stop_token_ids) | eos
            if params.min_tokens
            else frozenset(),
            start=len(prompt_ids),
        )
        return GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_new_tokens=max_new_tokens,
            num_speculative_tokens=k,
            stop=tuple(params.stop),
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            adaptive=adaptive,
            sampling=sampling,
            request_id=request_id,
            pipeline=pipeline,
        )

    def check_structured_output(self, output: StructuredOutput, names: FieldNames) -> None:
        """Refuses a constraint beyond this server's limits, or one that does
        not compile for the target's tokenizer (or breaks the grammar
        engine's limits at its first step): what a worker would refuse."""
        try:
            self.check_size(output)
            self.models.grammars.check(output)
        except InvalidArgument as exc:
            raise InvalidArgument(str(exc), param=names.structured_output) from None

    async def compile(self, output: StructuredOutput | None) -> None:
        """Compiles ``output`` on a thread, so that a large grammar (up to
        about half a second at the limits) holds up no other request on the event
        loop; :meth:`build` then finds it compiled, or its refusal."""
        if output is None:
            return
        try:
            self.check_size(output)
        except InvalidArgument:
            return  # refused by build, without compiling
        await asyncio.to_thread(self.models.grammars.compile, output)

    def check_size(self, output: StructuredOutput) -> None:
        limits, size = self.limits, len(output.spec.encode())
        if size > limits.max_grammar_bytes:
            raise InvalidArgument(
                f"the {output.kind} constraint is {size:,} bytes; this "
                f"server accepts at most {limits.max_grammar_bytes:,} (--max-grammar-bytes)"
            )
        if output.kind == "choice":
            try:
                count = len(json.loads(output.spec))
            except (json.JSONDecodeError, TypeError):
                return  # the compile says what is wrong with it
            if count > limits.max_choices:
                raise InvalidArgument(
                    f"the choice constraint lists {count:,} choices; this server accepts at "
                    f"most {limits.max_choices:,} (--max-choices)"
                )

    def check_tools(self, tools: Sequence[Any]) -> None:
        if len(tools) > self.limits.max_tools:
            raise InvalidArgument(
                f"the request lists {len(tools):,} tools; this server accepts at most "
                f"{self.limits.max_tools:,} (--max-tools)",
                param="tools",
            )

    @staticmethod
    def request_id(params: RequestParams) -> str:
        """One id per request, in every log line of all three services: the
        client's if it sent one, else the one already bound, else a new one."""
        if params.request_id:
            check_request_id(params.request_id)
            bind_contextvars(request_id=params.request_id)
        return get_contextvars().get("request_id") or uuid.uuid4().hex[:16]

    def max_new_tokens(self, params: RequestParams, prompt_len: int, names: FieldNames) -> int:
        """The tokens to generate: the request's, or the server's default,
        within the room the prompt leaves in the context."""
        context = self.models.target.max_context
        if prompt_len >= context:
            raise InvalidArgument(
                f"the prompt has {prompt_len} tokens but the model's context holds "
                f"{context}, which leaves no room to generate; shorten the prompt"
            )
        room = context - prompt_len
        max_new_tokens = params.max_new_tokens
        if max_new_tokens is None:
            return min(self.defaults.default_max_new_tokens, room)
        if max_new_tokens < 1:
            raise InvalidArgument(
                f"{names.max_new_tokens} = {max_new_tokens}: generate at least 1 token",
                param=names.max_new_tokens,
            )
        if max_new_tokens > room:
            raise InvalidArgument(
                f"{names.max_new_tokens} = {max_new_tokens} does not fit: the prompt has "
                f"{prompt_len} tokens and the context holds {context}, "
                f"so at most {room} can be generated",
                param=names.max_new_tokens,
            )
        return max_new_tokens

    def check_stops(self, params: RequestParams) -> None:
        if len(params.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(
                f"{len(params.stop)} stop strings given; at most {MAX_STOP_STRINGS} are allowed",
                param="stop",
            )
        for i, stop in enumerate(params.stop):
            if not stop or len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidArgument(
                    f"stop[{i}] must have 1 to {MAX_STOP_STRING_CHARS} characters, "
                    f"it has {len(stop)}",
                    param="stop",
                )
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                f"{len(params.stop_token_ids)} stop token ids given; at most "
                f"{MAX_STOP_TOKEN_IDS} are allowed",
                param="stop_token_ids",
            )
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")

    @staticmethod
    def check_min_tokens(min_tokens: int, max_new_tokens: int, names: FieldNames) -> None:
        if min_tokens < 0:
            raise InvalidArgument(
                f"min_tokens = {min_tokens}: give 0 or more tokens", param="min_tokens"
            )
        if min_tokens > max_new_tokens:
            raise InvalidArgument(
                f"min_tokens = {min_tokens} is more than the {max_new_tokens} tokens this "
                f"request may generate ({names.max_new_tokens}): lower min_tokens or raise "
                f"{names.max_new_tokens}",
                param="min_tokens",
            )

    def speculation(self, params: RequestParams) -> tuple[int, bool, bool]:
        """K, whether it is adaptive, and whether rounds are pipelined. A K
        the request sets wins; else adaptive (asked, or the server's
        default) drafts up to the server's largest K; else the server's default K."""
        adaptive = False
        most = self.defaults.max_num_speculative_tokens
        if params.num_speculative_tokens is not None:
            k = params.num_speculative_tokens
            if not 0 <= k <= most:
                raise InvalidArgument(
                    f"num_speculative_tokens = {k} is outside [0, {most}], this server's range",
                    param="num_speculative_tokens",
                )
        elif params.adaptive or self.defaults.default_adaptive:
            k, adaptive = most, True
        else:
            k = self.defaults.default_num_speculative_tokens
        if not self.drafts:
            k = 0
        # Pipelining overlaps drafting with verifying: without drafts
        # (K = 0, no draft worker) there is nothing to overlap.
        pipeline = (
            params.pipeline if params.pipeline is not None else self.defaults.default_pipeline
        )
        return k, adaptive, pipeline and k > 0

    @staticmethod
    def sampling(params: RequestParams) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                min_p=params.min_p,
                # Unseeded requests get a fresh seed, reported in the stats for replay.
                seed=params.seed if params.seed is not None else secrets.randbits(63),
                verification=Verification.of_request(params.verification, params.temperature),
                logprobs=params.logprobs,
            )
        except ValueError as exc:
            message = str(exc)
            param = next((f for f in SAMPLING_FIELDS if message.startswith(f)), None)
            raise InvalidArgument(message, param=param) from None

    def prompt_ids(self, params: RequestParams, names: FieldNames) -> list[int]:
        tokenizer = self.models.tokenizer
        if params.text is not None:
            if not params.text:
                raise InvalidArgument(f"{names.text} is empty: send some text", param=names.text)
            ids = tokenizer(params.text)["input_ids"]  # type: ignore[operator]
        elif params.messages is not None:
            messages = params.messages
            if not messages:
                raise InvalidArgument(f"{names.messages} is empty", param=names.messages)
            for i, m in enumerate(messages):
                if m.role not in CHAT_ROLES:
                    raise InvalidArgument(
                        f"{names.messages}[{i}].role = {m.role!r}; use one of "
                        f"{', '.join(sorted(CHAT_ROLES))}",
                        param=f"{names.messages}[{i}].role",
                    )
            if getattr(tokenizer, "chat_template", None) is None:
                raise InvalidArgument(
                    "the target's tokenizer has no chat template: send a text prompt instead",
                    param=names.messages,
                )
            ids = render(tokenizer, messages, params.tools)
        elif params.token_ids is not None:
            ids = list(params.token_ids)
            if not ids:
                raise InvalidArgument(
                    f"{names.token_ids} is empty: send at least one token id", param=names.token_ids
                )
            self.check_token_ids(ids, names.token_ids)
        else:
            raise InvalidArgument(
                "the request has no prompt: set "
                f"{names.text}, {names.messages} or {names.token_ids}"
            )
        if not ids:
            raise InvalidArgument("the prompt is empty after tokenization")
        return list(ids)

    def check_token_ids(self, ids: Sequence[int], what: str) -> None:
        vocab = self.models.target.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise InvalidArgument(
                    f"{what}[{i}] = {token} is outside the vocabulary [0, {vocab})", param=what
                )
