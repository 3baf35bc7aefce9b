"""Structured output that the grammar engine cannot run is the request's
error, never an outage: through three real gRPC services on tiny models, a
constraint beyond the coordinator's limits is refused before any worker is
asked; one that compiles but breaks the parser's limits in the middle of a
generation ends that request with INVALID_ARGUMENT (HTTP 400), is not
retried, and leaves the target replica's health and routing as they were;
and generated hostile constraints (JSON schemas, regular expressions, Lark
grammars, choice lists) each end in 200 or 4xx within a bound, after which
the server still answers."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outrider.client import AsyncClient, StructuredOutput
from outrider.config import StructuredOutputLimits
from tests.integration.harness import BackgroundLoop, running_stack

PROMPT = "The quick brown fox jumps over the lazy dog."
ROW_BREAKER = "start: " + " | ".join(f'"a{i}" "b"' for i in range(2500))
"""Compiles, and opens with a small row; once the first "a" is read, the
parser's row holds all 2,500 alternatives, beyond llguidance's 2,000."""


def replicas(stack):
    return list(stack.coordinator.target.replicas.members.values())


def sessions_asked(stack) -> float:
    """Sessions the target was asked to open: opened, or refused."""
    registry = stack.metrics["target"].registry
    opened = registry.get_sample_value("outrider_worker_sessions_opened_total") or 0
    refused = sum(
        sample.value
        for metric in registry.collect()
        if metric.name == "outrider_worker_sessions_rejected"
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
    return opened + refused


async def test_a_choice_list_beyond_the_limit_is_refused_before_any_worker(tiny_target_dir):
    limits = StructuredOutputLimits(max_choices=1_000)
    async with running_stack(
        tiny_target_dir, drafter="model", http=True, metrics=True, structured_output=limits
    ) as stack:
        choices = StructuredOutput("choice", json.dumps([f"c{i}" for i in range(3_000)]))
        async with AsyncClient(stack.address) as client:
            started = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate(PROMPT, structured_output=choices)
            assert time.perf_counter() - started < 1.0
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "3,000 choices" in refused.value.details()
        assert "--max-choices" in refused.value.details()
        body = {"prompt": PROMPT, "guided_choice": [f"c{i}" for i in range(3_000)]}
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=30) as http:
            answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "--max-choices" in error["message"] and error["param"] == "guided_choice"
        assert sessions_asked(stack) == 0
        assert all(r.failures == 0 for r in replicas(stack))


async def test_three_thousand_choices_run_within_the_default_limits(tiny_target_dir):
    """Choices are one lexeme, so no parser row holds them all."""
    async with running_stack(tiny_target_dir, drafter="model") as stack:
        choices = [f"c{i}" for i in range(3_000)]
        async with AsyncClient(stack.address) as client:
            result = await client.generate(
                PROMPT,
                structured_output=StructuredOutput("choice", json.dumps(choices)),
                max_new_tokens=16,
                num_speculative_tokens=4,
            )
        assert result.text in choices or result.finish_reason == "length"


async def test_a_grammar_that_breaks_the_parser_mid_stream_is_the_requests_error(
    tiny_target_dir,
):
    grammar = StructuredOutput("grammar", ROW_BREAKER)
    async with running_stack(tiny_target_dir, drafter="model", http=True, metrics=True) as stack:
        async with AsyncClient(stack.address) as client:
            started = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate(PROMPT, structured_output=grammar, num_speculative_tokens=4)
            assert time.perf_counter() - started < 5.0  # no retries with back-off
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            details = refused.value.details()
            assert details.startswith("the structured output broke a limit of the grammar engine")
            assert "Current row has 2501 items; max is 2000" in details  # not where it broke
            assert len(refused.value.details()) < 500  # the grammar is not quoted
            assert all(r.failures == 0 for r in replicas(stack))
            assert sessions_asked(stack) == 1  # not retried
            body = {"prompt": PROMPT, "guided_grammar": ROW_BREAKER, "max_tokens": 8}
            async with httpx.AsyncClient(base_url=stack.http_url, timeout=30) as http:
                answer = await http.post("/v1/completions", json=body)
            assert answer.status_code == 400, answer.text
            assert "max is 2000" in answer.json()["error"]["message"]
            ok = await client.generate(PROMPT, max_new_tokens=8)
            assert len(ok.token_ids) == 8
        assert await stack.sessions_left() == (0, 0)
        assert all(r.failures == 0 for r in replicas(stack))


def leaf_schemas() -> st.SearchStrategy[dict]:
    types = ("string", "integer", "number", "boolean", "null")
    patterns = ("(a+)+$", "[", "x{2,1}", ".*", "(a|aa)*b")
    return st.one_of(
        st.sampled_from([{"type": t} for t in types]),
        st.integers(1, 5_000).map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),
        st.sampled_from(patterns).map(lambda p: {"type": "string", "pattern": p}),
        st.just({"$ref": "#/definitions/missing"}),
    )


def nested_schemas(inner: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    names = st.text("abc", min_size=1, max_size=3)
    return st.one_of(
        inner.map(lambda i: {"type": "array", "items": i}),
        st.dictionaries(names, inner, max_size=4).map(
            lambda ps: {"type": "object", "properties": ps}
        ),
        st.lists(inner, min_size=1, max_size=4).map(lambda bs: {"anyOf": bs}),
        inner.map(lambda i: {"type": "object", "properties": {"x": {"$ref": "#"}}, "anyOf": [i]}),
    )


def alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"a{i}" "b"' for i in range(n))


BODIES = st.one_of(
    st.recursive(leaf_schemas(), nested_schemas, max_leaves=12).map(lambda s: {"guided_json": s}),
    st.one_of(
        st.text(st.sampled_from("ab()|*+?[]{}\\.^$0123,-"), max_size=30),
        st.integers(1, 20_000).map(lambda n: "|".join(f"w{i}" for i in range(n))),
    ).map(lambda r: {"guided_regex": r}),
    st.one_of(
        st.integers(1, 4_000).map(alternatives),
        st.text(st.sampled_from('start:ab "|*+?()\n'), max_size=40),
        st.sampled_from(["start: start", 'start: x\nx: "a" x']),
    ).map(lambda g: {"guided_grammar": g}),
    st.one_of(
        st.integers(0, 30_000).map(lambda n: [f"c{i}" for i in range(n)]),
        st.lists(st.text(max_size=8), max_size=50),
        st.just([1, 2]),
    ).map(lambda c: {"guided_choice": c}),
)
"""Request bodies with hostile constraints: deep, wide, recursive and
dangling JSON schemas, broken and huge regular expressions and grammars,
empty, huge and ill-typed choice lists."""


@pytest.fixture(scope="module")
def hostile_stack(tiny_target_dir):
    """A stack on a loop of its own, for hypothesis's synchronous tests."""
    background = BackgroundLoop()
    context = running_stack(tiny_target_dir, drafter="model", http=True)
    stack = background.run(context.__aenter__())
    try:
        yield stack, background
    finally:
        background.run(context.__aexit__(None, None, None))
        background.stop()


def test_every_hostile_constraint_ends_in_200_or_4xx(hostile_stack):
    stack, background = hostile_stack
    statuses: dict[int, int] = {}

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(constraint=BODIES)
    def case(constraint):
        body = {"prompt": PROMPT, "max_tokens": 6, **constraint}
        with httpx.Client(base_url=stack.http_url, timeout=30) as http:
            started = time.perf_counter()
            answer = http.post("/v1/completions", json=body)
            assert time.perf_counter() - started < 10.0, str(constraint)[:300]
            assert answer.status_code == 200 or 400 <= answer.status_code < 500, answer.text
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
            plain = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert plain.status_code == 200, plain.text

    case()
    assert statuses.get(200) and statuses.get(400), statuses  # both kinds were generated
    assert all(r.failures == 0 for r in replicas(stack))
    assert background.run(stack.sessions_left()) == (0, 0)
