"""The OpenAI-compatible HTTP API, through the official ``openai`` client
(and httpx, curl and raw ASGI where the client cannot go), against a real
stack of tiny models: the same output as the gRPC API for the same request,
OpenAI's shapes, OpenAI-shaped errors, tokens and TLS, cancellation on
disconnect, bounded buffering, and 32 streams at once."""

from __future__ import annotations

import asyncio
import json
import ssl

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from outrider.client import AsyncClient
from outrider.config import Recovery, WorkerLimits
from outrider.coordinator.openai import create_app
from outrider.rpc import Drain
from outrider.security import ServerTls
from tests.integration.harness import running_stack
from tests.integration.test_security import make_ca, make_cert
from tests.tiny import EOS_TOKEN_ID

NO_EOS = -1
TOKEN = "s3cret-token"
CHAT = [{"role": "user", "content": "The quick brown fox"}]
GREEDY = dict(temperature=0, max_tokens=24)


def served(stack) -> str:
    """The model the stack serves (the tiny target's directory)."""
    return stack.coordinator.models.target.model


def api(stack, **options) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", **options)


async def streamed(stream) -> tuple[str, list]:
    """The text of a streamed completion (chat or not), and its chunks."""
    chunks = [chunk async for chunk in stream]
    pieces = [
        choice.delta.content if hasattr(choice, "delta") else choice.text
        for chunk in chunks
        for choice in chunk.choices
    ]
    return "".join(p or "" for p in pieces), chunks


@pytest.fixture
def stack(tiny_target_dir, tiny_draft_other_dir):
    """Greedy drafts of an unrelated model: rounds accept some drafts and reject others."""
    return running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={EOS_TOKEN_ID}, http=True
    )


async def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(stack):
    """A conversation's second turn resends the first: its full blocks come
    from the target's cache, and usage says how many tokens."""
    system = {"role": "system", "content": " ".join(["The quick brown fox."] * 12)}
    async with stack as s, api(s) as client:
        model = served(s)
        first = await client.chat.completions.create(
            model=model, messages=[system, *CHAT], **GREEDY
        )
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        turn = [
            system,
            *CHAT,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"},
        ]
        second = await client.chat.completions.create(model=model, messages=turn, **GREEDY)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached % 16 == 0 and first.usage.prompt_tokens - 16 <= cached
        assert cached < second.usage.prompt_tokens
        _, chunks = await streamed(
            await client.chat.completions.create(
                model=model,
                messages=turn,
                stream=True,
                stream_options={"include_usage": True},
                **GREEDY,
            )
        )
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


async def test_chat_and_completions_give_the_grpc_text_and_token_counts(stack):
    async with stack as s, AsyncClient(s.address) as grpc_client, api(s) as client:
        model = (await client.models.list()).data[0].id
        grpc_chat = await grpc_client.generate(messages=CHAT, max_new_tokens=24)
        grpc_text = await grpc_client.generate("Hello world", max_new_tokens=24)
        grpc_ids = await grpc_client.generate(token_ids=[5, 17, 42, 99], max_new_tokens=24)

        chat = await client.chat.completions.create(model=model, messages=CHAT, **GREEDY)
        assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
        assert chat.model == model and chat.created > 0
        (choice,) = chat.choices
        assert choice.message.role == "assistant"
        assert choice.message.content == grpc_chat.text
        assert choice.finish_reason == grpc_chat.finish_reason
        assert chat.usage.completion_tokens == len(grpc_chat.token_ids)
        assert chat.usage.prompt_tokens == grpc_chat.stats.prompt_tokens
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
        speculation = chat.model_extra["metrics"]["speculative_decoding"]
        assert speculation["num_draft_tokens"] == grpc_chat.stats.draft_tokens
        assert speculation["num_accepted_tokens"] == grpc_chat.stats.accepted_tokens
        assert speculation["acceptance_rate"] == grpc_chat.stats.acceptance_rate
        assert speculation["mean_acceptance_length"] == grpc_chat.stats.mean_acceptance_length

        text, chunks = await streamed(
            await client.chat.completions.create(
                model=model,
                messages=CHAT,
                stream=True,
                stream_options={"include_usage": True},
                **GREEDY,
            )
        )
        assert text == grpc_chat.text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert {c.id for c in chunks} == {chunks[0].id} and chunks[
            0
        ].object == "chat.completion.chunk"
        *content, finish, last = chunks
        assert finish.choices[0].finish_reason == grpc_chat.finish_reason
        assert all(c.choices[0].finish_reason is None and c.usage is None for c in content)
        assert last.choices == [] and last.usage.completion_tokens == len(grpc_chat.token_ids)
        assert last.model_extra["metrics"]["speculative_decoding"] == speculation

        for prompt, expected in (("Hello world", grpc_text), ([5, 17, 42, 99], grpc_ids)):
            completion = await client.completions.create(model=model, prompt=prompt, **GREEDY)
            assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
            assert completion.choices[0].text == expected.text
            assert completion.usage.completion_tokens == len(expected.token_ids)
            text, chunks = await streamed(
                await client.completions.create(model=model, prompt=prompt, stream=True, **GREEDY)
            )
            assert text == expected.text
            # Without include_usage, the finishing chunk carries the speculation.
            assert chunks[-1].choices[0].finish_reason == expected.finish_reason
            assert chunks[-1].model_extra["metrics"]["speculative_decoding"]["rounds"] == (
                expected.stats.rounds
            )

        # The synchronous client, from a thread (this loop runs the servers).
        def sync_chat() -> str:
            with OpenAI(base_url=f"{s.http_url}/v1", api_key="unused") as sync_client:
                return (
                    sync_client.chat.completions.create(model=model, messages=CHAT, **GREEDY)
                    .choices[0]
                    .message.content
                )

        assert await asyncio.to_thread(sync_chat) == grpc_chat.text
    assert await s.sessions_left() == (0, 0)


async def test_a_list_of_prompts_gives_one_choice_each_equal_to_its_solo_run(stack):
    prompts = ["Hello world", "Once upon a time", "def add(a, b):"]
    async with stack as s, api(s) as client:
        solo = [
            (await client.completions.create(model=served(s), prompt=p, **GREEDY)).choices[0].text
            for p in prompts
        ]
        together = await client.completions.create(model=served(s), prompt=prompts, **GREEDY)
        assert [c.index for c in together.choices] == [0, 1, 2]
        assert [c.text for c in together.choices] == solo
        assert together.usage.completion_tokens == 3 * 24

        stream = await client.completions.create(
            model=served(s), prompt=prompts, stream=True, **GREEDY
        )
        texts = ["", "", ""]
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == solo

        token_prompts = [[5, 17, 42], [99, 7, 300]]
        by_ids = await client.completions.create(model=served(s), prompt=token_prompts, **GREEDY)
        for ids, choice in zip(token_prompts, by_ids.choices, strict=True):
            assert (
                choice.text
                == (await client.completions.create(model=served(s), prompt=ids, **GREEDY))
                .choices[0]
                .text
            )
    assert await s.sessions_left() == (0, 0)


async def test_a_seed_makes_sampling_reproducible_and_equal_to_grpc(stack):
    sampling = dict(temperature=0.9, top_p=0.95, max_tokens=24)
    async with stack as s, AsyncClient(s.address) as grpc_client, api(s) as client:
        first, second, other = [
            (
                await client.chat.completions.create(
                    model=served(s), messages=CHAT, seed=seed, **sampling
                )
            )
            .choices[0]
            .message.content
            for seed in (7, 7, 8)
        ]
        assert first == second != other
        via_grpc = await grpc_client.generate(
            messages=CHAT, temperature=0.9, top_p=0.95, seed=7, max_new_tokens=24
        )
        assert first == via_grpc.text
        # Outrider's own parameters ride in the body, as vLLM's do.
        gumbel = dict(extra_body={"verification": "gumbel", "num_speculative_tokens": 2})
        a, b = [
            (
                await client.chat.completions.create(
                    model=served(s), messages=CHAT, seed=7, **sampling, **gumbel
                )
            )
            .choices[0]
            .message.content
            for _ in range(2)
        ]
        assert a == b


async def test_stop_strings_end_the_text_as_grpc_does(stack):
    async with stack as s, AsyncClient(s.address) as grpc_client, api(s) as client:
        full = (
            (await client.completions.create(model=served(s), prompt="Hello world", **GREEDY))
            .choices[0]
            .text
        )
        stop = full[len(full) // 2 : len(full) // 2 + 2]  # a string from the middle of it
        expected = await grpc_client.generate("Hello world", max_new_tokens=24, stop=[stop])
        assert expected.finish_reason == "stop" and expected.text == full[: full.index(stop)]
        for stops in (stop, [stop, "never seen"]):
            completion = await client.completions.create(
                model=served(s), prompt="Hello world", stop=stops, **GREEDY
            )
            assert completion.choices[0].text == expected.text
            assert completion.choices[0].finish_reason == "stop"
            text, chunks = await streamed(
                await client.completions.create(
                    model=served(s), prompt="Hello world", stop=stops, stream=True, **GREEDY
                )
            )
            assert text == expected.text and chunks[-1].choices[0].finish_reason == "stop"


BAD_REQUESTS = [
    # (path, body, status, param, words of the message)
    ("/v1/completions", b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("/v1/completions", b'["x"]', 400, None, "must be a JSON object"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": 7}, 400, "prompt", "must be a string"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "temprature": 0}, 400, "temprature", "Unrecognized"),
    ("/v1/completions", {"prompt": ["x", "y"], "n": 40}, 400, "n", "asks for 80 choices"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens", "does not fit"),
    ("/v1/completions", {"prompt": [1] * 600}, 400, None, "context holds 512"),
    ("/v1/completions", {"prompt": [1, 512]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "give 0 to 20"),
    ("/v1/completions", {"prompt": "x", "stream_options": {}}, 400, "stream_options", "stream"),
    (
        "/v1/completions",
        {"prompt": "x", "num_speculative_tokens": 17},
        400,
        "num_speculative_tokens",
        "[0, 16]",
    ),  # fmt: skip
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "empty"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages", "required"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "bot", "content": "x"}]},
        400,
        "messages[0].role",
        "use one of",
    ),  # fmt: skip
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "needs"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "frequency_penalty": 0.5},
        400,
        "frequency_penalty",
        "not supported",
    ),  # fmt: skip
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 4, "max_completion_tokens": 5},
        400,
        "max_completion_tokens",
        "differ",
    ),  # fmt: skip
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, None, "not served"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * 5_000_000}]},
        413,
        None,
        "over 4194304 bytes",
    ),  # fmt: skip
    ("/v1/embeddings", {"input": "x"}, 404, None, "no route"),
]


async def test_bad_requests_get_an_openai_error_naming_the_field_and_the_server_goes_on(stack):
    async with (
        stack as s,
        httpx.AsyncClient(base_url=s.http_url, timeout=30) as http,
        api(s) as client,
    ):
        for path, body, status, param, words in BAD_REQUESTS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            reply = await http.post(
                path, content=content, headers={"content-type": "application/json"}
            )
            assert reply.status_code == status, (path, body, reply.text)
            assert reply.headers["content-type"] == "application/json", reply.text
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert words in error["message"] and error["param"] == param, (body, error)
            assert error["type"] == "invalid_request_error"
        assert (await http.get("/v1/chat/completions")).status_code == 405
        # It goes on serving.
        reply = await http.post("/v1/chat/completions", json={"messages": CHAT, **GREEDY})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0

        # The official client raises its own exception classes for them.
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=served(s), messages=CHAT, n=100)
        assert bad.value.param == "n" and bad.value.type == "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(messages=CHAT, model="gpt-4o")
        assert unknown.value.code == "model_not_found"
    assert await s.sessions_left() == (0, 0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_cert(directory, "server", "ca")
    (directory / "tokens").write_text(f"{TOKEN}\n")
    return directory


async def test_tls_and_tokens_guard_the_api_but_health_stays_open(tiny_target_dir, pki):
    tls = ServerTls(pki / "server.pem", pki / "server.key")
    async with running_stack(
        tiny_target_dir,
        drafter="prompt-lookup",
        coordinator_tls=tls,
        tokens=frozenset({TOKEN}),
        http=True,
    ) as s:
        assert s.http_url.startswith("https://")
        trusted = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        async with httpx.AsyncClient(verify=trusted) as http, api(s, http_client=http) as client:
            for key in ("wrong-token", ""):
                with pytest.raises(openai.AuthenticationError) as refused:
                    await client.with_options(api_key=key).completions.create(
                        model=served(s), prompt="Hi", **GREEDY
                    )
                assert refused.value.status_code == 401
                assert refused.value.code == "invalid_api_key"
            authorized = client.with_options(api_key=TOKEN)
            completion = await authorized.completions.create(model=served(s), prompt="Hi", **GREEDY)
            assert completion.usage.completion_tokens > 0
            models = await authorized.models.list()
            assert models.data[0].model_extra["max_model_len"] == 512
            reply = await http.get(f"{s.http_url}/v1/models")
            assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
            for probe in ("/health", "/version"):
                assert (await http.get(f"{s.http_url}{probe}")).status_code == 200
        async with httpx.AsyncClient() as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.get(f"{s.http_url}/health")
    assert await s.sessions_left() == (0, 0)


async def test_a_client_that_disconnects_frees_both_workers_sessions_within_2_s(
    tiny_target_dir, tiny_draft_other_dir
):
    long = dict(temperature=0, max_tokens=400, extra_body={"ignore_eos": True})
    async with (
        running_stack(
            tiny_target_dir,
            draft_dir=tiny_draft_other_dir,
            eos_token_ids={NO_EOS},
            step_s={"target": 0.02},  # 400 tokens take seconds
            http=True,
        ) as s,
        api(s) as client,
    ):
        # Mid-stream: read three chunks, then close the connection.
        stream = await client.completions.create(
            model=served(s), prompt="Hello", stream=True, **long
        )
        chunks = [await anext(stream) for _ in range(3)]
        assert all(c.choices[0].finish_reason is None for c in chunks)
        await stream.close()
        assert await s.sessions_left(timeout_s=2.0) == (0, 0)

        # Waiting for a whole answer, then giving up.
        with pytest.raises(openai.APITimeoutError):
            await client.with_options(timeout=0.5, max_retries=0).completions.create(
                model=served(s), prompt="Hello", **long
            )
        assert await s.sessions_left(timeout_s=2.0) == (0, 0)
        assert s.target.store.cached_tokens == 0 and s.draft.store.cached_tokens == 0


async def test_a_slow_reader_holds_the_generation_back(tiny_target_dir):
    """The response hands the server one chunk at a time: while the client
    does not read (the server's send blocks), no round runs."""
    async with (
        running_stack(
            tiny_target_dir, drafter="prompt-lookup", eos_token_ids={NO_EOS}, http=True
        ) as s,
        api(s) as client,
    ):
        app = create_app(s.coordinator, drain=Drain())
        body = json.dumps(
            {
                "prompt": "Hello",
                "stream": True,
                "max_tokens": 400,
                "ignore_eos": True,
                "temperature": 0,
            }
        ).encode()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        reading, gone = asyncio.Event(), asyncio.Event()
        bodies: list[bytes] = []

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                bodies.append(message["body"])
                if len(bodies) >= 3:
                    await reading.wait()  # the client stopped reading

        response = asyncio.create_task(app(scope, receive, send))
        while len(bodies) < 3:
            await asyncio.sleep(0.01)
        cached = s.target.store.cached_tokens
        await asyncio.sleep(0.5)
        assert len(bodies) == 3 and s.target.store.cached_tokens == cached > 0
        reading.set()
        await asyncio.wait_for(response, 30)
        assert bodies[-1].endswith(b"data: [DONE]\n\n")
        text = "".join(
            json.loads(line[len(b"data: ") :])["choices"][0]["text"]
            for chunk in bodies
            for line in chunk.split(b"\n\n")
            if line.startswith(b"data: {") and b'"choices":[{' in line
        )
        solo = (
            (
                await client.completions.create(
                    model=served(s),
                    prompt="Hello",
                    max_tokens=400,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
            .choices[0]
            .text
        )
        assert text == solo
        gone.set()
    assert await s.sessions_left() == (0, 0)


async def test_32_concurrent_streaming_clients_get_their_solo_texts(stack):
    prompts = [f"Story number {i}: once upon a time" for i in range(32)]
    async with stack as s, api(s, max_retries=0) as client:
        solo = [
            (await client.completions.create(model=served(s), prompt=p, **GREEDY)).choices[0].text
            for p in prompts
        ]

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model=served(s), prompt=prompt, stream=True, **GREEDY
            )
            return (await streamed(stream))[0]

        together = await asyncio.gather(*(one(p) for p in prompts))
        assert list(together) == solo
    assert await s.sessions_left() == (0, 0)


async def test_curl_reads_the_event_stream_as_it_comes(stack):
    async with stack as s, api(s) as client:
        expected = (
            (await client.chat.completions.create(model=served(s), messages=CHAT, **GREEDY))
            .choices[0]
            .message.content
        )
        body = json.dumps({"messages": CHAT, "stream": True, **GREEDY})
        curl = await asyncio.create_subprocess_exec(
            "curl", "-N", "-sS", "--fail-with-body", f"{s.http_url}/v1/chat/completions",
            "-H", "Content-Type: application/json", "-d", body,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(curl.communicate(), 60)
        assert curl.returncode == 0, err
        events = [e for e in out.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == expected
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_on_shutdown_new_requests_get_503_while_those_in_flight_finish(tiny_target_dir):
    """The API shares the gRPC server's drain: health turns 503, new
    requests are refused, the requests in flight run to their end."""
    async with running_stack(
        tiny_target_dir, drafter="prompt-lookup", step_s={"target": 0.01}, http=True
    ) as s:
        drain = Drain()
        app = create_app(s.coordinator, drain=drain)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://outrider") as http:
            body = {"prompt": "Hello", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
            in_flight = asyncio.create_task(http.post("/v1/completions", json=body))
            while not s.target.store.cached_tokens:
                await asyncio.sleep(0.01)
            drained = asyncio.create_task(drain.drain(grace_s=30))
            await asyncio.sleep(0)
            assert (await http.get("/health")).status_code == 503
            refused = await http.post("/v1/completions", json=body)
            assert refused.status_code == 503
            assert "shutting down" in refused.json()["error"]["message"]
            assert not drained.done()
            finished = await in_flight
            assert finished.status_code == 200
            assert finished.json()["usage"]["completion_tokens"] == 60
            assert await drained is True
    assert await s.sessions_left() == (0, 0)


async def test_a_full_worker_is_429_and_a_lost_target_is_503(tiny_target_dir):
    async with (
        running_stack(
            tiny_target_dir,
            drafter="prompt-lookup",
            eos_token_ids={NO_EOS},
            limits=WorkerLimits(max_sessions=1),
            recovery=Recovery(target_attempts=1),
            step_s={"target": 0.01},
            http=True,
        ) as s,
        api(s, max_retries=0) as client,
    ):
        long = dict(model=served(s), prompt="Hello", max_tokens=300, temperature=0)
        stream = await client.completions.create(stream=True, **long)
        await anext(stream)  # its session holds the worker's one place
        with pytest.raises(openai.RateLimitError) as full:
            await client.completions.create(**long)
        assert full.value.status_code == 429 and full.value.code == "server_busy"
        with pytest.raises(openai.RateLimitError):  # a stream's status waits for its first round
            await client.completions.create(stream=True, **long)
        await stream.close()
        assert await s.sessions_left() == (0, 0)

        await s.target_servers[0].stop(None)
        with pytest.raises(openai.InternalServerError) as lost:
            await client.completions.create(**long)
        assert lost.value.status_code == 503 and "no target worker" in lost.value.message
