"""Many sessions at once through real gRPC services on tiny float64 models:
the workers batch every session's work into shared forward passes, and
still each session gets exactly its own target-only output, whatever the
drafter and K, whenever it starts and ends; a long prompt prefilled in
chunks mid-flight changes nothing; and when every stream has ended — done,
cancelled or failed — both workers hold no session and no KV block."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from outrider.client import AsyncClient
from outrider.config import EngineConfig
from tests.integration.harness import reference_greedy, running_stack

NO_EOS = -1
VOCAB = 512


def prompts(count: int, *, seed: int = 0, lengths=(3, 60)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def steps_with_more_rows_than(stack, worker: str, rows: int) -> int:
    """Engine steps of a worker that ran more than ``rows`` sessions at once (its metrics)."""
    registry = stack.metrics[worker].registry
    total = registry.get_sample_value("outrider_worker_step_rows_count")
    return total - registry.get_sample_value(
        "outrider_worker_step_rows_bucket", {"le": f"{float(rows)}"}
    )


# K per session: fixed 0, 1, 4, 8, and adaptive (up to 4).
SPECULATION = [dict(num_speculative_tokens=k) for k in (0, 1, 4, 8)] + [
    dict(num_speculative_tokens=4, adaptive=True)
]


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup"])
async def test_concurrent_sessions_each_get_their_solo_target_only_output(
    tiny_target_dir, tiny_draft_other_dir, drafter
):
    cases = [
        (prompt, 8 + 7 * i, SPECULATION[i % len(SPECULATION)])
        for i, prompt in enumerate(prompts(10, seed=1))
    ]
    references = [reference_greedy(tiny_target_dir, p, n, eos=None) for p, n, _ in cases]
    draft_dir = tiny_draft_other_dir if drafter == "model" else None
    async with running_stack(
        tiny_target_dir, drafter=drafter, draft_dir=draft_dir, eos_token_ids={NO_EOS}, metrics=True
    ) as stack:
        async with AsyncClient(stack.address, timeout=120) as client:

            async def session(i: int):
                await asyncio.sleep(
                    0.02 * i
                )  # sessions join mid-flight, and end at different times
                prompt, n, speculation = cases[i]
                return await client.generate(token_ids=prompt, max_new_tokens=n, **speculation)

            results = await asyncio.gather(*(session(i) for i in range(len(cases))))
        for result, reference, (_, _, speculation) in zip(results, references, cases, strict=True):
            assert list(result.token_ids) == reference, speculation
            assert result.finish_reason == "length"
        assert any(
            r.stats.draft_tokens > r.stats.accepted_tokens for r in results
        )  # rollbacks happened
        assert (
            steps_with_more_rows_than(stack, "target", 2) > 0
        )  # rounds of several sessions verified in one pass
        if drafter == "model":
            assert steps_with_more_rows_than(stack, "draft", 2) > 0  # draft steps batched too
        assert await stack.sessions_left() == (0, 0)


@pytest.mark.parametrize("verification", ["rejection", "gumbel"])
async def test_a_seeded_request_gives_the_same_tokens_alone_and_among_eight(
    tiny_target_dir, tiny_draft_other_dir, verification
):
    cases = prompts(8, seed=2, lengths=(4, 30))
    sampling = dict(
        temperature=0.9,
        top_p=0.95,
        verification=verification,
        max_new_tokens=24,
        num_speculative_tokens=3,
    )
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address, timeout=120) as client:
            alone = [
                await client.generate(token_ids=p, seed=100 + i, **sampling)
                for i, p in enumerate(cases)
            ]
            together = await asyncio.gather(
                *(
                    client.generate(token_ids=p, seed=100 + i, **sampling)
                    for i, p in enumerate(cases)
                )
            )
    assert [list(r.token_ids) for r in together] == [list(r.token_ids) for r in alone]
    assert len({tuple(r.token_ids) for r in alone}) == len(
        cases
    )  # really sampled, not one fixed output


async def test_a_long_prompt_arriving_mid_flight_is_chunked_and_changes_no_running_output(
    tiny_target_dir, tiny_draft_other_dir
):
    budget = 16
    running = prompts(4, seed=3, lengths=(5, 12))
    long_prompt = prompts(1, seed=4, lengths=(400, 400))[0]
    references = [reference_greedy(tiny_target_dir, p, 40, eos=None) for p in running]
    long_reference = reference_greedy(tiny_target_dir, long_prompt, 10, eos=None)
    engine = EngineConfig(dtype="float64", threads=1, max_tokens_per_step=budget)
    async with running_stack(
        tiny_target_dir,
        draft_dir=tiny_draft_other_dir,
        eos_token_ids={NO_EOS},
        engine=engine,
        metrics=True,
    ) as stack:
        async with AsyncClient(stack.address, timeout=120) as client:
            first_chunks = asyncio.Event()

            async def run(prompt: list[int]) -> list[int]:
                tokens = []
                async for chunk in client.stream(
                    token_ids=prompt, max_new_tokens=40, num_speculative_tokens=4
                ):
                    tokens += chunk.token_ids
                    first_chunks.set()
                return tokens

            tasks = [asyncio.ensure_future(run(p)) for p in running]
            await first_chunks.wait()
            long = await client.generate(
                token_ids=long_prompt, max_new_tokens=10, num_speculative_tokens=4
            )
            outputs = await asyncio.gather(*tasks)
        registry = stack.metrics["target"].registry
        steps = registry.get_sample_value("outrider_iteration_tokens_total_count")
        within_budget = registry.get_sample_value(
            "outrider_iteration_tokens_total_bucket", {"le": str(float(budget))}
        )
    assert outputs == references
    assert list(long.token_ids) == long_reference
    assert steps == within_budget  # the 399-token prefill ran in chunks of at most the budget
    assert steps > len(long_prompt) // budget


async def test_after_streams_end_done_cancelled_or_failed_no_session_or_block_is_left(
    tiny_target_dir, tiny_draft_other_dir
):
    cases = prompts(12, seed=5, lengths=(5, 40))
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address, timeout=120) as client:

            async def done(prompt):
                await client.generate(token_ids=prompt, max_new_tokens=30, num_speculative_tokens=4)

            async def cancelled(prompt):
                async for _ in client.stream(
                    token_ids=prompt, max_new_tokens=400, num_speculative_tokens=4
                ):
                    break  # the client walks away mid-stream

            async def failed(prompt):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in client.stream(
                        token_ids=prompt, max_new_tokens=400, num_speculative_tokens=4, timeout=0.3
                    ):
                        pass
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            kinds = [done, cancelled, failed]
            await asyncio.gather(*(kinds[i % 3](p) for i, p in enumerate(cases)))
        assert await stack.sessions_left() == (0, 0)
        for worker in (stack.target, stack.draft):
            await asyncio.sleep(0)
            assert worker.store.cached_tokens == 0
            assert worker.store.pool.free_blocks == worker.store.pool.num_blocks


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A random GPT-2 (float64) with the tiny tokenizer: not of the Llama family."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=512,
        eos_token_id=2,
        bos_token_id=2,
    )
    model = GPT2LMHeadModel(config).to(torch.float64)
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0, 0.5)  # spread logits: no near-ties
    model.save_pretrained(path)
    for file in tiny_tokenizer_dir.iterdir():
        shutil.copyfile(file, path / file.name)
    return path


async def test_a_model_outside_the_llama_family_still_serves_through_the_fallback_runner(
    tiny_gpt2_dir,
):
    from outrider.engine.runner import FallbackRunner

    cases = prompts(4, seed=6, lengths=(3, 30))
    references = [reference_greedy(tiny_gpt2_dir, p, 12, eos=None) for p in cases]
    async with running_stack(
        tiny_gpt2_dir, drafter="prompt-lookup", eos_token_ids={NO_EOS}
    ) as stack:
        assert isinstance(stack.target.runner, FallbackRunner)
        async with AsyncClient(stack.address, timeout=120) as client:
            results = await asyncio.gather(
                *(
                    client.generate(token_ids=p, max_new_tokens=12, num_speculative_tokens=3)
                    for p in cases
                )
            )
        assert [list(r.token_ids) for r in results] == references
        assert await stack.sessions_left() == (0, 0)
        assert stack.target.store.pool.free_blocks == stack.target.store.pool.num_blocks


async def test_int4_draft_steps_batched_across_sessions_propose_what_each_session_proposes_alone(
    tiny_target_dir,
):
    from outrider.config import DraftWorkerConfig, ServiceConfig
    from outrider.draft_worker import main as draft_main
    from outrider.worker import open_worker

    config = DraftWorkerConfig(
        service=ServiceConfig(),
        drafter="int4",
        model=str(tiny_target_dir),
        engine=EngineConfig(dtype="float64", threads=1),
    )
    rows = []
    draft, engine, warm_up = await open_worker(
        draft_main.ROLE, config, on_step=lambda step: rows.append(step.rows)
    )
    histories = prompts(8, seed=5)

    async def propose(i: int, tag: str) -> list[int]:
        session = f"{tag}-{i}"
        await engine.run(draft.open, session, histories[i], 0, "")
        drafts = await engine.run(draft.propose, session, len(histories[i]), [], 6)
        await engine.run(draft.close, session)
        return drafts.tokens

    try:
        await warm_up()
        alone = [await propose(i, "alone") for i in range(len(histories))]
        rows.clear()
        together = await asyncio.gather(*(propose(i, "together") for i in range(len(histories))))
    finally:
        engine.shutdown()
    assert max(rows) > 2  # the sessions' draft steps shared forward passes
    assert together == alone
    assert len(draft.store) == 0


async def test_a_speculation_proposes_what_a_round_after_its_assumption_would(
    tiny_target_dir, tiny_draft_other_dir
):
    """Pipelined rounds (docs/design.md#pipelined-rounds): a speculation assumes the drafts under
    verification, guesses the bonus token, and drafts after the guess —
    exactly what a fresh round after that history proposes; when the
    assumption holds, the next round syncs it from the cache the
    speculation left, and when it fails, rolls back to the committed part."""
    from outrider.config import DraftWorkerConfig, ServiceConfig
    from outrider.draft_worker import main as draft_main
    from outrider.worker import open_worker

    config = DraftWorkerConfig(
        service=ServiceConfig(),
        drafter="model",
        model=str(tiny_draft_other_dir),
        engine=EngineConfig(dtype="float64", threads=1),
    )
    draft, engine, warm_up = await open_worker(draft_main.ROLE, config)
    (history,) = prompts(1, seed=7)
    try:
        await warm_up()
        await engine.run(draft.open, "fresh", history, 0, "")
        first = await engine.run(draft.propose, "fresh", len(history), [], 4)
        assumed = first.tokens[:3]
        whole = await engine.run(draft.propose, "fresh", len(history), [], 8)
        # Its guess and drafts: what a fresh round drafts after history + assumed.
        await engine.run(draft.open, "spec", history, 0, "")
        speculation = await engine.run(draft.propose, "spec", len(history), [], 4, assumed)
        await engine.run(draft.open, "after", [*history, *assumed], 0, "")
        after = await engine.run(draft.propose, "after", len(history) + 3, [], 5)
        assert [speculation.guess, *speculation.tokens] == after.tokens
        assert speculation.follows_len == len(history) + 4 and after.follows_len == len(history) + 3
        assert whole.tokens[:8] == [*first.tokens, *whole.tokens[4:8]]  # greedy: the same path
        # A hit: the next round's new tokens are the assumption and the guess.
        committed = [*history, *assumed, speculation.guess]
        hit = await engine.run(
            draft.propose, "spec", len(committed), [*assumed, speculation.guess], 4
        )
        await engine.run(draft.open, "hit", committed, 0, "")
        assert hit.tokens == (await engine.run(draft.propose, "hit", len(committed), [], 4)).tokens
        # A miss: the target took 1 of the assumed drafts and corrected the next.
        await engine.run(draft.open, "miss", history, 0, "")
        await engine.run(draft.propose, "miss", len(history), [], 4, assumed)
        correction = (assumed[1] + 1) % 256
        miss = await engine.run(
            draft.propose, "miss", len(history) + 2, [assumed[0], correction], 4
        )
        await engine.run(draft.open, "fresh-miss", [*history, assumed[0], correction], 0, "")
        assert (
            miss.tokens
            == (await engine.run(draft.propose, "fresh-miss", len(history) + 2, [], 4)).tokens
        )
        for session in ("fresh", "spec", "after", "hit", "miss", "fresh-miss"):
            await engine.run(draft.close, session)
    finally:
        engine.shutdown()
    assert len(draft.store) == 0


@pytest.mark.parametrize("concurrency", [1, 8])
async def test_rounds_trimmed_to_a_full_step_still_give_the_target_only_output(
    tiny_target_dir, tiny_draft_same_dir, concurrency
):
    # A target whose steps hold 3 tokens verifies a prefix of every round's
    # drafts (x_n and 2 of 4), alone or with seven other streams queued for
    # its steps. (A budget that fits some rounds whole trims only when rounds
    # happen to meet in a step, which depends on timing.)
    budget = 3
    cases = prompts(concurrency, seed=3, lengths=(4, 20))
    references = [reference_greedy(tiny_target_dir, p, 24, eos=None) for p in cases]
    engine = EngineConfig(dtype="float64", threads=1, max_tokens_per_step=budget)
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}, engine=engine, k=4
    ) as stack:
        async with AsyncClient(stack.address, timeout=120) as client:
            results = await asyncio.gather(
                *(client.generate(token_ids=p, max_new_tokens=24) for p in cases)
            )
        assert await stack.sessions_left() == (0, 0)
    assert [list(r.token_ids) for r in results] == references
    proposed = sum(r.stats.proposed_tokens for r in results)
    verified = sum(r.stats.draft_tokens for r in results)
    assert 0 < verified < proposed  # trimmed, and the verified drafts were accepted
    assert sum(r.stats.accepted_tokens for r in results) == verified
