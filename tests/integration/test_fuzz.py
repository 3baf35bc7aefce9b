"""Fuzzing the three services with hypothesis (docs/design.md#protocol: bad
input never takes a worker down).

Real grpc.aio servers on 127.0.0.1 run on tiny float64 models in an event
loop on a background thread; the test drives them with blocking gRPC
clients: (a) random ``GenerateRequest``s to the coordinator — any field
values, absurd ones included — and (b) random session message sequences
straight to the draft and target workers, drawn interactively so that some
build on the right committed length and get deep into a round, others are
out of step, come before the open, open twice or carry garbage.

Every answer must be a success or one of the statuses that refuse a request
(INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION, RESOURCE_EXHAUSTED)
with a message that names the problem and carries no stack trace. A canary
generation runs alongside the whole time and must always give the reference
output; afterwards every service is still SERVING and no session is left.

Derandomized (a fixed seed per test), so CI runs the same cases every time.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from outrider.config import WorkerLimits
from outrider.v1 import coordinator_pb2 as cpb
from outrider.v1 import coordinator_pb2_grpc, worker_pb2_grpc
from outrider.v1 import worker_pb2 as wpb
from tests.integration.harness import BackgroundLoop, reference_greedy, running_stack

COORDINATOR_CASES = 4000
DRAFT_CASES = 3000
TARGET_CASES = 3000
MESSAGES_PER_SESSION = 6
CALL_TIMEOUT_S = 60.0

REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
TRACEBACK_MARKERS = ("Traceback", 'File "')

FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    # No shrinking: against live servers it could take minutes; a failure
    # shows the whole case (request or message) that broke.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

CANARY_PROMPT = [5, 17, 42, 99, 7, 300, 12]
CANARY_NEW_TOKENS = 12
NO_EOS = -1

counts: dict[str, int] = {}
pipelined: dict[str, int] = {"requests": 0, "speculated": 0}
"""Coordinator results that ran pipelined, and those whose rounds were speculated."""


# --- the services, on a loop in a background thread -------------------------------


class Canary:
    """A well-formed generation, repeated on its own thread while the fuzzing runs."""

    def __init__(self, stub, expected: list[int]) -> None:
        self.stub = stub
        self.expected = expected
        self.runs = 0
        self.attempts = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="canary", daemon=True)

    def check_once(self) -> None:
        # Every other run pipelined: the output is the same either way.
        self.attempts += 1
        request = cpb.GenerateRequest(
            token_ids=cpb.TokenIds(ids=CANARY_PROMPT),
            sampling=cpb.SamplingParams(max_new_tokens=CANARY_NEW_TOKENS, ignore_eos=True),
            speculation=cpb.SpeculationParams(
                num_speculative_tokens=3, pipeline=self.attempts % 2 == 0
            ),
        )
        try:
            got = list(self.stub.Complete(request, timeout=CALL_TIMEOUT_S).token_ids)
        except grpc.RpcError as exc:
            self.failures.append(f"{exc.code().name}: {exc.details()}")
            return
        self.runs += 1
        if got != self.expected:
            self.failures.append(f"canary output {got} != reference {self.expected}")

    def _loop(self) -> None:
        while not self._stop.wait(2.0):
            self.check_once()

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT_S)


class Fuzzed:
    def __init__(self, background: BackgroundLoop, stack, tiny_target_dir) -> None:
        self.background = background
        self.stack = stack
        self.vocab = stack.target.info.vocab_size
        self.max_context = stack.target.info.max_context
        self.fingerprint = stack.target.info.vocab_fingerprint
        self.channels = {
            "coordinator": grpc.insecure_channel(stack.address),
            "target": grpc.insecure_channel(stack.target_servers[0].address),
            "draft": grpc.insecure_channel(stack.draft_server.address),
        }
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(self.channels["coordinator"])
        self.target = worker_pb2_grpc.TargetWorkerStub(self.channels["target"])
        self.draft = worker_pb2_grpc.DraftWorkerStub(self.channels["draft"])
        self.reference = reference_greedy(
            tiny_target_dir, CANARY_PROMPT, CANARY_NEW_TOKENS, eos=None
        )

    def serving(self) -> dict[str, int]:
        return {
            name: health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            .status
            for name, channel in self.channels.items()
        }

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


@pytest.fixture(scope="module")
def quiet_logs():
    """Thousands of refusals are logged at info; keep warnings and errors only."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="module")
def fuzzed(tiny_target_dir, tiny_draft_other_dir, quiet_logs):
    background = BackgroundLoop()
    # Small budgets, so that a fuzzed session can also hit RESOURCE_EXHAUSTED.
    limits = WorkerLimits(max_sessions=16, max_cached_tokens=4096)
    stack_cm = running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, k=2, eos_token_ids={NO_EOS}, limits=limits
    )
    stack = background.run(stack_cm.__aenter__())
    fuzzed = Fuzzed(background, stack, tiny_target_dir)
    try:
        with Canary(fuzzed.coordinator, fuzzed.reference) as fuzzed.canary:
            yield fuzzed
    finally:
        fuzzed.close()
        background.run(stack_cm.__aexit__(None, None, None))
        background.stop()


def check_refusal(error: grpc.RpcError, what: str) -> None:
    code, details = error.code(), error.details() or ""
    assert code in REFUSALS, f"{what}: {code.name}: {details}"
    assert details.strip(), f"{what}: {code.name} without a message"
    assert not any(marker in details for marker in TRACEBACK_MARKERS), f"{what}: {details}"


# --- strategies ------------------------------------------------------------------------
#
# Every field has a *valid* strategy (values the tiny stack serves: vocabulary
# and context of 512, K up to 16) and a *wild* one (anything its type can
# carry: NaN, infinities, negatives, huge numbers, odd unicode, oversized
# lists). A case is all valid, valid but for one wild field (each field's
# check on its own), or all wild. Big values come from a drawn size (``.map``),
# which costs hypothesis one draw instead of thousands.

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOAT32 = st.floats(width=32)  # NaN and the infinities included
ODD_TEXT = st.text(max_size=12) | st.sampled_from(
    ["", " ", "\x00", "\u202e", "😀😀", "a\nb", "\ufffd", "é" * 300, "<|im_end|>", "\x1b[31m"]
)
PRINTABLE = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=16)
ROLES = ("system", "user", "assistant", "tool")


def valid_ids(vocab: int, *, min_size: int = 0, max_size: int = 8) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size)


def wild_ids(vocab: int) -> st.SearchStrategy[list[int]]:
    return (
        st.lists(INT32 | st.integers(0, vocab - 1), max_size=6)
        | st.integers(0, 700).map(lambda n: [n % vocab] * n)  # up to past the context
        | st.just([])
    )


def chat(roles, contents, *, min_size: int) -> st.SearchStrategy[cpb.ChatMessages]:
    message = st.builds(cpb.ChatMessage, role=roles, content=contents)
    return st.lists(message, min_size=min_size, max_size=3).map(
        lambda m: cpb.ChatMessages(messages=m)
    )


@functools.cache
def request_fields(vocab: int) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    """field -> (valid, wild)."""
    return {
        "prompt": (
            st.tuples(st.just("text"), st.text(min_size=1, max_size=24))
            | st.tuples(
                st.just("chat"), chat(st.sampled_from(ROLES), st.text(max_size=12), min_size=1)
            )
            | st.tuples(st.just("token_ids"), valid_ids(vocab, min_size=1, max_size=16)),
            st.tuples(st.just("text"), ODD_TEXT | st.integers(0, 2000).map(lambda n: "ab " * n))
            | st.tuples(
                st.just("chat"), chat(st.sampled_from(ROLES) | ODD_TEXT, ODD_TEXT, min_size=0)
            )
            | st.tuples(st.just("token_ids"), wild_ids(vocab))
            | st.just(("none", None)),
        ),
        # Valid: mostly 1 or 2 tokens (quick), now and then 8, which leaves
        # pipelined rounds room to speculate. Wild values are past the context
        # (512) with any prompt, but 0: the server's default of 64 tokens, a
        # second's work here, so it is rare.
        "max_new_tokens": (
            st.sampled_from([1, 2] * 4 + [8]),
            st.sampled_from([0] + [512, 513, 10**6, 2**32 - 1] * 10),
        ),
        "stop": (
            st.lists(st.text(min_size=1, max_size=4), max_size=2),
            st.lists(ODD_TEXT, max_size=3) | st.integers(0, 40).map(lambda n: ["s"] * n),
        ),
        "stop_token_ids": (
            valid_ids(vocab, max_size=3),
            st.lists(INT32, max_size=4) | st.integers(0, 100).map(lambda n: list(range(n))),
        ),
        "ignore_eos": (st.booleans(), st.booleans()),
        "temperature": (
            st.sampled_from([0.0, 0.0, 1.0]) | st.floats(0.0625, 4.0, width=32),
            FLOAT32,
        ),
        "top_k": (st.integers(0, 600), UINT32),
        "top_p": (st.none() | st.floats(0.0625, 1.0, width=32), st.none() | FLOAT32),
        "min_p": (st.just(0.0) | st.floats(0.0, 0.5, width=32), FLOAT32),
        "seed": (st.none() | UINT64, st.none() | UINT64),
        "num_speculative_tokens": (st.none() | st.integers(0, 4) | st.just(16), UINT32),
        "verification": (st.integers(0, 3), INT32),
        "adaptive": (st.booleans(), st.booleans()),
        # Unset: the server's default (synchronous here).
        "pipeline": (st.none() | st.booleans(), st.none() | st.booleans()),
        "request_id": (
            st.just("") | PRINTABLE,
            ODD_TEXT | st.integers(100, 300).map(lambda n: "r" * n),
        ),
    }


@st.composite
def generate_requests(draw, vocab: int) -> cpb.GenerateRequest:
    fields = request_fields(vocab)
    mode = draw(st.sampled_from(["valid", "one wild field", "wild"]))
    wild_field = draw(st.sampled_from(sorted(fields))) if mode == "one wild field" else None

    def value(name: str):
        valid, wild = fields[name]
        return draw(wild if mode == "wild" or name == wild_field else valid)

    request = cpb.GenerateRequest(request_id=value("request_id"))
    kind, prompt = value("prompt")
    if kind == "text":
        request.text = prompt
    elif kind == "chat":
        request.chat.CopyFrom(prompt)
    elif kind == "token_ids":
        request.token_ids.ids.extend(prompt)
        request.token_ids.SetInParent()

    sampling = request.sampling
    sampling.max_new_tokens = value("max_new_tokens")
    sampling.stop.extend(value("stop"))
    sampling.stop_token_ids.extend(value("stop_token_ids"))
    sampling.ignore_eos = value("ignore_eos")
    sampling.temperature = value("temperature")
    sampling.top_k = value("top_k")
    sampling.min_p = value("min_p")
    if (top_p := value("top_p")) is not None:
        sampling.top_p = top_p
    if (seed := value("seed")) is not None:
        sampling.seed = seed

    speculation = request.speculation
    if (k := value("num_speculative_tokens")) is not None:
        speculation.num_speculative_tokens = k
    speculation.verification = value("verification")
    speculation.adaptive = value("adaptive")
    if (pipeline := value("pipeline")) is not None:
        speculation.pipeline = pipeline
    return request


def worker_sampling(draw) -> wpb.Sampling:
    fields = request_fields(vocab=2)
    wild = draw(st.booleans())

    def value(name: str):
        return draw(fields[name][wild])

    return wpb.Sampling(
        temperature=value("temperature"),
        top_k=value("top_k"),
        top_p=value("top_p") or 0.0,
        min_p=value("min_p"),
        seed=value("seed") or 0,
        verification=value("verification"),
    )


def session_open(draw, fuzzed: Fuzzed) -> wpb.SessionOpen:
    vocab = fuzzed.vocab
    return wpb.SessionOpen(
        token_ids=draw(valid_ids(vocab, min_size=1, max_size=12) | wild_ids(vocab)),
        request_id=draw(st.just("") | PRINTABLE | ODD_TEXT),
        target_vocab_size=draw(st.sampled_from([0, vocab, vocab]) | UINT32),
        target_vocab_fingerprint=draw(
            st.sampled_from(["", fuzzed.fingerprint, fuzzed.fingerprint]) | ODD_TEXT
        ),
        sampling=worker_sampling(draw),
    )


def committed_len(draw, expected: int) -> int:
    return draw(st.sampled_from([expected] * 4 + [expected + 1, max(0, expected - 1)]) | UINT32)


def draft_probs(draw, fuzzed: Fuzzed, k: int) -> list[wpb.DraftProbs]:
    rows = draw(st.sampled_from(["none", "dense", "sparse", "garbage"]))
    if rows == "none":
        return []
    count = draw(st.sampled_from([k, k, k + 1, max(0, k - 1)]))
    dense_bytes = 2 * fuzzed.vocab
    out = []
    for _ in range(count):
        if rows == "dense":
            out.append(
                wpb.DraftProbs(probs=draw(st.binary(min_size=dense_bytes, max_size=dense_bytes)))
            )
        elif rows == "sparse":
            ids = sorted(set(draw(valid_ids(fuzzed.vocab, min_size=1, max_size=6))))
            out.append(
                wpb.DraftProbs(
                    token_ids=b"".join(i.to_bytes(4, "little") for i in ids),
                    probs=draw(st.binary(min_size=2 * len(ids), max_size=2 * len(ids))),
                )
            )
        else:
            out.append(
                wpb.DraftProbs(
                    token_ids=draw(st.binary(max_size=12)), probs=draw(st.binary(max_size=12))
                )
            )
    return out


# --- one fuzzed session ------------------------------------------------------------


class SessionCall:
    """A worker session driven one message at a time from the test's thread."""

    def __init__(self, session_rpc) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._call = session_rpc(iter(self._requests.get, None), timeout=CALL_TIMEOUT_S)

    def exchange(self, request):
        self._requests.put(request)
        return next(self._call)

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


def fuzz_session(data, fuzzed: Fuzzed, role: str) -> None:
    draw = data.draw
    call = SessionCall(fuzzed.draft.Session if role == "draft" else fuzzed.target.Session)
    Request = wpb.DraftRequest if role == "draft" else wpb.VerifyRequest
    committed = None  # the committed length the worker holds, once open
    try:
        for step in range(draw(st.integers(1, MESSAGES_PER_SESSION))):
            kind = draw(
                st.sampled_from(["open", "round", "round", "round", "empty"])
                if committed is not None
                else st.sampled_from(["open", "open", "open", "round", "empty"])
            )
            if kind == "open":
                request = Request(open=session_open(draw, fuzzed))
            elif kind == "empty":
                request = Request()
            elif role == "draft":
                new = draw(valid_ids(fuzzed.vocab, max_size=4) | wild_ids(fuzzed.vocab))
                length = committed_len(draw, (committed or 0) + len(new))
                k = draw(st.integers(1, 5) | st.sampled_from([0, 17]) | UINT32)
                round_ = wpb.DraftRound(
                    committed_len=length, new_token_ids=new, num_speculative_tokens=k
                )
                if draw(
                    st.booleans()
                ):  # a speculation (pipelined rounds), after valid or wild assumed drafts
                    round_.speculate = True
                    round_.assumed_token_ids.extend(
                        draw(valid_ids(fuzzed.vocab, max_size=5) | wild_ids(fuzzed.vocab))
                    )
                request = Request(round=round_)
            else:
                drafts = draw(valid_ids(fuzzed.vocab, max_size=6) | wild_ids(fuzzed.vocab))
                request = Request(
                    round=wpb.VerifyRound(
                        committed_len=committed_len(draw, committed or 0),
                        draft_token_ids=drafts,
                        draft_probs=draft_probs(draw, fuzzed, len(drafts)),
                    )
                )
            try:
                response = call.exchange(request)
            except grpc.RpcError as error:
                check_refusal(error, f"{role} step {step}: {request}"[:2000])
                return
            except StopIteration:
                pytest.fail(f"{role} ended the stream without a status after {request}"[:2000])
            which = response.WhichOneof("kind")
            if which == "opened":
                committed = response.opened.committed_len
            elif which == "verdict":
                verdict = response.verdict
                assert verdict.num_accepted <= len(request.round.draft_token_ids)
                assert 0 <= verdict.next_token_id < fuzzed.vocab
                committed = request.round.committed_len + verdict.num_accepted + 1
            else:
                assert all(0 <= t < fuzzed.vocab for t in response.proposal.draft_token_ids)
                assert (
                    len(response.proposal.draft_token_ids) <= request.round.num_speculative_tokens
                )
                committed = request.round.committed_len
    finally:
        call.close()


# --- the tests ---------------------------------------------------------------------


def count(name: str) -> None:
    counts[name] = counts.get(name, 0) + 1


def test_fuzzed_coordinator_requests_get_a_result_or_a_refusal(fuzzed):
    @settings(max_examples=COORDINATOR_CASES, **FUZZ_SETTINGS)
    @given(request=generate_requests(fuzzed.vocab), streaming=st.booleans())
    def case(request, streaming):
        count("coordinator")
        try:
            if streaming:
                responses = list(fuzzed.coordinator.Generate(request, timeout=CALL_TIMEOUT_S))
                assert responses and responses[-1].finish_reason != cpb.FINISH_REASON_UNSPECIFIED
                stats = responses[-1].stats
            else:
                response = fuzzed.coordinator.Complete(request, timeout=CALL_TIMEOUT_S)
                assert response.finish_reason != cpb.FINISH_REASON_UNSPECIFIED
                stats = response.stats
        except grpc.RpcError as error:
            check_refusal(error, str(request)[:2000])
            return
        if stats.pipeline:
            pipelined["requests"] += 1
            pipelined["speculated"] += stats.speculation_hits + stats.speculation_misses > 0

    case()
    # The fuzzing went through the pipelined loop, speculations included.
    assert pipelined["speculated"] > 0, pipelined


@pytest.mark.parametrize("role, cases", [("draft", DRAFT_CASES), ("target", TARGET_CASES)])
def test_fuzzed_worker_sessions_get_answers_or_refusals(fuzzed, role, cases):
    @settings(max_examples=cases, **FUZZ_SETTINGS)
    @given(data=st.data())
    def case(data):
        count(role)
        fuzz_session(data, fuzzed, role)

    case()
    assert set(fuzzed.serving().values()) == {health_pb2.HealthCheckResponse.SERVING}
    assert fuzzed.background.run(fuzzed.stack.sessions_left()) == (0, 0)


def test_after_the_fuzzing_all_is_well(fuzzed, capsys):
    """Runs last: every service SERVING, no session or cached token left, the
    canary never failed and still gives the reference, and all cases ran."""
    canary = fuzzed.canary
    canary.stop()
    canary.check_once()
    assert canary.failures == [], canary.failures[:5]
    assert set(fuzzed.serving().values()) == {health_pb2.HealthCheckResponse.SERVING}
    stack = fuzzed.stack
    assert fuzzed.background.run(stack.sessions_left()) == (0, 0)
    assert stack.target.store.cached_tokens == 0 and stack.draft.store.cached_tokens == 0
    total = sum(counts.values())
    with capsys.disabled():
        print(
            f"\nfuzz cases: {counts}, {total} in total; pipelined results: {pipelined}; "
            f"canary generations: {canary.runs}"
        )
    # hypothesis stops early only when it runs out of distinct cases; it must not here.
    assert total >= COORDINATOR_CASES + DRAFT_CASES + TARGET_CASES >= 10_000, counts
