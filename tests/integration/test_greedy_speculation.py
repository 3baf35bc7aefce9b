"""Greedy speculative decoding across three real gRPC services on tiny
float64 models: the output is target-only greedy decoding, token for token,
for every drafter and K, synchronous or pipelined; stops inside a
multi-token accept cut exactly; and no session outlives its stream."""

from __future__ import annotations

from itertools import pairwise

import grpc
import pytest

from outrider.client import AsyncClient
from outrider.config import WorkerLimits
from tests.integration.harness import reference_greedy, running_stack

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
MAX_NEW = 40
NO_EOS = -1  # an id no model emits: runs go to max_new_tokens


@pytest.fixture(scope="module")
def prompt_ids(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def reference(tiny_target_dir, prompt_ids):
    return reference_greedy(tiny_target_dir, prompt_ids, MAX_NEW, eos=None)


async def generate(address: str, prompt_ids, **kwargs):
    async with AsyncClient(address) as client:
        return await client.generate(token_ids=prompt_ids, **kwargs)


@pytest.mark.parametrize("k", [0, 1, 2, 4, 8])
async def test_unrelated_draft_output_equals_target_only(
    tiny_target_dir, tiny_draft_other_dir, prompt_ids, reference, k
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        result = await generate(
            stack.address, prompt_ids, max_new_tokens=MAX_NEW, num_speculative_tokens=k
        )
    assert list(result.token_ids) == reference
    assert result.finish_reason == "length"
    assert result.stats.num_speculative_tokens == k
    if k == 0:
        assert result.stats.rounds == MAX_NEW and result.stats.draft_tokens == 0


@pytest.mark.parametrize("k", [1, 4, 8])
async def test_identical_draft_accepts_every_draft(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference, k
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}
    ) as stack:
        result = await generate(
            stack.address, prompt_ids, max_new_tokens=MAX_NEW, num_speculative_tokens=k
        )
    stats = result.stats
    assert list(result.token_ids) == reference
    assert stats.accepted_tokens == stats.draft_tokens > 0
    assert stats.acceptance_rate == 1.0
    # The first token comes from the target's prefill; every later round
    # commits K + 1 tokens, except a last one shortened by max_new_tokens.
    assert stats.rounds == 1 + -(-(MAX_NEW - 1) // (k + 1))
    # The policy's choices: K = 0 for the prefill's token, then K (or what room is left).
    assert sum(stats.rounds_by_k) == stats.rounds and stats.rounds_by_k[0] >= 1
    assert stats.proposed_tokens == stats.draft_tokens
    assert stats.mean_acceptance_length == (stats.accepted_tokens + stats.rounds) / stats.rounds


async def test_unrelated_draft_is_almost_never_accepted(
    tiny_target_dir, tiny_draft_other_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        result = await generate(
            stack.address, prompt_ids, max_new_tokens=MAX_NEW, num_speculative_tokens=4
        )
    assert list(result.token_ids) == reference
    assert result.stats.acceptance_rate < 0.2
    assert len(result.stats.accepted_per_position) == 4
    # A draft is only accepted after all the drafts before it were.
    per_position = result.stats.accepted_per_position
    assert all(a >= b for a, b in pairwise(per_position))
    assert per_position[0] == result.stats.accepted_tokens - sum(per_position[1:])


async def test_prompt_lookup_drafter_output_equals_target_only(
    tiny_target_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir, drafter="prompt-lookup", eos_token_ids={NO_EOS}
    ) as stack:
        result = await generate(
            stack.address, prompt_ids, max_new_tokens=MAX_NEW, num_speculative_tokens=4
        )
    assert list(result.token_ids) == reference
    assert result.stats.draft_tokens > 0


@pytest.mark.parametrize("layers", [1, 2])
async def test_early_exit_drafter_output_equals_target_only(
    tiny_target_dir, prompt_ids, reference, layers
):
    async with running_stack(
        tiny_target_dir, drafter="early-exit", draft_layers=layers, eos_token_ids={NO_EOS}
    ) as stack:
        result = await generate(
            stack.address, prompt_ids, max_new_tokens=MAX_NEW, num_speculative_tokens=3
        )
    assert list(result.token_ids) == reference
    if layers == 2:  # all layers of a 2-layer target: the target itself
        assert result.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("k", [1, 4, 8])
async def test_int4_drafter_output_equals_target_only(tiny_target_dir, prompt_ids, reference, k):
    async with running_stack(tiny_target_dir, drafter="int4", eos_token_ids={NO_EOS}) as stack:
        async with AsyncClient(stack.address) as client:
            info = await client.model_info()
            result = await client.generate(
                token_ids=prompt_ids, max_new_tokens=MAX_NEW, num_speculative_tokens=k
            )
    assert list(result.token_ids) == reference
    assert info.drafter == "int4" and info.draft_model.endswith("[int4-g32]")
    # The target's own weights in 4 bits (its LM head in 8) agree with it on
    # most tokens (an unrelated draft gets under 0.2); that they are 4-bit
    # at all is tests/unit/test_quantize.py's.
    assert result.stats.acceptance_rate >= 0.6


# --- pipelined rounds: the draft drafts round i + 1 while the target verifies round i ---


@pytest.mark.parametrize("draft", ["identical", "unrelated"])
async def test_pipelined_output_equals_target_only(
    tiny_target_dir, tiny_draft_same_dir, tiny_draft_other_dir, prompt_ids, reference, draft
):
    workers = {
        "identical": dict(draft_dir=tiny_draft_same_dir),
        "unrelated": dict(draft_dir=tiny_draft_other_dir),
    }[draft]
    async with running_stack(tiny_target_dir, eos_token_ids={NO_EOS}, **workers) as stack:
        async with AsyncClient(stack.address) as client:
            runs = {
                k: await client.generate(
                    token_ids=prompt_ids,
                    max_new_tokens=MAX_NEW,
                    num_speculative_tokens=k,
                    pipeline=True,
                )
                for k in (1, 2, 4, 8)
            }
            runs["adaptive"] = await client.generate(
                token_ids=prompt_ids, max_new_tokens=MAX_NEW, adaptive=True, pipeline=True
            )
        assert await stack.sessions_left() == (0, 0)
    for k, result in runs.items():
        assert list(result.token_ids) == reference, f"K={k}"
        assert result.stats.pipeline
    stats = [runs[k].stats for k in (1, 2, 4, 8)]
    hits, misses = sum(s.speculation_hits for s in stats), sum(s.speculation_misses for s in stats)
    if draft == "identical":
        # Every drafting round after the first was drafted during the one before.
        assert all(
            s.speculation_hits == s.num_drafts - 1 and s.speculation_misses == 0 for s in stats
        )
        assert [s.accepted_tokens for s in stats] == [s.draft_tokens for s in stats]
    elif draft == "unrelated":
        assert misses > hits
    else:
        assert hits > 0 and misses > 0


async def test_pipelining_is_per_request_and_off_by_default(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            default = await client.generate(token_ids=prompt_ids, max_new_tokens=MAX_NEW)
            target_only = await client.generate(
                token_ids=prompt_ids,
                max_new_tokens=MAX_NEW,
                num_speculative_tokens=0,
                pipeline=True,
            )
    assert list(default.token_ids) == list(target_only.token_ids) == reference
    assert (
        not default.stats.pipeline
        and default.stats.speculation_hits == default.stats.speculation_misses == 0
    )
    assert not target_only.stats.pipeline  # nothing to pipeline without drafts


# --- stops inside a multi-token accept (identical draft, K = 8: every round commits 9) ---


@pytest.fixture
def same_stack(tiny_target_dir, tiny_draft_same_dir):
    def make(**kwargs):
        return running_stack(tiny_target_dir, draft_dir=tiny_draft_same_dir, k=8, **kwargs)

    return make


def assert_stats_describe_what_was_streamed(stats, token_ids) -> None:
    """Statistics count the tokens the client got, not drafts accepted past a stop."""
    assert stats.generated_tokens == len(token_ids)
    assert stats.mean_acceptance_length <= len(token_ids) / stats.rounds + 1e-12
    assert stats.accepted_tokens <= len(token_ids) - 1  # the first token is the prefill's
    assert sum(stats.accepted_per_position) == stats.accepted_tokens <= stats.draft_tokens


def first_new_token(reference: list[int], start: int) -> int:
    """The first token at or after ``start`` that does not occur before it."""
    return next(t for i, t in enumerate(reference) if i >= start and t not in reference[:i])


@pytest.mark.parametrize("pipeline", [False, True])
async def test_max_new_tokens_inside_an_accept_is_never_exceeded(
    same_stack, prompt_ids, reference, pipeline
):
    async with same_stack(eos_token_ids={NO_EOS}) as stack:
        first = await generate(stack.address, prompt_ids, max_new_tokens=5, pipeline=pipeline)
        second = await generate(stack.address, prompt_ids, max_new_tokens=14, pipeline=pipeline)
        assert await stack.sessions_left() == (0, 0)
    # The first token comes from the prefill; then rounds of 9 tokens, the
    # last one cut to what max_new_tokens allows.
    assert list(first.token_ids) == reference[:5] and first.stats.rounds == 2
    # Pipelined, the third round (4 of its 9 tokens allowed) is the speculated one.
    assert list(second.token_ids) == reference[:14] and second.stats.rounds == 3
    assert first.finish_reason == second.finish_reason == "length"
    assert second.stats.speculation_hits == pipeline
    for result in (first, second):
        assert_stats_describe_what_was_streamed(result.stats, result.token_ids)


# In the third round (after the prefill's token and a round of 9): pipelined,
# inside the speculated round.
@pytest.mark.parametrize("pipeline", [False, True])
async def test_eos_inside_an_accept_ends_the_output(same_stack, prompt_ids, reference, pipeline):
    eos = first_new_token(reference, 12)
    end = reference.index(eos) + 1
    async with same_stack(eos_token_ids={eos}) as stack:
        result = await generate(
            stack.address, prompt_ids, max_new_tokens=MAX_NEW, pipeline=pipeline
        )
        assert await stack.sessions_left() == (0, 0)
    assert list(result.token_ids) == reference[:end]
    assert result.finish_reason == "stop"
    assert result.stats.speculation_hits == pipeline
    assert_stats_describe_what_was_streamed(result.stats, result.token_ids)


@pytest.mark.parametrize("pipeline", [False, True])
async def test_stop_token_id_inside_an_accept_ends_the_output(
    same_stack, prompt_ids, reference, pipeline
):
    stop_id = first_new_token(reference, 11)
    end = reference.index(stop_id) + 1
    async with same_stack(eos_token_ids={NO_EOS}) as stack:
        result = await generate(
            stack.address,
            prompt_ids,
            max_new_tokens=MAX_NEW,
            stop_token_ids=[stop_id],
            pipeline=pipeline,
        )
        assert await stack.sessions_left() == (0, 0)
    assert list(result.token_ids) == reference[:end]
    assert result.finish_reason == "stop"
    assert_stats_describe_what_was_streamed(result.stats, result.token_ids)


@pytest.mark.parametrize("pipeline", [False, True])
async def test_stop_string_inside_an_accept_cuts_the_text(
    same_stack, tiny_target_dir, prompt_ids, reference, pipeline
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    full = tokenizer.decode(prompt_ids + reference)[len(tokenizer.decode(prompt_ids)) :]
    stop = full[40:43]  # past the first round's 9 tokens
    expected = full[: full.index(stop)]
    async with same_stack(eos_token_ids={NO_EOS}) as stack:
        streamed = []
        async with AsyncClient(stack.address) as client:
            async for chunk in client.stream(
                token_ids=prompt_ids, max_new_tokens=MAX_NEW, stop=[stop], pipeline=pipeline
            ):
                streamed.append(chunk)
        assert await stack.sessions_left() == (0, 0)  # a speculation was in flight when it stopped
    text = "".join(c.text for c in streamed)
    assert text == expected
    assert streamed[-1].finish_reason == "stop"
    ids = [t for c in streamed for t in c.token_ids]
    assert ids == reference[: len(ids)] and len(ids) < MAX_NEW
    assert_stats_describe_what_was_streamed(streamed[-1].stats, ids)
    # The token that completes the stop string is the last one sent.
    assert stop in tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)) :]
    assert stop not in tokenizer.decode(prompt_ids + ids[:-1])[len(tokenizer.decode(prompt_ids)) :]


# --- sessions live exactly as long as their streams ---


async def test_sessions_are_freed_after_the_stream_ends(same_stack, prompt_ids):
    async with same_stack(eos_token_ids={NO_EOS}) as stack:
        await generate(stack.address, prompt_ids, max_new_tokens=20)
        assert await stack.sessions_left() == (0, 0)
        assert stack.target.store.cached_tokens == 0


async def test_sessions_are_freed_after_the_client_cancels(
    tiny_target_dir, tiny_draft_other_dir, prompt_ids
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            stream = client.stream(
                token_ids=prompt_ids, max_new_tokens=400, num_speculative_tokens=2
            )
            await anext(stream)  # the first token: the draft opens once it is out
            await anext(stream)  # a round that drafted
            assert len(stack.target.store) == 1 and len(stack.draft.store) == 1
            await stream.aclose()
        assert await stack.sessions_left() == (0, 0)


async def test_draft_with_another_vocabulary_is_refused(tiny_target_dir, tmp_path, prompt_ids):
    from tests.tiny import build_tiny_model_dir, build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path / "tokenizer", vocab_size=300)
    other = build_tiny_model_dir(tmp_path / "other-vocab", tmp_path / "tokenizer", seed=3)
    async with running_stack(tiny_target_dir, draft_dir=other, eos_token_ids={NO_EOS}) as stack:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stack.address, prompt_ids, max_new_tokens=5, num_speculative_tokens=2)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "vocabulary" in info.value.details()
        assert await stack.sessions_left() == (0, 0)


async def test_draft_without_tokenizer_and_another_vocabulary_size_is_refused(
    tiny_target_dir, tmp_path, prompt_ids
):
    from tests.tiny import build_tiny_llama

    other = build_tiny_llama(tmp_path / "no-tokenizer", vocab_size=300, seed=3)
    async with running_stack(tiny_target_dir, draft_dir=other, eos_token_ids={NO_EOS}) as stack:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stack.address, prompt_ids, max_new_tokens=5, num_speculative_tokens=2)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "300" in info.value.details()


async def test_full_worker_answers_resource_exhausted(
    tiny_target_dir, tiny_draft_other_dir, prompt_ids
):
    limits = WorkerLimits(max_sessions=1, max_cached_tokens=10_000)
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}, limits=limits
    ) as stack:
        async with AsyncClient(stack.address) as client:
            first = client.stream(token_ids=prompt_ids, max_new_tokens=400)
            await anext(first)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(token_ids=prompt_ids, max_new_tokens=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await first.aclose()
        assert await stack.sessions_left() == (0, 0)


@pytest.mark.parametrize(
    "kwargs, code",
    [
        (dict(token_ids=[10**6]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", num_speculative_tokens=99), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", max_new_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_requests_get_invalid_argument(tiny_target_dir, kwargs, code):
    async with running_stack(tiny_target_dir, drafter="prompt-lookup") as stack:
        async with AsyncClient(stack.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(**kwargs)
        assert info.value.code() == code
        assert info.value.details()
        assert await stack.sessions_left() == (0, 0)


async def test_chat_prompt_uses_the_chat_template(tiny_target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    async with running_stack(tiny_target_dir, drafter="prompt-lookup") as stack:
        async with AsyncClient(stack.address) as client:
            chat = await client.generate(messages=messages, max_new_tokens=8, ignore_eos=True)
            raw = await client.generate(token_ids=list(ids), max_new_tokens=8, ignore_eos=True)
    assert chat.token_ids == raw.token_ids
    assert chat.stats.prompt_tokens == len(ids)


async def test_adaptive_k_keeps_the_output_and_backs_off_a_useless_draft(
    tiny_target_dir, tiny_draft_other_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            # Teach the coordinator's cost model, then ask adaptively.
            await client.generate(
                token_ids=prompt_ids, max_new_tokens=MAX_NEW, num_speculative_tokens=4
            )
            result = await client.generate(
                token_ids=prompt_ids, max_new_tokens=MAX_NEW, adaptive=True
            )
    stats = result.stats
    assert list(result.token_ids) == reference
    assert stats.adaptive and stats.num_speculative_tokens == 16
    # Almost nothing is accepted, so most rounds draft nothing.
    assert stats.draft_tokens < stats.rounds * 2


async def test_a_fixed_k_wins_over_adaptive(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, reference
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}
    ) as stack:
        result = await generate(
            stack.address,
            prompt_ids,
            max_new_tokens=MAX_NEW,
            num_speculative_tokens=2,
            adaptive=True,
        )
    assert list(result.token_ids) == reference
    assert not result.stats.adaptive and result.stats.num_speculative_tokens == 2
    assert result.stats.overhead_s_p50 > 0


async def test_a_stop_right_after_the_first_token_reports_what_was_streamed(
    same_stack, prompt_ids, reference
):
    # EOS as the first token: one round, one token — not a round of K + 1.
    async with same_stack(eos_token_ids={reference[0]}) as stack:
        result = await generate(stack.address, prompt_ids, max_new_tokens=MAX_NEW)
    assert list(result.token_ids) == reference[:1] and result.finish_reason == "stop"
    assert result.stats.rounds == 1 and result.stats.mean_acceptance_length == 1.0
    assert result.stats.draft_tokens == result.stats.accepted_tokens == 0
