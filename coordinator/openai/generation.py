"""A completion request's run: its generations (one per prompt, run at once)
through the round loop, answered as one JSON object or as server-sent events.

The response runs the generations while it answers, so that

* a request the workers refuse gets its status (429 when they are full, 503
  when no target is reachable): the status line waits for the first round,
  which is when the first tokens could be sent anyway;
* a client that disconnects cancels its generations at once, wherever they
  are (the workers free their sessions as the streams close);
* a slow reader slows the generation down rather than piling up chunks: a
  round's chunk is produced only once the previous one was handed to the
  server, which stops taking them while the client does not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from outrider.coordinator.request_stats import Stats
from outrider.coordinator.round_loop import Delta
from outrider.rpc import Drain

from .errors import status_and_error
from .logprobs import LogprobsFormat
from .tool_calls import ToolCallParser, delta_call, finish_reason, message_call
from .tool_calls import parse as parse_tool_calls

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies pass each event on at once
]
DONE = b"data: [DONE]\n\n"


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def event(body: dict[str, Any]) -> bytes:
    return b"data: " + encode(body) + b"\n\n"


async def merged(
    generations: Sequence[tuple[AsyncIterator[Delta], contextvars.Context]],
) -> AsyncGenerator[tuple[int, Delta], None]:
    """The deltas of several generations, each with its index, as they come.
    The generations run at once, each in the context it was built in (its
    request id bound for its log lines) and each held until its last delta
    is taken; closing this early cancels those still running."""
    if len(generations) == 1:
        async with contextlib.aclosing(generations[0][0]) as only:  # type: ignore[type-var]
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | None, Exception | None]] = asyncio.Queue(1)

    async def pump(index: int, deltas: AsyncIterator[Delta]) -> None:
        try:
            async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                async for delta in deltas:
                    await queue.put((index, delta, None))
        except Exception as exc:
            await queue.put((index, None, exc))
        else:
            await queue.put((index, None, None))  # this generation is over

    pumps = [
        asyncio.create_task(pump(index, deltas), context=context)
        for index, (deltas, context) in enumerate(generations)
    ]
    try:
        running = len(pumps)
        while running:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def run_out(deltas: AsyncIterator[tuple[int, Delta]]) -> None:
    """Lets generations that have yielded their last delta end (close their
    sessions) before the response does."""
    async for index, _ in deltas:
        raise RuntimeError(f"generation {index} went on after its last delta")


class ClientWatch:
    """While the block runs, a client that disconnects cancels it (its
    generations with it); the block then ends quietly, nothing left to send."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = False

    async def __aenter__(self) -> ClientWatch:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a ClientWatch runs in a task")
        self.task = task
        self.watcher = asyncio.create_task(self.watch())
        return self

    async def watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.task.cancel()

    async def __aexit__(self, kind, exc, traceback) -> bool:
        self.watcher.cancel()
        if self.gone:
            self.task.uncancel()
            return kind is asyncio.CancelledError
        return False


class ChatShape:
    """Chat completions: a message per choice, a delta per chunk; the
    ``tool_calls`` of either, when there are some, come ready-made."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    @staticmethod
    def choice(
        index: int,
        text: str | None,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
        tool_calls: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = list(tool_calls)
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    @staticmethod
    def chunk_choice(
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
        first: bool,
        tool_calls: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["content"] = text if text or not tool_calls else None
        if tool_calls:
            delta["tool_calls"] = list(tool_calls)
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }


class TextShape:
    """Completions: a text per choice and per chunk."""

    object = "text_completion"
    chunk_object = "text_completion"

    @staticmethod
    def choice(
        index: int,
        text: str | None,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
        tool_calls: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def chunk_choice(
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
        first: bool,
        tool_calls: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        return TextShape.choice(index, text, finish_reason, logprobs)


Shape = type[ChatShape] | type[TextShape]
CHAT: Shape = ChatShape
TEXT: Shape = TextShape


def stats_of(last_deltas: Iterable[Delta]) -> list[Stats]:
    """The statistics the last deltas of generations carry."""
    return [delta.stats for delta in last_deltas if delta.stats is not None]


def usage_of(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage(stats: Sequence[Stats], n: int = 1) -> dict[str, Any]:
    """The usage of generations in choice order, ``n`` per prompt: each
    prompt counted once, as OpenAI and vLLM count it; of the prompt tokens,
    those the target's prefix cache held (OpenAI's ``cached_tokens``)."""
    prompt = sum(s.prompt_tokens for s in stats[::n])
    cached = sum(s.cached_prompt_tokens for s in stats[::n])
    return {
        **usage_of(prompt, sum(s.generated_tokens for s in stats)),
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def speculative_decoding(stats: Sequence[Stats]) -> dict[str, Any]:
    """The response's speculation, over its generations, in vLLM's words:
    drafts (rounds that verified draft tokens), draft tokens, accepted
    tokens, accepted per position; acceptance rate and mean acceptance length
    (tokens generated per round, the recovered or bonus token included)."""
    rounds = sum(s.rounds for s in stats)
    draft_tokens = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    generated = sum(s.generated_tokens for s in stats)
    positions = max((len(s.accepted_per_position) for s in stats), default=0)
    return {
        "rounds": rounds,
        "num_drafts": sum(s.num_drafts for s in stats),
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": [
            sum(s.accepted_per_position[p] for s in stats if p < len(s.accepted_per_position))
            for p in range(positions)
        ],
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": generated / rounds if rounds else 0.0,
    }


@dataclass
class Completion:
    """One request of either endpoint: its generations and how to answer."""

    shape: Shape
    id: str
    model: str
    generations: Sequence[tuple[AsyncIterator[Delta], contextvars.Context]]
    """Each generation's deltas, and the context to run it in: one per
    choice, ``n`` per prompt."""
    prompt_tokens: Sequence[int] = ()
    """Each generation's prompt length (continuous usage)."""
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    """vLLM's continuous_usage_stats: each chunk carries its choice's usage so far."""
    logprobs: LogprobsFormat | None = None
    """How to write the choices' log-probabilities (None: not asked for)."""
    tool_calls: bool = False
    """Parse the choices' Hermes tool calls (chat with tools) into ``tool_calls``."""
    created: int = field(default_factory=lambda: int(time.time()))
    parsers: dict[int, ToolCallParser] = field(default_factory=dict)
    """Each streamed choice's tool-call parser."""

    def head(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def body(self, choices: list[list[Delta]]) -> dict[str, Any]:
        """The whole answer, once every generation has finished (``choices``:
        each one's deltas)."""
        finished = [deltas[-1] for deltas in choices]
        stats = stats_of(finished)
        return {
            **self.head(self.shape.object),
            "choices": [self.choice(i, deltas) for i, deltas in enumerate(choices)],
            "usage": usage(stats, self.n),
            "metrics": {"speculative_decoding": speculative_decoding(stats)},
        }

    def choice(self, index: int, deltas: Sequence[Delta]) -> dict[str, Any]:
        """Choice ``index`` of the answer, from all its deltas."""
        text: str | None = "".join(d.text for d in deltas)
        finish, calls = deltas[-1].finish_reason, []
        if self.tool_calls:
            text, parsed = parse_tool_calls(text or "")
            text, calls = text or None, [message_call(call) for call in parsed]
            finish = finish_reason(finish, called=bool(parsed))
        return self.shape.choice(index, text, finish, self.logprobs_of(deltas), calls)

    def logprobs_of(self, deltas: Sequence[Delta], offset: int = 0) -> dict[str, Any] | None:
        """The log-probabilities of the deltas' tokens, if asked for;
        ``offset``: the choice's text length before them."""
        if self.logprobs is None:
            return None
        token_ids = [t for d in deltas for t in d.token_ids]
        return self.logprobs.write(token_ids, [lp for d in deltas for lp in d.logprobs], offset)

    def chunk(
        self, index: int, delta: Delta, *, first: bool, generated: int, offset: int = 0
    ) -> dict[str, Any]:
        """A chunk of choice ``index``, which has ``generated`` tokens so
        far (and ``offset`` characters of text before this chunk's)."""
        logprobs = self.logprobs_of([delta], offset)
        text, finish, calls = delta.text, delta.finish_reason, []
        if self.tool_calls:
            parser = self.parsers.setdefault(index, ToolCallParser())
            called = len(parser.calls)
            text, parsed = parser.feed(text, final=finish is not None)
            calls = [delta_call(call, called + i) for i, call in enumerate(parsed)]
            finish = finish_reason(finish, called=bool(parser.calls))
        choice = self.shape.chunk_choice(index, text, finish, logprobs, first, calls)
        chunk = {**self.head(self.shape.chunk_object), "choices": [choice]}
        if self.continuous_usage:  # vLLM's: the choice's usage so far
            chunk["usage"] = usage_of(self.prompt_tokens[index], generated)
        elif self.include_usage:
            chunk["usage"] = None  # OpenAI's: null in every chunk but the usage chunk
        return chunk

    def usage_chunk(self, stats: Sequence[Stats]) -> dict[str, Any]:
        total = usage(stats, self.n)
        return {**self.head(self.shape.chunk_object), "choices": [], "usage": total}


class GenerationResponse(Response):
    """Answers a :class:`Completion` while running it (see the module
    docstring), counted among the server's calls in flight (``drain``)."""

    def __init__(self, completion: Completion, drain: Drain, headers: dict[str, str]) -> None:
        self.completion = completion
        self.drain = drain
        self.init_headers(headers)
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completion = self.completion
        with self.drain.admit("/coordinator" + scope["path"]):
            async with (
                ClientWatch(receive),
                contextlib.aclosing(merged(completion.generations)) as deltas,
            ):
                # An error before the first round answers with its status.
                first = await anext(deltas)
                if completion.stream:
                    await self.stream(send, first, deltas)
                else:
                    await self.answer(send, first, deltas)

    async def answer(
        self,
        send: Send,
        first: tuple[int, Delta],
        deltas: AsyncGenerator[tuple[int, Delta], None],
    ) -> None:
        count = len(self.completion.generations)
        choices: list[list[Delta]] = [[] for _ in range(count)]
        finished = 0
        index, delta = first
        while True:
            choices[index].append(delta)
            if delta.finish_reason is not None:
                finished += 1
                if finished == count:
                    break
            index, delta = await anext(deltas)
        await run_out(deltas)
        body = encode(self.completion.body(choices))
        headers = [
            *self.raw_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def stream(
        self,
        send: Send,
        first: tuple[int, Delta],
        deltas: AsyncGenerator[tuple[int, Delta], None],
    ) -> None:
        completion = self.completion
        count = len(completion.generations)
        headers = [*self.raw_headers, *SSE_HEADERS]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        finished: dict[int, Delta] = {}
        generated = [0] * count
        offsets = [0] * count
        try:
            index, delta = first
            while True:
                started = generated[index] > 0
                generated[index] += len(delta.token_ids)
                chunk = completion.chunk(
                    index,
                    delta,
                    first=not started,
                    generated=generated[index],
                    offset=offsets[index],
                )
                offsets[index] += len(delta.text)
                if delta.finish_reason is not None:
                    finished[index] = delta
                    if len(finished) == count:
                        break
                await send_event(send, chunk)
                index, delta = await anext(deltas)
            # The response's last chunk carries its speculation: the usage
            # chunk when asked for (OpenAI sends usage in a chunk of its own).
            stats = stats_of(finished[i] for i in range(count))
            speculation = {"speculative_decoding": speculative_decoding(stats)}
            if not completion.include_usage:
                chunk["metrics"] = speculation
            await send_event(send, chunk)
            await run_out(deltas)
            if completion.include_usage:
                await send_event(send, {**completion.usage_chunk(stats), "metrics": speculation})
        except Exception as exc:
            # Mid-stream the status is sent: the error is the last event.
            await send_event(send, status_and_error(exc)[1])
        await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def send_event(send: Send, body: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": event(body), "more_body": True})
