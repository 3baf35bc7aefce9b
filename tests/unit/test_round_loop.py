"""The round loop in one process: engines behind the in-process clients, no
gRPC. Same loop code as across three processes."""

import pytest
from transformers import AutoTokenizer

from coordinator.loop import GenerationRequest, Models, generate
from coordinator.workers import InProcessDraftClient, InProcessTargetClient
from draft_worker.main import build_engine as build_draft_engine
from outrider.config import DraftWorkerConfig, ServiceAddress, TargetWorkerConfig
from outrider.engine_thread import EngineThread
from target_worker.main import build_engine as build_target_engine
from tests.integration.harness import reference_greedy


@pytest.fixture
async def clients(tiny_target_dir, tiny_draft_other_dir):
    target_thread, draft_thread = EngineThread(), EngineThread()
    address = ServiceAddress()
    target_engine = build_target_engine(TargetWorkerConfig(address, model=str(tiny_target_dir), dtype="float64"))
    draft_engine = build_draft_engine(
        DraftWorkerConfig(address, drafter="model", model=str(tiny_draft_other_dir), dtype="float64")
    )
    yield InProcessTargetClient(target_engine, target_thread), InProcessDraftClient(draft_engine, draft_thread)
    target_thread.shutdown()
    draft_thread.shutdown()


async def run(request, models, target, draft):
    return [delta async for delta in generate(request, models, target, draft)]


@pytest.mark.parametrize("k", [0, 3])
async def test_in_process_loop_matches_target_only(clients, tiny_target_dir, k):
    target, draft = clients
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    prompt = tokenizer("Once upon a time")["input_ids"]
    models = Models(tokenizer, frozenset(), await target.info())
    request = GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=24, num_speculative_tokens=k)
    deltas = await run(request, models, target, draft)
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == reference_greedy(tiny_target_dir, prompt, 24, eos=None)
    final = deltas[-1]
    assert final.finish_reason == "length" and final.stats.generated_tokens == 24
    assert "".join(d.text for d in deltas) == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
    # Closes are queued on the engine threads; once a later call has run, they have too.
    await target.thread.run(lambda: None)
    await draft.thread.run(lambda: None)
    assert len(target.engine.store) == 0 and len(draft.engine.store) == 0
