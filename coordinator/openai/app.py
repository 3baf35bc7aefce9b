"""The OpenAI-compatible HTTP API: routes, bearer tokens, and the
translation of OpenAI's request bodies into :class:`RequestParams`, which the
coordinator validates as it validates gRPC requests."""

from __future__ import annotations

import contextvars
import dataclasses
import time
import uuid
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outrider import errors
from outrider.coordinator.requests import FieldNames, RequestParams
from outrider.coordinator.service import CoordinatorService
from outrider.logging import bind_contextvars
from outrider.rpc import REQUEST_ID_KEY, Drain
from outrider.sampling_params import Verification
from outrider.security import authorized
from outrider.validation import check_request_id

from .errors import (
    UnknownModel,
    on_http_error,
    on_internal_error,
    on_invalid_body,
    on_outrider_error,
)
from .generation import CHAT, TEXT, Completion, GenerationResponse, Shape
from .logprobs import LogprobsFormat
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationBody

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body; a longer one is refused with 413 (a prompt of the
longest context the coordinator serves is far shorter)."""
MAX_CHOICES = 64
"""Most choices in one request (prompts × n), one generation each, run at once."""


class OpenAIApi:
    """The routes' state: the coordinator's servicer (its request builder and
    round loop), the bearer tokens, and the server's drain."""

    def __init__(
        self, service: CoordinatorService, *, tokens: frozenset[str], drain: Drain
    ) -> None:
        self.service = service
        self.tokens = tokens
        self.drain = drain
        self.started = int(time.time())

    @property
    def model(self) -> str:
        return self.service.models.target.model

    def authorize(self, request: Request) -> None:
        if self.tokens and not authorized(request.headers.get("authorization", ""), self.tokens):
            raise errors.Unauthenticated(
                "this API needs a bearer token: send the header 'Authorization: Bearer <token>'"
            )

    def request_id(self, request: Request) -> str:
        """The client's ``X-Request-Id``, else a new one, bound into the logs."""
        request_id = request.headers.get(REQUEST_ID_KEY) or uuid.uuid4().hex[:16]
        check_request_id(request_id, what=f"header {REQUEST_ID_KEY}")
        bind_contextvars(request_id=request_id)
        return request_id

    async def completion(
        self,
        request: Request,
        body: GenerationBody,
        shape: Shape,
        prompts: list[tuple[RequestParams, FieldNames]],
    ) -> GenerationResponse:
        """Validates the request of each choice (``prompts``: each prompt,
        its token limit and field names; ``n`` choices each), then answers
        with their generations."""
        received = time.perf_counter()
        body.check_supported()
        if body.model is not None and body.model != self.model:
            raise UnknownModel(
                f"model {body.model!r} is not served here; this server serves {self.model!r}"
            )
        request_id = self.request_id(request)
        choices = choice_params(body, prompts)
        await self.service.requests.compile(choices[0][0].structured_output)
        generations, prompt_tokens = [], []
        for i, (params, names) in enumerate(choices):
            one = request_id if len(choices) == 1 else f"{request_id}-{i}"
            built = self.service.requests.build(  # binds its request id
                dataclasses.replace(params, request_id=one), names
            )
            prompt_tokens.append(len(built.prompt_ids))
            generations.append((self.service.deltas(built, received), contextvars.copy_context()))
        bind_contextvars(request_id=request_id)
        prefix = "chatcmpl" if shape is CHAT else "cmpl"
        completion = Completion(
            shape,
            id=f"{prefix}-{request_id}",
            model=self.model,
            generations=generations,
            prompt_tokens=prompt_tokens,
            n=len(choices) // len(prompts),
            stream=body.stream,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            logprobs=None
            if body.num_logprobs is None
            else LogprobsFormat(self.service.models.tokenizer, chat=shape is CHAT),
            tool_calls=isinstance(body, ChatCompletionRequest) and body.tool_mode != "none",
        )
        return GenerationResponse(completion, self.drain, {REQUEST_ID_KEY: request_id})


def choice_params(
    body: GenerationBody, prompts: list[tuple[RequestParams, FieldNames]]
) -> list[tuple[RequestParams, FieldNames]]:
    """The request of each choice: each prompt's ``n``, numbered as vLLM
    numbers them (prompt index × n + i). As in vLLM, choice i of a seeded
    body is seeded with seed + i; unseeded, each draws a seed of its own."""
    n = choices_per_prompt(body.n, len(prompts))
    output, constraint_field = body.structured_output()
    base = dataclasses.replace(body_params(body), structured_output=output)
    choices = []
    for prompt, names in prompts:
        names = dataclasses.replace(names, structured_output=constraint_field)
        for i in range(n):
            params = dataclasses.replace(
                base,
                text=prompt.text,
                messages=prompt.messages,
                tools=prompt.tools,
                token_ids=prompt.token_ids,
                max_new_tokens=prompt.max_new_tokens,
                seed=None if body.seed is None else body.seed + i,
            )
            choices.append((params, names))
    return choices


def choices_per_prompt(n: int | None, prompts: int) -> int:
    """``n`` (1 when unset), within :data:`MAX_CHOICES` for all prompts."""
    n = 1 if n is None else n
    if n < 1:
        raise errors.InvalidArgument(f"n = {n}: ask for at least 1 choice", param="n")
    if n * prompts > MAX_CHOICES:
        each = "the prompt" if prompts == 1 else f"each of {prompts} prompts"
        raise errors.InvalidArgument(
            f"n = {n} for {each} asks for {n * prompts} choices; at most {MAX_CHOICES} "
            "are allowed in one request",
            param="n",
        )
    return n


def body_params(body: GenerationBody) -> RequestParams:
    """The sampling and speculation parameters of a body (its prompts and
    its structured output apart: :func:`choice_params` reads that once)."""
    return RequestParams(
        stop=body.stops,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        temperature=body.temperature,
        top_k=0 if body.top_k == -1 else body.top_k,  # vLLM's -1: off, as 0
        top_p=body.top_p,
        min_p=body.min_p,
        seed=body.seed,
        logprobs=body.num_logprobs,
        verification=Verification(body.verification) if body.verification else None,
        num_speculative_tokens=body.num_speculative_tokens,
        adaptive=body.adaptive,
        pipeline=body.pipeline,
    )


def chat_prompt(body: ChatCompletionRequest) -> list[tuple[RequestParams, FieldNames]]:
    limit_field, limit = body.token_limit()
    names = FieldNames(messages="messages", max_new_tokens=limit_field)
    params = RequestParams(
        messages=body.chat_messages(), tools=body.rendered_tools(), max_new_tokens=limit
    )
    return [(params, names)]


def completion_prompts(body: CompletionRequest) -> list[tuple[RequestParams, FieldNames]]:
    prompts = body.prompts
    if not prompts:
        raise errors.InvalidArgument(
            "prompt is an empty list: send at least one prompt", param="prompt"
        )
    if len(prompts) > MAX_CHOICES:
        raise errors.InvalidArgument(
            f"prompt holds {len(prompts)} prompts; at most {MAX_CHOICES} are allowed",
            param="prompt",
        )
    result = []
    for i, prompt in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        names = FieldNames(text=name, token_ids=name, max_new_tokens="max_tokens")
        params = (
            RequestParams(text=prompt, max_new_tokens=body.max_tokens)
            if isinstance(prompt, str)
            else RequestParams(token_ids=prompt, max_new_tokens=body.max_tokens)
        )
        result.append((params, names))
    return result


class BodyLimit:
    """Refuses a request body over ``max_bytes`` (413, as OpenAI's error
    object: Starlette's own limit answers in plain text), by its
    Content-Length before reading it, and by what is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        too_large = HTTPException(413, f"the request body is over {self.max_bytes} bytes")
        received = 0

        async def limited() -> Message:
            nonlocal received
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise too_large
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise too_large
            return message

        await self.app(scope, limited, send)


def create_app(
    service: CoordinatorService, *, tokens: frozenset[str] = frozenset(), drain: Drain
) -> FastAPI:
    """The API's ASGI app. ``tokens``: bearer tokens a client must present
    (none: open); ``drain``: the gRPC server's, so that a shutdown drains
    both APIs' calls at once."""
    api = OpenAIApi(service, tokens=tokens, drain=drain)
    app = FastAPI(title="Outrider", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_exception_handler(errors.OutriderError, on_outrider_error)
    app.add_exception_handler(RequestValidationError, on_invalid_body)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_internal_error)

    # Probes and version checks need no token.
    @app.get("/health")
    async def health() -> dict[str, str]:
        if drain.draining:
            raise errors.Unavailable("the coordinator is shutting down")
        return {"status": "ok"}

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": version("outrider")}

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api.authorize)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        target = service.models.target
        model = {
            "id": api.model,
            "object": "model",
            "created": api.started,
            "owned_by": "outrider",
            "root": api.model,
            "max_model_len": target.max_context,
        }
        return {"object": "list", "data": [model]}

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> GenerationResponse:
        return await api.completion(request, body, CHAT, chat_prompt(body))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> GenerationResponse:
        return await api.completion(request, body, TEXT, completion_prompts(body))

    app.include_router(v1)
    return app
