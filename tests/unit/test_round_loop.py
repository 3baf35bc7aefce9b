"""The round loop in one process: engines behind the in-process clients, no
gRPC. Same loop code as across three processes."""

import asyncio
import dataclasses

import pytest
from transformers import AutoTokenizer

from outrider.config import (
    DraftWorkerConfig,
    EngineConfig,
    ServiceConfig,
    TargetWorkerConfig,
)
from outrider.coordinator.adaptive.cost_model import CostModel, CostModels
from outrider.coordinator.adaptive.session import AdaptiveK
from outrider.coordinator.requests import GenerationRequest
from outrider.coordinator.round_loop import generate
from outrider.coordinator.served_models import Models
from outrider.draft_worker.main import build_sessions as build_draft_sessions
from outrider.errors import Unavailable
from outrider.target_worker.main import build_sessions as build_target_sessions
from outrider.worker import start_engine
from tests.inprocess import InProcessDraftClient, InProcessTargetClient
from tests.integration.harness import reference_greedy


@pytest.fixture
async def clients(tiny_target_dir, tiny_draft_other_dir):
    address, engine = ServiceConfig(), EngineConfig(dtype="float64", threads=1)
    target = build_target_sessions(
        TargetWorkerConfig(address, model=str(tiny_target_dir), engine=engine)
    )
    draft = build_draft_sessions(
        DraftWorkerConfig(address, drafter="model", model=str(tiny_draft_other_dir), engine=engine)
    )
    target_engine, draft_engine = (
        start_engine(target, engine, max_rows=8),
        start_engine(draft, engine, max_rows=8),
    )
    yield InProcessTargetClient(target, target_engine), InProcessDraftClient(draft, draft_engine)
    target_engine.shutdown()
    draft_engine.shutdown()


async def run(request, models, target, draft):
    return [delta async for delta in generate(request, models, target, draft)]


async def drafting_models(clients, tiny_target_dir) -> Models:
    """The models of the in-process target and its draft (on the same cores)."""
    target, draft = clients
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    return Models(tokenizer, frozenset(), await target.info(), await draft.info())


@pytest.mark.parametrize("k", [0, 3])
async def test_in_process_loop_matches_target_only(clients, tiny_target_dir, k):
    target, draft = clients
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    prompt = tokenizer("Once upon a time")["input_ids"]
    models = Models(tokenizer, frozenset(), await target.info())
    request = GenerationRequest(
        prompt_ids=tuple(prompt), max_new_tokens=24, num_speculative_tokens=k
    )
    deltas = await run(request, models, target, draft)
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == reference_greedy(tiny_target_dir, prompt, 24, eos=None)
    final = deltas[-1]
    assert final.finish_reason == "length" and final.stats.generated_tokens == 24
    assert (
        "".join(d.text for d in deltas)
        == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
    )
    # Closes are queued on the engines; once a later call has run, they have too.
    await target.engine.run(lambda: None)
    await draft.engine.run(lambda: None)
    assert len(target.sessions.store) == 0 and len(draft.sessions.store) == 0


@pytest.mark.parametrize(
    "where, beside",
    [("apart", True), ("sharing CPU cores", False)],
)
async def test_the_draft_prefills_beside_the_target_unless_they_share_cpu_cores(
    clients, tiny_target_dir, where, beside
):
    """A draft model's prefill starts with the target's, so drafting can
    start at the second round; where the two run on CPUs (one host's cores),
    it starts once the first token is streamed, which then comes as fast as
    without a draft."""
    target, draft = clients
    events: list[str] = []
    target_open, draft_open = target.open, draft.open

    async def opening_target(*args, **kwargs):
        events.append("target open begins")
        try:
            return await target_open(*args, **kwargs)
        finally:
            events.append("target open ends")

    async def opening_draft(*args, **kwargs):
        events.append("draft open begins")
        return await draft_open(*args, **kwargs)

    target.open, draft.open = opening_target, opening_draft
    info = await target.info()
    draft_info = await draft.info()
    assert draft_info.dtype and info.device == draft_info.device == "cpu"
    if where == "apart":
        draft_info = dataclasses.replace(draft_info, device="cuda:0")
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    models = Models(tokenizer, frozenset(), info, draft_info)
    assert models.draft_prefills_beside == beside
    request = GenerationRequest(prompt_ids=(1, 2, 3, 4), max_new_tokens=8, num_speculative_tokens=3)
    deltas = []
    async for delta in generate(request, models, target, draft):
        await asyncio.sleep(0)  # the stream's write
        events.append("delta streamed")
        deltas.append(delta)
    assert sum(len(d.token_ids) for d in deltas) == 8
    draft_at = events.index("draft open begins")
    # (after: once the first token is on its way to the client)
    assert (draft_at > events.index("delta streamed")) != beside
    assert (draft_at > events.index("target open ends")) != beside


async def test_adaptive_rounds_stay_within_the_targets_cuda_graphs(clients, tiny_target_dir):
    """A verify of more tokens a row than the target's CUDA graphs hold runs
    eagerly, which its step curve cannot price: adaptive K stays below them."""
    target, draft = clients
    info = dataclasses.replace(await target.info(), graphed_tokens_per_row=3)
    models = Models(AutoTokenizer.from_pretrained(tiny_target_dir), frozenset(), info)
    request = GenerationRequest(
        prompt_ids=(1, 2, 3, 4), max_new_tokens=40, num_speculative_tokens=8, adaptive=True
    )
    deltas = await run(request, models, target, draft)
    stats = deltas[-1].stats
    assert stats.draft_tokens > 0  # it drafted, and never past K = 2
    assert len(stats.rounds_by_k) <= 3 and stats.num_speculative_tokens == 2


class TwoReplicas:
    """The in-process target as two replicas, ``a`` and ``b``: each open goes
    to the other, and a session on ``a`` is lost at its third verify."""

    def __init__(self, target: InProcessTargetClient) -> None:
        self.target = target
        self.opens = 0

    async def info(self, timeout_s: float = 10.0):
        return await self.target.info(timeout_s)

    async def open(self, tokens, **kwargs):
        session, reply = await self.target.open(tokens, **kwargs)
        session.address = "ab"[self.opens % 2]
        self.opens += 1
        if session.address == "a":
            verify, verifies = session.verify, [0]

            async def failing_verify(*args, **kwargs):
                verifies[0] += 1
                if verifies[0] == 3:
                    raise Unavailable("replica a is gone")
                return await verify(*args, **kwargs)

            session.verify = failing_verify
        return session, reply


async def test_a_session_is_planned_with_the_sessions_on_its_target_replica(
    clients, tiny_target_dir, monkeypatch
):
    """Sessions share steps only with those on their target replica: a
    session's K is planned in that replica's cost model, and one reopened on
    another replica moves to its model. What the drafts had accepted is the
    models', shared by every replica's."""
    target, draft = clients
    models = await drafting_models(clients, tiny_target_dir)
    costs = CostModels()
    planned_on: list[CostModel] = []
    choose = AdaptiveK.choose

    def recording(self, limit, **kwargs):
        planned_on.append(self.costs)
        assert self.key in self.costs.sessions
        return choose(self, limit, **kwargs)

    monkeypatch.setattr(AdaptiveK, "choose", recording)
    request = GenerationRequest(
        prompt_ids=(1, 2, 3), max_new_tokens=16, num_speculative_tokens=3, adaptive=True
    )
    deltas = [d async for d in generate(request, models, TwoReplicas(target), draft, costs)]
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == reference_greedy(tiny_target_dir, [1, 2, 3], 16, eos=None)
    on_a, on_b = costs.of("a"), costs.of("b")
    assert on_a is not on_b and on_a.acceptance is on_b.acceptance is costs.acceptance
    after_open = [c for c in planned_on if c is not costs.of("")]
    assert after_open[0] is on_a and after_open[-1] is on_b
    assert after_open == sorted(after_open, key=lambda c: c is on_b)  # a, then b for good
    assert on_a.target.steps and on_b.target.steps  # each taught by its replica's answers
    assert not on_a.sessions and not on_b.sessions
