"""Bytes a service cannot parse: seeded random mutations of valid requests,
sent raw (no client-side serialization) to every coordinator method and to
both workers' session streams and info calls.

A request that does not parse is the client's mistake: INVALID_ARGUMENT with
a message saying so, never UNKNOWN or INTERNAL. Every call is counted in
``outrider_grpc_server_handled_total`` under the code its client got, the
services keep serving, and a well-formed generation still gives the
reference output afterwards.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from outrider.client import AsyncClient
from outrider.v1 import coordinator_pb2 as cpb
from outrider.v1 import worker_pb2 as wpb
from tests.integration.harness import reference_greedy, running_stack

SEED = 21
MUTATIONS_PER_METHOD = 60
CALL_TIMEOUT_S = 30.0
NO_EOS = -1
CANARY_PROMPT = [5, 17, 42, 99, 7]
ANSWERS = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
    }
)
"""A result, or a refusal of the request itself."""


def generate_requests() -> list[bytes]:
    """Valid requests with every kind of prompt, and string fields to corrupt."""
    sampling = cpb.SamplingParams(max_new_tokens=4, stop=["zz"], temperature=0.5, seed=3)
    speculation = cpb.SpeculationParams(num_speculative_tokens=2)
    return [
        cpb.GenerateRequest(
            text="Once upon a time", sampling=sampling, speculation=speculation, request_id="r-1"
        ).SerializeToString(),
        cpb.GenerateRequest(
            chat=cpb.ChatMessages(messages=[cpb.ChatMessage(role="user", content="Hello there")]),
            sampling=sampling,
        ).SerializeToString(),
        cpb.GenerateRequest(
            token_ids=cpb.TokenIds(ids=CANARY_PROMPT), sampling=sampling, speculation=speculation
        ).SerializeToString(),
    ]


def session_messages(role: str, vocab: int, fingerprint: str) -> list[bytes]:
    sampling = wpb.Sampling(temperature=0.5, seed=3)
    if role == "draft":
        open_ = wpb.SessionOpen(
            token_ids=CANARY_PROMPT,
            request_id="r-2",
            target_vocab_size=vocab,
            target_vocab_fingerprint=fingerprint,
            sampling=sampling,
        )
        round_ = wpb.DraftRound(
            committed_len=6, new_token_ids=[8], num_speculative_tokens=2, round_id=1
        )
        return [
            wpb.DraftRequest(open=open_).SerializeToString(),
            wpb.DraftRequest(round=round_).SerializeToString(),
            wpb.DraftRequest(close=wpb.SessionClose()).SerializeToString(),
        ]
    open_ = wpb.SessionOpen(token_ids=CANARY_PROMPT, request_id="r-2", sampling=sampling)
    round_ = wpb.VerifyRound(committed_len=5, draft_token_ids=[8, 9])
    return [
        wpb.VerifyRequest(open=open_).SerializeToString(),
        wpb.VerifyRequest(round=round_).SerializeToString(),
        wpb.VerifyRequest(close=wpb.SessionClose()).SerializeToString(),
    ]


def mutate(raw: bytes, rng: random.Random) -> bytes:
    """One to three random edits: a flipped bit, a random byte, an invalid
    UTF-8 byte, an insertion, a deletion, a truncation."""
    data = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        edit = rng.choice(["flip", "byte", "utf8", "insert", "delete", "truncate"])
        at = rng.randrange(len(data) + 1)
        if edit == "insert" or not data:
            data[at:at] = rng.randbytes(rng.randint(1, 4))
        elif edit == "delete":
            del data[at : at + rng.randint(1, 4)]
        elif edit == "truncate":
            del data[at:]
        else:
            at = min(at, len(data) - 1)
            if edit == "flip":
                data[at] ^= 1 << rng.randrange(8)
            elif edit == "byte":
                data[at] = rng.randrange(256)
            else:
                data[at] = rng.choice([0x80, 0xC0, 0xFF])
    return bytes(data)


async def unary(channel: grpc.aio.Channel, method: str, raw: bytes) -> grpc.StatusCode:
    try:
        await channel.unary_unary(method)(raw, timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        return checked(error)
    return grpc.StatusCode.OK


async def server_streaming(channel: grpc.aio.Channel, method: str, raw: bytes) -> grpc.StatusCode:
    try:
        async for _ in channel.unary_stream(method)(raw, timeout=CALL_TIMEOUT_S):
            pass
    except grpc.aio.AioRpcError as error:
        return checked(error)
    return grpc.StatusCode.OK


async def session(channel: grpc.aio.Channel, method: str, messages: list[bytes]) -> grpc.StatusCode:
    """Sends the messages one at a time, each after the last one's answer
    (the last one a close), and waits for the status the worker ends the
    stream with."""
    call = channel.stream_stream(method)(timeout=CALL_TIMEOUT_S)
    try:
        for message in messages:
            await call.write(message)
            if await call.read() is grpc.aio.EOF:
                break
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
        pass
    code = await call.code()
    if code != grpc.StatusCode.OK:
        checked_code(code, await call.details())
    return code


def checked(error: grpc.aio.AioRpcError) -> grpc.StatusCode:
    return checked_code(error.code(), error.details())


def checked_code(code: grpc.StatusCode, details: str | None) -> grpc.StatusCode:
    details = details or ""
    assert "Traceback" not in details, details
    if code == grpc.StatusCode.INVALID_ARGUMENT and "could not be parsed" in details:
        assert "Error parsing message" in details, details
    return code


def handled(stack, service: str, method: str) -> Counter[str]:
    """``outrider_grpc_server_handled_total`` of one method, by code."""
    grpc_service, _, name = method.lstrip("/").rpartition("/")
    counts: Counter[str] = Counter()
    for family in stack.metrics[service].registry.collect():
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "outrider_grpc_server_handled_total"
                and labels["grpc_service"] == grpc_service
                and labels["grpc_method"] == name
            ):
                counts[labels["grpc_code"]] += int(sample.value)
    return counts


async def counted_calls(
    stack, service: str, method: str, before: Counter[str], calls: int, timeout_s: float = 5.0
) -> Counter[str]:
    """The calls of one method counted since ``before``, once there are
    ``calls`` of them or ``timeout_s`` has passed: a refused call is counted
    after its status is sent, so its client may hear it a moment before."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        counted = handled(stack, service, method) - before
        if counted.total() >= calls or asyncio.get_running_loop().time() > deadline:
            return counted
        await asyncio.sleep(0.01)


async def test_mutated_requests_are_refused_unparsed_and_counted_and_the_services_keep_serving(
    tiny_target_dir, tiny_draft_same_dir
):
    rng = random.Random(SEED)
    reference = reference_greedy(tiny_target_dir, CANARY_PROMPT, 8, eos=None)
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}, metrics=True
    ) as stack:
        info = stack.target.info
        channels = {
            "coordinator": grpc.aio.insecure_channel(stack.address),
            "target": grpc.aio.insecure_channel(stack.target_servers[0].address),
            "draft": grpc.aio.insecure_channel(stack.draft_server.address),
        }
        requests = generate_requests()
        sessions = {
            role: session_messages(role, info.vocab_size, info.vocab_fingerprint)
            for role in ("target", "draft")
        }

        async def complete(raw: bytes) -> grpc.StatusCode:
            return await unary(channels["coordinator"], "/outrider.v1.Coordinator/Complete", raw)

        async def generate(raw: bytes) -> grpc.StatusCode:
            return await server_streaming(
                channels["coordinator"], "/outrider.v1.Coordinator/Generate", raw
            )

        def session_call(role: str, service: str):
            async def call(raw_messages: list[bytes]) -> grpc.StatusCode:
                return await session(
                    channels[role], f"/outrider.v1.{service}/Session", raw_messages
                )

            return call

        # The workers first: the coordinator's cases open worker sessions of their own.
        cases = {}
        for role, service in (("target", "TargetWorker"), ("draft", "DraftWorker")):
            call = session_call(role, service)
            opening, round_, close = sessions[role]
            cases[(role, f"/outrider.v1.{service}/Session")] = (
                lambda call=call, o=opening, r=round_, c=close: (
                    call([mutate(o, rng), c])
                    if rng.random() < 0.5
                    else call([o, mutate(r, rng), c])
                )
            )
            cases[(role, f"/outrider.v1.{service}/GetWorkerInfo")] = (
                lambda role=role, service=service: unary(
                    channels[role], f"/outrider.v1.{service}/GetWorkerInfo", mutate(b"", rng)
                )
            )
        cases[("coordinator", "/outrider.v1.Coordinator/Complete")] = lambda: complete(
            mutate(rng.choice(requests), rng)
        )
        cases[("coordinator", "/outrider.v1.Coordinator/Generate")] = lambda: generate(
            mutate(rng.choice(requests), rng)
        )
        cases[("coordinator", "/outrider.v1.Coordinator/GetModelInfo")] = lambda: unary(
            channels["coordinator"], "/outrider.v1.Coordinator/GetModelInfo", mutate(b"", rng)
        )

        seen: dict[tuple[str, str], Counter[str]] = {}
        counted: dict[tuple[str, str], Counter[str]] = {}
        for (service, method), case in cases.items():
            before = handled(stack, service, method)
            seen[service, method] = Counter(
                [(await case()).name for _ in range(MUTATIONS_PER_METHOD)]
            )
            await stack.sessions_left()
            counted[service, method] = await counted_calls(
                stack, service, method, before, MUTATIONS_PER_METHOD
            )
        print("\nstatus codes of mutated requests, by method:")
        for (_, method), codes in seen.items():
            print(f"  {method}: {dict(codes.most_common())}")

        for (service, method), codes in seen.items():
            assert set(codes) <= {code.name for code in ANSWERS}, (method, codes)
            assert codes["INVALID_ARGUMENT"] > 0 or "GetModelInfo" in method or "Info" in method
            assert counted[service, method] == codes, (method, codes)

        for channel in channels.values():
            status = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        async with AsyncClient(stack.address) as client:
            result = await client.generate(
                token_ids=CANARY_PROMPT, max_new_tokens=8, num_speculative_tokens=3
            )
        assert list(result.token_ids) == reference
        assert await stack.sessions_left() == (0, 0)
        for channel in channels.values():
            await channel.close()
