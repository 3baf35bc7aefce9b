"""Python SDK for the Outrider coordinator.

Two clients with the same API: :class:`Client` (blocking) and
:class:`AsyncClient` (``asyncio``, ``grpc.aio``). Results are plain frozen
dataclasses; protobuf never leaves this module::

    with Client("localhost:50051", timeout=30) as client:
        result = client.generate("The capital of France is", max_new_tokens=16)
        print(result.text, result.stats.mean_acceptance_length)

        for chunk in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)

    async with AsyncClient("localhost:50051") as client:
        result = await client.generate(token_ids=[1, 415, 5565])
        async for chunk in client.stream("Once upon a time"):
            ...

The prompt is exactly one of ``prompt`` (raw text), ``messages`` (chat
messages, rendered with the target's chat template) or ``token_ids``; the
client checks only that, and the server validates the values.

Errors: failed calls raise the gRPC error unchanged -- ``grpc.RpcError`` from
:class:`Client`, ``grpc.aio.AioRpcError`` from :class:`AsyncClient` -- so
callers branch on ``error.code()``: ``INVALID_ARGUMENT`` for a bad request,
``DEADLINE_EXCEEDED`` when ``timeout`` ran out, ``RESOURCE_EXHAUSTED`` when
the workers are full, ``UNAVAILABLE`` when the coordinator cannot be reached.

Cancellation: leaving a stream early (``break``, an exception, ``close()``)
cancels the RPC, and the server stops generating. A sync generator is closed
as soon as it is dropped; an async generator is closed by the event loop
shortly after it is dropped -- wrap it in ``contextlib.aclosing`` to cancel at
a known point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import grpc
import grpc.aio

from outrider.sampling_params import StructuredOutput
from outrider.speculation import TokenLogprobs
from outrider.v1 import coordinator_pb2 as pb
from outrider.v1 import coordinator_pb2_grpc

__all__ = [
    "AsyncClient",
    "ChatMessage",
    "Chunk",
    "Client",
    "Generation",
    "GenerateOptions",
    "GenerationStats",
    "ModelInfo",
    "StructuredOutput",
    "TokenLogprobs",
]


# ---------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class ChatMessage:
    """One chat message; ``role`` is ``"system"``, ``"user"`` or ``"assistant"``."""

    role: str
    content: str


@dataclass(frozen=True)
class GenerationStats:
    """Statistics of one request (the proto's ``GenerationStats``).

    *Draft tokens* are the tokens the drafter proposed, *accepted tokens* those
    the target agreed with. Every round commits its accepted tokens plus one
    recovered (correction) or bonus token, so ``mean_acceptance_length`` --
    tokens committed per round -- counts that token too.
    """

    prompt_tokens: int
    generated_tokens: int
    rounds: int
    """Verification rounds (one target forward pass each)."""
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    """``accepted_per_position[i]``: rounds whose draft token at position i was accepted."""
    mean_acceptance_length: float
    acceptance_rate: float
    """``accepted_tokens / draft_tokens`` (0 when nothing was drafted)."""
    draft_time_s: float
    verify_time_s: float
    overhead_time_s: float
    time_to_first_token_s: float
    total_time_s: float
    num_speculative_tokens: int
    """The K the request ran with."""
    seed: int = 0
    """The seed the request ran with; send it back to replay the request."""
    verification: str = "greedy"
    draft_probs_bytes: int = 0
    """Bytes of draft probabilities (q) sent to the target, over all rounds."""
    adaptive: bool = False
    """Whether K was chosen per round."""
    overhead_s_p50: float = 0.0
    """Median per-round time outside the workers' compute (RPC + coordinator)."""
    num_drafts: int = 0
    """Rounds that verified at least one draft token (vLLM's drafts; rounds minus the
    target-only ones)."""
    pipeline: bool = False
    """Whether the request ran pipelined (drafting the next round while the target verified
    this one)."""
    speculation_hits: int = 0
    """Rounds whose drafts were drafted during the previous round's verify."""
    speculation_misses: int = 0
    """Rounds whose speculation was discarded (the verdict differed from what it assumed);
    they drafted afresh."""
    critical_path_overhead_s_p50: float = 0.0
    """Median per-round wall time beyond the target's verify compute (waiting for drafts,
    RPC, coordinator)."""
    rounds_by_k: tuple[int, ...] = ()
    """``rounds_by_k[K]``: rounds that asked the draft for K tokens (0: target-only), as the
    policy chose."""
    proposed_tokens: int = 0
    """Draft tokens proposed; ``draft_tokens`` counts those the target verified."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the target found in its prefix cache (not prefilled)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-serialisable dict."""
        return {
            **dataclasses.asdict(self),
            "accepted_per_position": list(self.accepted_per_position),
            "rounds_by_k": list(self.rounds_by_k),
        }


@dataclass(frozen=True)
class Generation:
    """A whole generation, as returned by ``generate``."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    """``"stop"`` (end of sequence, stop token id or stop string) or ``"length"``."""
    stats: GenerationStats
    logprobs: tuple[TokenLogprobs, ...] = ()
    """When asked for (``logprobs``): the target's, one per token id."""

    def to_dict(self) -> dict[str, Any]:
        """``{"text", "token_ids", "finish_reason", "stats"}`` (and
        ``"logprobs"`` when asked for), JSON-serialisable."""
        body = {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs:
            body["logprobs"] = [dataclasses.asdict(t) for t in self.logprobs]
        return body


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the text and token ids committed since the previous one.

    ``text`` may be empty while a multi-byte character or a possible stop
    string is held back. ``finish_reason`` and ``stats`` are set on the last
    chunk only.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    """When asked for (``logprobs``): the target's, one per token id."""


@dataclass(frozen=True)
class ModelInfo:
    """The served models and the speculation defaults (the proto's ``ModelInfo``)."""

    target_model: str
    draft_model: str
    """Model id, or the model-free drafter's name."""
    drafter: str
    """``"model"``, ``"int4"``, ``"prompt-lookup"`` or ``"early-exit"``."""
    vocab_size: int
    max_context_length: int
    default_num_speculative_tokens: int
    max_num_speculative_tokens: int
    default_max_new_tokens: int
    default_adaptive: bool = False
    """Requests that leave K unset choose it per round."""
    target_device: str = ""
    """Where the target worker runs its model (``"cpu"``, ``"cuda:0"``)."""
    target_dtype: str = ""
    draft_device: str = ""
    draft_dtype: str = ""
    """Empty for a model-free drafter."""
    default_pipeline: bool = False
    """Requests that leave ``pipeline`` unset run pipelined."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------
# Requests


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of ``generate`` and ``stream`` (both clients).

    The prompt is exactly one of the positional ``prompt`` (raw text,
    tokenized as ``tokenizer(text)`` does), ``messages`` or ``token_ids``.
    """

    messages: Sequence[ChatMessage | Mapping[str, str]]
    """Chat messages (``ChatMessage`` or ``{"role", "content"}``), rendered
    with the target's chat template."""
    token_ids: Sequence[int]
    """Prompt token ids, used as they are."""
    max_new_tokens: int | None
    """Upper bound on generated tokens (``None``: the server default)."""
    stop: Sequence[str]
    """Stop strings; the one that matched is not part of the text (unless
    ``include_stop_str_in_output``)."""
    stop_token_ids: Sequence[int]
    """Stop tokens; the one that matched is part of ``token_ids``, not of
    the text (unless ``include_stop_str_in_output``)."""
    ignore_eos: bool
    """Keep generating past the model's end-of-sequence tokens."""
    min_tokens: int
    """The first ``min_tokens`` tokens end nothing: no stop string, stop
    token or end-of-sequence token."""
    include_stop_str_in_output: bool
    """The stop string or stop token that ended the text is part of it."""
    num_speculative_tokens: int | None
    """Draft tokens per round (``None``: the server default; ``0``: plain
    target decoding)."""
    adaptive: bool
    """Choose K each round from the running acceptance and the measured
    costs (down to 0 when drafting does not pay); a ``num_speculative_tokens``
    that is given wins."""
    pipeline: bool | None
    """Pipelined rounds (``None``: the server's default): the draft worker
    drafts the next round while the target verifies this one; the output is
    the same either way."""
    temperature: float
    """``0`` (the default) is greedy decoding."""
    top_k: int
    """Keep the ``top_k`` most likely tokens (``0``: off)."""
    top_p: float | None
    """Nucleus sampling mass in ``(0, 1]`` (``None``: off)."""
    min_p: float
    """Drop tokens below ``min_p`` times the top probability."""
    logprobs: int | None
    """Return the target's log-probability of each generated token, with
    this many (0 to 20) most likely tokens at its position (``None``: none):
    the log-softmax of its logits before temperature and the filters, as
    vLLM reports them."""
    structured_output: StructuredOutput | None
    """What the output must follow, e.g. ``StructuredOutput("json_schema",
    json.dumps(schema))`` (``None``: anything); the output is still what
    the target alone would produce with it."""
    seed: int | None
    """Seed of the request's draws (``None``: a fresh one, reported as
    ``stats.seed``); a seeded request reproduces."""
    verification: str | None
    """``"greedy"``, ``"rejection"`` (default when sampling) or ``"gumbel"``
    (output independent of the drafter and K for a given seed)."""
    request_id: str | None
    """Id bound into the server's log lines for this request."""
    timeout: float | None
    """Deadline in seconds (of the whole stream, for ``stream``); ``None``
    uses the client's default."""


# ---------------------------------------------------------------------------
# Translation to and from protobuf (shared by both clients)

_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


_VERIFICATIONS = {
    "greedy": pb.VERIFICATION_GREEDY,
    "rejection": pb.VERIFICATION_REJECTION,
    "gumbel": pb.VERIFICATION_GUMBEL,
}
_VERIFICATION_NAMES = {v: k for k, v in _VERIFICATIONS.items()}


def _build_request(
    prompt: str | None,
    *,
    messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    min_tokens: int = 0,
    include_stop_str_in_output: bool = False,
    num_speculative_tokens: int | None = None,
    adaptive: bool = False,
    pipeline: bool | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float = 0.0,
    seed: int | None = None,
    logprobs: int | None = None,
    structured_output: StructuredOutput | None = None,
    verification: str | None = None,
    request_id: str | None = None,
    timeout: float | None = None,
) -> tuple[pb.GenerateRequest, float | None]:
    """The ``GenerateRequest`` for the arguments of ``generate``/``stream``
    (:class:`GenerateOptions`), and the call's timeout.

    Checks only the shape (exactly one prompt kind); the server validates values.
    """
    prompts = {"prompt": prompt, "messages": messages, "token_ids": token_ids}
    given = [name for name, value in prompts.items() if value is not None]
    if len(given) != 1:
        got = ", ".join(given) or "none"
        raise ValueError(f"give exactly one of prompt, messages or token_ids (got {got})")
    request = pb.GenerateRequest(
        sampling=_sampling_to_pb(
            max_new_tokens=max_new_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            include_stop_str_in_output=include_stop_str_in_output,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            logprobs=logprobs,
            structured_output=structured_output,
        ),
        speculation=_speculation_to_pb(num_speculative_tokens, adaptive, pipeline, verification),
        request_id=request_id or "",
    )
    _set_prompt(request, prompt, messages, token_ids)
    return request, timeout


def _speculation_to_pb(
    num_speculative_tokens: int | None,
    adaptive: bool,
    pipeline: bool | None,
    verification: str | None,
) -> pb.SpeculationParams | None:
    """The request's speculation; None when it leaves all of it to the server."""
    if (num_speculative_tokens, adaptive, pipeline, verification) == (None, False, None, None):
        return None
    speculation = pb.SpeculationParams(adaptive=adaptive)
    # Explicit presence: K = 0 means "no drafting", unset the server default;
    # pipeline unset means the server's default.
    if num_speculative_tokens is not None:
        speculation.num_speculative_tokens = num_speculative_tokens
    if pipeline is not None:
        speculation.pipeline = pipeline
    if verification is not None:
        speculation.verification = _verification_to_pb(verification)
    return speculation


def _sampling_to_pb(
    *,
    max_new_tokens: int | None,
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    ignore_eos: bool,
    min_tokens: int,
    include_stop_str_in_output: bool,
    temperature: float,
    top_k: int,
    top_p: float | None,
    min_p: float,
    seed: int | None,
    logprobs: int | None,
    structured_output: StructuredOutput | None,
) -> pb.SamplingParams:
    if isinstance(stop, str):  # a lone string is one stop string, not one per character
        stop = [stop]
    sampling = pb.SamplingParams(
        max_new_tokens=max_new_tokens or 0,  # 0: the server default
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
        temperature=temperature,
        top_k=top_k,
        min_p=min_p,
    )
    # Explicit presence: unset means "off" (top_p) or "pick a fresh one" (seed).
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    if structured_output is not None:
        sampling.structured_output.kind = structured_output.kind
        sampling.structured_output.spec = structured_output.spec
    return sampling


def _verification_to_pb(verification: str) -> pb.Verification:
    try:
        return _VERIFICATIONS[verification]
    except KeyError:
        raise ValueError(
            f"verification must be one of {', '.join(_VERIFICATIONS)}, not {verification!r}"
        ) from None


def _set_prompt(
    request: pb.GenerateRequest,
    prompt: str | None,
    messages: Sequence[ChatMessage | Mapping[str, str]] | None,
    token_ids: Sequence[int] | None,
) -> None:
    """Sets the request's prompt: the one of the three that is given."""
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.chat.SetInParent()
        request.chat.messages.extend(
            pb.ChatMessage(role=m.role, content=m.content) for m in map(_chat_message, messages)
        )
    elif token_ids is not None:
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(token_ids)


def _chat_message(message: ChatMessage | Mapping[str, str]) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if isinstance(message, Mapping):
        try:
            return ChatMessage(role=message["role"], content=message["content"])
        except KeyError as missing:
            raise ValueError(f"chat message {message!r} lacks {missing}") from None
    raise TypeError(
        "a chat message is a ChatMessage or a mapping with role and content, "
        f"not {type(message).__name__}"
    )


def _stats_from_pb(stats: pb.GenerationStats) -> GenerationStats:
    # The dataclass fields are named after the proto fields.
    values = {
        field.name: getattr(stats, field.name) for field in dataclasses.fields(GenerationStats)
    }
    values["accepted_per_position"] = tuple(stats.accepted_per_position)
    values["rounds_by_k"] = tuple(stats.rounds_by_k)
    values["verification"] = _VERIFICATION_NAMES.get(stats.verification, "greedy")
    return GenerationStats(**values)


def _generation_from_pb(response: pb.CompleteResponse) -> Generation:
    return Generation(
        text=response.text,
        token_ids=tuple(response.token_ids),
        finish_reason=_FINISH_REASONS.get(response.finish_reason, "unspecified"),
        stats=_stats_from_pb(response.stats),
        logprobs=_logprobs_from_pb(response.logprobs),
    )


def _logprobs_from_pb(logprobs: Sequence[pb.TokenLogprobs]) -> tuple[TokenLogprobs, ...]:
    return tuple(
        TokenLogprobs(t.logprob, tuple(zip(t.top_token_ids, t.top_logprobs, strict=True)))
        for t in logprobs
    )


def _chunk_from_pb(response: pb.GenerateResponse) -> Chunk:
    return Chunk(
        text=response.text,
        token_ids=tuple(response.token_ids),
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
        stats=_stats_from_pb(response.stats) if response.HasField("stats") else None,
        logprobs=_logprobs_from_pb(response.logprobs),
    )


def _model_info_from_pb(info: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        **{field.name: getattr(info, field.name) for field in dataclasses.fields(ModelInfo)}
    )


# ---------------------------------------------------------------------------
# Clients


class Client:
    """Blocking client of the coordinator.

    Args:
        address: ``host:port`` of the coordinator.
        credentials: TLS credentials (``grpc.ssl_channel_credentials()``);
            ``None`` opens an insecure channel.
        timeout: Default deadline of each call, in seconds (``None``: none).
        options: gRPC channel options, e.g. ``[("grpc.max_receive_message_length", -1)]``.
        token: Bearer token, for a coordinator started with ``--auth-tokens-file``.

    The channel connects lazily, on the first call. Close the client (or use
    it as a context manager) to release it.
    """

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
    ) -> None:
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=list(options))
        else:
            self._channel = grpc.secure_channel(address, credentials, options=list(options))
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._timeout = timeout
        # Sent with every call when the coordinator requires a bearer token.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Generation:
        """Generates a whole completion (the ``Complete`` RPC); the options are
        :class:`GenerateOptions`.

        Raises:
            ValueError: Not exactly one of ``prompt``, ``messages``, ``token_ids``.
            grpc.RpcError: The call failed; see ``.code()``.
        """
        request, timeout = _build_request(prompt, **options)
        response = self._stub.Complete(
            request, metadata=self._metadata, timeout=self._deadline(timeout)
        )
        return _generation_from_pb(response)

    def stream(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> Generator[Chunk, None, None]:
        """Streams the generation (the ``Generate`` RPC); the options are
        :class:`GenerateOptions`.

        The arguments are checked now; the RPC starts on the first ``next()``.
        The last chunk carries ``finish_reason`` and ``stats``. Closing the
        generator early (``break``, ``close()``) cancels the RPC; ``timeout``
        bounds the whole stream.

        Raises:
            ValueError: Not exactly one of ``prompt``, ``messages``, ``token_ids`` (at the call).
            grpc.RpcError: The call failed (while iterating); see ``.code()``.
        """
        request, timeout = _build_request(prompt, **options)
        return self._stream(request, self._deadline(timeout))

    def _stream(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> Generator[Chunk, None, None]:
        call = self._stub.Generate(request, metadata=self._metadata, timeout=timeout)
        try:
            for response in call:
                yield _chunk_from_pb(response)
        finally:
            call.cancel()  # a no-op when the stream has ended

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        """Describes the served models and the speculation defaults.

        Raises:
            grpc.RpcError: The call failed; see ``.code()``.
        """
        return _model_info_from_pb(
            self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), metadata=self._metadata, timeout=self._deadline(timeout)
            )
        )

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout


class AsyncClient:
    """``asyncio`` client of the coordinator; the API of :class:`Client` with ``await``.

    Create it inside the event loop that uses it. Failed calls raise
    ``grpc.aio.AioRpcError`` (a ``grpc.RpcError``); see ``.code()``.
    """

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
    ) -> None:
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=list(options))
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=list(options))
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._timeout = timeout
        # Sent with every call when the coordinator requires a bearer token.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def generate(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> Generation:
        """Generates a whole completion; see :meth:`Client.generate`."""
        request, timeout = _build_request(prompt, **options)
        return _generation_from_pb(
            await self._stub.Complete(
                request, metadata=self._metadata, timeout=self._deadline(timeout)
            )
        )

    def stream(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> AsyncGenerator[Chunk, None]:
        """Streams the generation; see :meth:`Client.stream`. Use with ``async for``.

        Closing the async generator (``aclose()``, ``contextlib.aclosing``, or
        dropping it after ``break``) cancels the RPC.
        """
        request, timeout = _build_request(prompt, **options)
        return self._stream(request, self._deadline(timeout))

    async def _stream(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[Chunk, None]:
        call = self._stub.Generate(request, metadata=self._metadata, timeout=timeout)
        try:
            async for response in call:
                yield _chunk_from_pb(response)
        finally:
            call.cancel()  # a no-op when the stream has ended

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        """Describes the served models and the speculation defaults."""
        return _model_info_from_pb(
            await self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), metadata=self._metadata, timeout=self._deadline(timeout)
            )
        )

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout
