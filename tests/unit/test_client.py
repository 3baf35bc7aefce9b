"""The SDK (outrider.client) against a fake coordinator on a real grpc.aio server.

The fake echoes the prompt back one character per token (token id = ord(c)),
so every expected result is known exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Iterator

import grpc
import grpc.aio
import pytest

from outrider.client import (
    AsyncClient,
    ChatMessage,
    Chunk,
    Client,
    Generation,
    GenerationStats,
    ModelInfo,
)
from outrider.v1 import coordinator_pb2 as pb
from outrider.v1 import coordinator_pb2_grpc

pytestmark = pytest.mark.timeout(30)

DEFAULT_K = 4

MODEL_INFO = pb.ModelInfo(
    target_model="target/tiny",
    draft_model="draft/tiny",
    drafter="model",
    vocab_size=32000,
    max_context_length=2048,
    default_num_speculative_tokens=DEFAULT_K,
    max_num_speculative_tokens=8,
    default_max_new_tokens=128,
    default_pipeline=True,
)


def _stats(n_tokens: int, k: int, pipeline: bool = False) -> pb.GenerationStats:
    stats = pb.GenerationStats(
        prompt_tokens=n_tokens,
        generated_tokens=n_tokens,
        rounds=2,
        num_drafts=2,
        draft_tokens=8,
        accepted_tokens=6,
        accepted_per_position=[2, 2, 1, 1],
        mean_acceptance_length=4.0,
        acceptance_rate=0.75,
        draft_time_s=0.25,
        verify_time_s=0.5,
        overhead_time_s=0.125,
        time_to_first_token_s=0.0625,
        total_time_s=1.0,
        num_speculative_tokens=k,
    )
    if pipeline:
        stats.pipeline = True
        stats.speculation_hits, stats.speculation_misses = 1, 1
        stats.critical_path_overhead_s_p50 = 0.03125
    return stats


def _expected_stats(n_tokens: int, k: int = DEFAULT_K) -> GenerationStats:
    return GenerationStats(
        prompt_tokens=n_tokens,
        generated_tokens=n_tokens,
        rounds=2,
        num_drafts=2,
        draft_tokens=8,
        accepted_tokens=6,
        accepted_per_position=(2, 2, 1, 1),
        mean_acceptance_length=4.0,
        acceptance_rate=0.75,
        draft_time_s=0.25,
        verify_time_s=0.5,
        overhead_time_s=0.125,
        time_to_first_token_s=0.0625,
        total_time_s=1.0,
        num_speculative_tokens=k,
    )


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Echoes the prompt: text as is, chat as the concatenated contents, token ids as chr(id).

    An empty prompt is INVALID_ARGUMENT; ``max_new_tokens`` truncates (finish
    reason LENGTH). With ``stall`` set, Complete never answers and Generate
    hangs after its first chunk; ``cancelled`` is set when a hanging call is
    cancelled (a threading.Event, so tests on any thread or loop can wait on it).
    """

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.stall = False
        self.cancelled = threading.Event()

    @property
    def last_request(self) -> pb.GenerateRequest:
        return self.requests[-1]

    async def Generate(self, request, context):
        text, reason = await self._accept(request, context)
        for i, char in enumerate(text):
            if self.stall and i == 1:
                await self._hang()
            yield pb.GenerateResponse(text=char, token_ids=[ord(char)])
        yield pb.GenerateResponse(
            finish_reason=reason, stats=_stats(len(text), self._k(request), self._pipeline(request))
        )

    async def Complete(self, request, context):
        text, reason = await self._accept(request, context)
        if self.stall:
            await self._hang()
        return pb.CompleteResponse(
            text=text,
            token_ids=[ord(c) for c in text],
            finish_reason=reason,
            stats=_stats(len(text), self._k(request), self._pipeline(request)),
        )

    async def GetModelInfo(self, request, context):
        return MODEL_INFO

    async def _accept(self, request: pb.GenerateRequest, context) -> tuple[str, int]:
        self.requests.append(request)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            text = request.text
        elif kind == "chat":
            text = "".join(m.content for m in request.chat.messages)
        else:
            text = "".join(map(chr, request.token_ids.ids))
        if not text:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        limit = request.sampling.max_new_tokens
        if limit and len(text) > limit:
            return text[:limit], pb.FINISH_REASON_LENGTH
        return text, pb.FINISH_REASON_STOP

    async def _hang(self) -> None:
        # A cancelled call cancels its handler task. (context.cancelled() is
        # still False in done callbacks of grpc.aio 1.85, so it cannot tell.)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    @staticmethod
    def _k(request: pb.GenerateRequest) -> int:
        has_k = request.HasField("speculation") and request.speculation.HasField(
            "num_speculative_tokens"
        )
        return request.speculation.num_speculative_tokens if has_k else DEFAULT_K

    @staticmethod
    def _pipeline(request: pb.GenerateRequest) -> bool:
        return request.speculation.HasField("pipeline") and request.speculation.pipeline


async def _start_server(fake: FakeCoordinator) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def fake() -> FakeCoordinator:
    return FakeCoordinator()


@pytest.fixture
async def aio_address(fake: FakeCoordinator) -> AsyncIterator[str]:
    """The fake on an aio server in the test's own event loop (for AsyncClient)."""
    server, address = await _start_server(fake)
    try:
        yield address
    finally:
        await server.stop(None)


@pytest.fixture
def sync_address(fake: FakeCoordinator) -> Iterator[str]:
    """The fake on an aio server whose event loop runs in a background thread.

    A blocking client would stall an aio server sharing its thread's loop.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-coordinator", daemon=True)
    thread.start()
    try:
        server, address = asyncio.run_coroutine_threadsafe(_start_server(fake), loop).result(
            timeout=10
        )
        try:
            yield address
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture
def client(sync_address: str) -> Iterator[Client]:
    with Client(sync_address) as c:
        yield c


@pytest.fixture
async def aclient(aio_address: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(aio_address) as c:
        yield c


def _hello() -> Generation:
    return Generation(
        text="hello",
        token_ids=tuple(map(ord, "hello")),
        finish_reason="stop",
        stats=_expected_stats(5),
    )


# --- generate -----------------------------------------------------------------


def test_generate_returns_the_whole_generation(client: Client, fake: FakeCoordinator) -> None:
    assert client.generate("hello") == _hello()
    assert fake.last_request.text == "hello"


async def test_async_generate_returns_the_whole_generation(
    aclient: AsyncClient, fake: FakeCoordinator
) -> None:
    assert await aclient.generate("hello") == _hello()
    assert fake.last_request.text == "hello"


def test_max_new_tokens_reached_finishes_with_length(client: Client) -> None:
    result = client.generate("hello", max_new_tokens=3)
    assert (result.text, result.finish_reason) == ("hel", "length")


def test_sampling_options_and_request_id_reach_the_server(
    client: Client, fake: FakeCoordinator
) -> None:
    client.generate(
        "hello",
        max_new_tokens=3,
        stop=["x", "yz"],
        stop_token_ids=[7, 8],
        ignore_eos=True,
        min_tokens=2,
        include_stop_str_in_output=True,
        request_id="req-1",
    )
    sent = fake.last_request
    assert sent.sampling == pb.SamplingParams(
        max_new_tokens=3,
        stop=["x", "yz"],
        stop_token_ids=[7, 8],
        ignore_eos=True,
        min_tokens=2,
        include_stop_str_in_output=True,
    )
    assert sent.request_id == "req-1"


def test_defaults_leave_everything_to_the_server(client: Client, fake: FakeCoordinator) -> None:
    client.generate("hello")
    sent = fake.last_request
    assert sent.sampling == pb.SamplingParams()
    assert sent.request_id == ""
    assert not sent.HasField("speculation")


def test_a_lone_stop_string_is_one_stop_string(client: Client, fake: FakeCoordinator) -> None:
    client.generate("hello", stop="\n\n")
    assert list(fake.last_request.sampling.stop) == ["\n\n"]


# --- prompt kinds ---------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [ChatMessage("system", "be brief"), ChatMessage("user", "hi")],
        [ChatMessage("system", "be brief"), {"role": "user", "content": "hi"}],
    ],
    ids=["dicts", "chat-messages", "mixed"],
)
def test_messages_reach_the_server_as_chat(client: Client, fake: FakeCoordinator, messages) -> None:
    result = client.generate(messages=messages)
    assert fake.last_request.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in fake.last_request.chat.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
    ]
    assert result.text == "be briefhi"


async def test_async_messages_reach_the_server_as_chat(
    aclient: AsyncClient, fake: FakeCoordinator
) -> None:
    await aclient.generate(messages=[{"role": "user", "content": "hi"}])
    assert fake.last_request.chat == pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hi")]
    )


def test_token_ids_reach_the_server_as_token_ids(client: Client, fake: FakeCoordinator) -> None:
    result = client.generate(token_ids=[104, 105])
    assert fake.last_request.WhichOneof("prompt") == "token_ids"
    assert list(fake.last_request.token_ids.ids) == [104, 105]
    assert (result.text, result.token_ids) == ("hi", (104, 105))


@pytest.mark.parametrize(
    "prompts",
    [
        {},
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"prompt": "a", "token_ids": [1]},
        {"messages": [], "token_ids": [1]},
        {"prompt": "a", "messages": [], "token_ids": [1]},
    ],
    ids=["none", "prompt+messages", "prompt+token_ids", "messages+token_ids", "all-three"],
)
def test_not_exactly_one_prompt_kind_raises_value_error(prompts) -> None:
    with Client("127.0.0.1:9") as unconnected:  # the check runs before any RPC
        with pytest.raises(ValueError, match="exactly one"):
            unconnected.generate(**prompts)
        with pytest.raises(ValueError, match="exactly one"):
            unconnected.stream(**prompts)


async def test_async_not_exactly_one_prompt_kind_raises_value_error() -> None:
    async with AsyncClient("127.0.0.1:9") as unconnected:
        with pytest.raises(ValueError, match="exactly one"):
            await unconnected.generate("a", token_ids=[1])
        with pytest.raises(ValueError, match="exactly one"):
            unconnected.stream()


def test_a_chat_message_without_content_raises_value_error() -> None:
    with Client("127.0.0.1:9") as unconnected, pytest.raises(ValueError, match="content"):
        unconnected.generate(messages=[{"role": "user"}])


# --- speculation ----------------------------------------------------------------


def test_zero_speculative_tokens_is_sent_explicitly(client: Client, fake: FakeCoordinator) -> None:
    result = client.generate("hello", num_speculative_tokens=0)
    assert fake.last_request.speculation.HasField("num_speculative_tokens")
    assert fake.last_request.speculation.num_speculative_tokens == 0
    assert result.stats.num_speculative_tokens == 0


def test_unset_speculative_tokens_leaves_the_field_unset(
    client: Client, fake: FakeCoordinator
) -> None:
    result = client.generate("hello", num_speculative_tokens=None)
    assert not fake.last_request.speculation.HasField("num_speculative_tokens")
    assert result.stats.num_speculative_tokens == DEFAULT_K


async def test_async_stream_sends_speculative_tokens(
    aclient: AsyncClient, fake: FakeCoordinator
) -> None:
    chunks = [chunk async for chunk in aclient.stream("hi", num_speculative_tokens=0)]
    assert fake.last_request.speculation.HasField("num_speculative_tokens")
    assert chunks[-1].stats is not None and chunks[-1].stats.num_speculative_tokens == 0


def test_pipeline_is_sent_only_when_given(client: Client, fake: FakeCoordinator) -> None:
    result = client.generate("hello")
    assert not fake.last_request.speculation.HasField("pipeline")  # the server's default
    assert not result.stats.pipeline
    client.generate("hello", pipeline=False)
    assert fake.last_request.speculation.HasField("pipeline")
    assert not fake.last_request.speculation.pipeline


def test_a_pipelined_request_reports_its_speculation_hits_and_misses(
    client: Client, fake: FakeCoordinator
) -> None:
    result = client.generate("hello", pipeline=True)
    assert fake.last_request.speculation.pipeline
    assert result.stats == dataclasses.replace(
        _expected_stats(5),
        pipeline=True,
        speculation_hits=1,
        speculation_misses=1,
        critical_path_overhead_s_p50=0.03125,
    )


async def test_async_stream_sends_pipeline(aclient: AsyncClient, fake: FakeCoordinator) -> None:
    chunks = [chunk async for chunk in aclient.stream("hi", pipeline=True)]
    assert (
        fake.last_request.speculation.HasField("pipeline")
        and fake.last_request.speculation.pipeline
    )
    assert chunks[-1].stats is not None and chunks[-1].stats.speculation_hits == 1
    await aclient.generate("hi", pipeline=False)
    assert fake.last_request.speculation.HasField("pipeline")
    assert not fake.last_request.speculation.pipeline


# --- stream ---------------------------------------------------------------------


def _expected_chunks(text: str) -> list[Chunk]:
    return [Chunk(text=c, token_ids=(ord(c),)) for c in text] + [
        Chunk(text="", token_ids=(), finish_reason="stop", stats=_expected_stats(len(text)))
    ]


def test_stream_yields_chunks_and_the_last_carries_stats(
    client: Client, fake: FakeCoordinator
) -> None:
    assert list(client.stream("hey")) == _expected_chunks("hey")
    assert fake.last_request.text == "hey"


async def test_async_stream_yields_chunks_and_the_last_carries_stats(
    aclient: AsyncClient, fake: FakeCoordinator
) -> None:
    assert [chunk async for chunk in aclient.stream("hey")] == _expected_chunks("hey")


def test_breaking_out_of_a_stream_cancels_the_server_call(
    client: Client, fake: FakeCoordinator
) -> None:
    fake.stall = True
    for chunk in client.stream("hello"):
        assert chunk.text == "h"
        break
    assert fake.cancelled.wait(timeout=5)


async def test_async_breaking_out_of_a_stream_cancels_the_server_call(
    aclient: AsyncClient, fake: FakeCoordinator
) -> None:
    fake.stall = True
    async for chunk in aclient.stream("hello"):
        assert chunk.text == "h"
        break
    assert await asyncio.to_thread(fake.cancelled.wait, 5)


async def test_async_closing_a_stream_cancels_the_server_call(
    aclient: AsyncClient, fake: FakeCoordinator
) -> None:
    fake.stall = True
    async with contextlib.aclosing(aclient.stream("hello")) as chunks:
        assert (await anext(chunks)).text == "h"
    assert await asyncio.to_thread(fake.cancelled.wait, 5)


# --- deadlines and errors -------------------------------------------------------


def test_per_call_timeout_raises_deadline_exceeded(client: Client, fake: FakeCoordinator) -> None:
    fake.stall = True
    with pytest.raises(grpc.RpcError) as error:
        client.generate("hello", timeout=0.2)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_client_timeout_is_the_default_deadline(sync_address: str, fake: FakeCoordinator) -> None:
    fake.stall = True
    with Client(sync_address, timeout=0.2) as impatient, pytest.raises(grpc.RpcError) as error:
        list(impatient.stream("hello"))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_async_timeout_raises_deadline_exceeded(
    aclient: AsyncClient, fake: FakeCoordinator
) -> None:
    fake.stall = True
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await aclient.generate("hello", timeout=0.2)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_server_errors_propagate_unchanged(client: Client) -> None:
    with pytest.raises(grpc.RpcError) as error:
        client.generate("")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "empty prompt"


async def test_async_server_errors_propagate_unchanged(aclient: AsyncClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        [chunk async for chunk in aclient.stream("")]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# --- model info and serialisation -----------------------------------------------

EXPECTED_MODEL_INFO = ModelInfo(
    target_model="target/tiny",
    draft_model="draft/tiny",
    drafter="model",
    vocab_size=32000,
    max_context_length=2048,
    default_num_speculative_tokens=DEFAULT_K,
    max_num_speculative_tokens=8,
    default_max_new_tokens=128,
    default_pipeline=True,
)


def test_model_info(client: Client) -> None:
    assert client.model_info() == EXPECTED_MODEL_INFO


async def test_async_model_info(aclient: AsyncClient) -> None:
    assert await aclient.model_info() == EXPECTED_MODEL_INFO


def test_to_dict_is_json_serialisable() -> None:
    generation = _hello()
    assert json.loads(json.dumps(generation.to_dict())) == {
        "text": "hello",
        "token_ids": [104, 101, 108, 108, 111],
        "finish_reason": "stop",
        "stats": {
            "prompt_tokens": 5,
            "generated_tokens": 5,
            "rounds": 2,
            "draft_tokens": 8,
            "accepted_tokens": 6,
            "accepted_per_position": [2, 2, 1, 1],
            "mean_acceptance_length": 4.0,
            "acceptance_rate": 0.75,
            "draft_time_s": 0.25,
            "verify_time_s": 0.5,
            "overhead_time_s": 0.125,
            "time_to_first_token_s": 0.0625,
            "total_time_s": 1.0,
            "num_speculative_tokens": DEFAULT_K,
            "seed": 0,
            "verification": "greedy",
            "draft_probs_bytes": 0,
            "adaptive": False,
            "overhead_s_p50": 0.0,
            "num_drafts": 2,
            "pipeline": False,
            "speculation_hits": 0,
            "speculation_misses": 0,
            "critical_path_overhead_s_p50": 0.0,
            "rounds_by_k": [],
            "proposed_tokens": 0,
            "cached_prompt_tokens": 0,
        },
    }
    assert json.loads(json.dumps(EXPECTED_MODEL_INFO.to_dict()))["drafter"] == "model"
