"""The round loop in one process: engines behind the in-process clients, no
gRPC. Same loop code as across three processes."""

import pytest
from transformers import AutoTokenizer

from coordinator.loop import GenerationRequest, Models, generate
from draft_worker.main import build_sessions as build_draft_sessions
from outrider.config import DraftWorkerConfig, EngineConfig, ServiceConfig, TargetWorkerConfig
from outrider.worker import start_engine
from target_worker.main import build_sessions as build_target_sessions
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
