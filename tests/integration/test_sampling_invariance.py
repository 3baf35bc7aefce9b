"""Sampling across three real gRPC services on the tiny 512-token models:
Gumbel coupling makes the output independent of the drafter, K and
pipelining; seeded
requests reproduce across restarts (and unseeded ones report a seed that
replays them); rejection mode relays q only when a model drafted; stops,
EOS and max_new_tokens cut exactly inside multi-token accepts while
sampling, synchronous or pipelined; bad sampling parameters are refused with INVALID_ARGUMENT."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from outrider.client import AsyncClient
from outrider.sampling import SamplingParams, Verification, gumbel_draw
from outrider.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.integration.harness import running_stack

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
NEW_TOKENS = 30
SEEDS = (0, 1, 2**40 + 7)
NO_EOS = -1  # an id no model emits: runs go to max_new_tokens
VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Tiny float64 models: on a busy two-core machine a second intra-op
    # thread makes each forward pass tens of times slower. The engine threads
    # the harness starts inherit the setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(PROMPT)["input_ids"]


async def complete(address: str, prompt_ids, **kwargs):
    async with AsyncClient(address) as client:
        return await client.generate(token_ids=prompt_ids, **kwargs)


def reference_gumbel(
    model_dir, prompt_ids, n: int, seed: int, temperature: float = 1.0
) -> list[int]:
    """Target-only Gumbel decoding, written out: at each absolute position
    the argmax of log p + the position's noise, p from a full forward pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    params = SamplingParams(temperature=temperature, seed=seed, verification=Verification.GUMBEL)
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(gumbel_draw(logits, params, position=len(ids)))
    return ids[len(prompt_ids) :]


# --- Gumbel: the drafter, K and pipelining do not change the output ------------------------


@pytest.fixture(scope="module")
def gumbel_reference(tiny_target_dir, prompt_ids):
    return {seed: reference_gumbel(tiny_target_dir, prompt_ids, NEW_TOKENS, seed) for seed in SEEDS}


# Pipelined: the draft drafts round i + 1 while the target verifies round i;
# whether its speculation hits or misses, the tokens are the same.
GUMBEL_RUNS = [(0, False), (1, False), (3, False), (6, False), (1, True), (6, True)]


@pytest.mark.parametrize("drafter", ["same", "other", "prompt-lookup"])
async def test_gumbel_output_depends_neither_on_drafter_nor_on_k(
    tiny_target_dir,
    tiny_draft_same_dir,
    tiny_draft_other_dir,
    prompt_ids,
    gumbel_reference,
    drafter,
):
    if drafter == "prompt-lookup":
        stack_args = dict(drafter="prompt-lookup")
    else:
        stack_args = dict(
            draft_dir=tiny_draft_same_dir if drafter == "same" else tiny_draft_other_dir
        )
    async with running_stack(tiny_target_dir, eos_token_ids={NO_EOS}, **stack_args) as stack:
        for seed in SEEDS:
            reference = gumbel_reference[seed]
            for k, pipeline in GUMBEL_RUNS:
                result = await complete(
                    stack.address,
                    prompt_ids,
                    max_new_tokens=NEW_TOKENS,
                    num_speculative_tokens=k,
                    temperature=1.0,
                    seed=seed,
                    verification="gumbel",
                    pipeline=pipeline,
                )
                assert list(result.token_ids) == reference, (drafter, seed, k, pipeline)
                stats = result.stats
                assert (stats.seed, stats.verification, stats.num_speculative_tokens) == (
                    seed,
                    "gumbel",
                    k,
                )
                assert stats.draft_probs_bytes == 0  # only token ids cross the wire
                # (Prompt lookup drafts in the coordinator: nothing to pipeline.)
                assert stats.pipeline == (pipeline and drafter != "prompt-lookup")
                if stats.pipeline:
                    assert stats.speculation_hits + stats.speculation_misses > 0, (drafter, seed, k)
                if pipeline and drafter == "same":
                    # The same noise again: the draft's guess of the bonus is the bonus.
                    assert stats.speculation_hits > 0 and stats.speculation_misses == 0, (seed, k)
                if k > 0:
                    assert stats.draft_tokens > 0
                if k > 0 and drafter == "same":
                    # Both sides draw with the same noise from the same p: always accepted.
                    assert stats.acceptance_rate == 1.0
                if k > 0 and drafter == "other":
                    assert stats.acceptance_rate < 0.5
    # Different seeds do sample different outputs.
    assert len({tuple(r) for r in gumbel_reference.values()}) == len(SEEDS)


# --- seeded reproducibility across restarts ------------------------------------------------

REPRO_SEED = 20240607
REPRO_NEW_TOKENS = 24
REPRO_REQUESTS = [(mode, k) for mode in ("greedy", "rejection", "gumbel") for k in (1, 3)]


def repro_kwargs(mode: str) -> dict:
    if mode == "greedy":
        return dict(temperature=0.0, verification="greedy")
    return dict(temperature=0.9, top_p=0.95, verification=mode)


async def test_seeded_requests_reproduce_across_restarts_and_unseeded_ones_report_their_seed(
    tiny_target_dir, tiny_draft_other_dir, prompt_ids
):
    async def run_all(address):
        outputs = {}
        for mode, k in REPRO_REQUESTS:
            result = await complete(
                address,
                prompt_ids,
                max_new_tokens=REPRO_NEW_TOKENS,
                num_speculative_tokens=k,
                seed=REPRO_SEED,
                **repro_kwargs(mode),
            )
            assert result.stats.seed == REPRO_SEED and result.stats.verification == mode
            assert len(result.token_ids) == REPRO_NEW_TOKENS
            outputs[mode, k] = (list(result.token_ids), result.text)
        return outputs

    unseeded = dict(
        max_new_tokens=REPRO_NEW_TOKENS,
        num_speculative_tokens=3,
        temperature=1.0,
        verification="rejection",
    )
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        first = await run_all(stack.address)
        fresh = [await complete(stack.address, prompt_ids, **unseeded) for _ in range(2)]

    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        second = await run_all(stack.address)
        replays = [
            await complete(stack.address, prompt_ids, seed=f.stats.seed, **unseeded) for f in fresh
        ]

    assert second == first
    # Sampling did sample: the sampled outputs are not the greedy one.
    for mode in ("rejection", "gumbel"):
        assert first[mode, 1][0] != first["greedy", 1][0]
    # Greedy and Gumbel outputs do not depend on K; rejection sampling's may.
    assert first["greedy", 1] == first["greedy", 3]
    assert first["gumbel", 1] == first["gumbel", 3]

    seeds = [f.stats.seed for f in fresh]
    assert all(0 <= s < 2**64 for s in seeds) and seeds[0] != seeds[1]
    for f, replay in zip(fresh, replays, strict=True):
        assert replay.stats.seed == f.stats.seed
        assert replay.token_ids == f.token_ids and replay.text == f.text


# --- rejection mode relays q ------------------------------------------------------------


async def test_rejection_with_a_model_draft_sends_q_and_prompt_lookup_sends_none(
    tiny_target_dir, tiny_draft_other_dir, prompt_ids
):
    common = dict(max_new_tokens=NEW_TOKENS, num_speculative_tokens=4, temperature=1.0, seed=3)
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}
    ) as stack:
        sparse = await complete(
            stack.address, prompt_ids, top_k=5, verification="rejection", **common
        )
        dense = await complete(stack.address, prompt_ids, verification="rejection", **common)
        gumbel = await complete(stack.address, prompt_ids, verification="gumbel", **common)

    # top_k = 5: q has at most 5 tokens of support, sent sparse: an int32 id
    # and a float16 value (6 bytes) per support token, one row per draft token.
    drafted = sparse.stats.draft_tokens
    assert drafted > 0
    assert sparse.stats.draft_probs_bytes % 6 == 0
    assert 6 * drafted <= sparse.stats.draft_probs_bytes <= 6 * 5 * drafted
    # No truncation: q covers (nearly) the whole vocabulary, sent dense as float16.
    assert dense.stats.draft_tokens > 0
    assert dense.stats.draft_probs_bytes == 2 * VOCAB * dense.stats.draft_tokens
    # Gumbel coupling needs no q.
    assert gumbel.stats.draft_tokens > 0 and gumbel.stats.draft_probs_bytes == 0

    async with running_stack(
        tiny_target_dir, drafter="prompt-lookup", eos_token_ids={NO_EOS}
    ) as stack:
        lookup = await complete(
            stack.address, prompt_ids, top_k=5, verification="rejection", **common
        )
    # A deterministic draft is a point mass: nothing to send.
    assert lookup.stats.draft_tokens > 0
    assert lookup.stats.draft_probs_bytes == 0
    assert lookup.stats.verification == "rejection"


# --- stops inside multi-token accepts while sampling -----------------------------------------
#
# The draft is the target itself and K = 8, so rounds commit many tokens at
# once: with Gumbel coupling an identical draft is always accepted; with
# rejection sampling almost always (q is the target's distribution rounded
# to float16). Stop conditions do not change what is drafted (only
# max_new_tokens does, by capping the last round), so a stopped run is a
# prefix of the same request run to the end.

STOP_SEED = 11
STOP_MAX_NEW = 40


@pytest.mark.parametrize("pipeline", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("mode", ["gumbel", "rejection"])
async def test_stops_inside_multi_token_accepts_while_sampling(
    tiny_target_dir, tiny_draft_same_dir, tokenizer, prompt_ids, mode, pipeline
):
    common = dict(
        num_speculative_tokens=8,
        temperature=1.0,
        seed=STOP_SEED,
        verification=mode,
        pipeline=pipeline,
    )
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}
    ) as stack:
        full = await complete(stack.address, prompt_ids, max_new_tokens=STOP_MAX_NEW, **common)
        reference = list(full.token_ids)
        assert len(reference) == STOP_MAX_NEW and full.finish_reason == "length"
        if mode == "gumbel":
            assert full.stats.acceptance_rate == 1.0
            # The first token from the prefill, then rounds of 9.
            assert full.stats.rounds == 1 + math.ceil((STOP_MAX_NEW - 1) / 9)
        else:
            assert full.stats.acceptance_rate > 0.9
        assert full.stats.pipeline == pipeline
        if pipeline:
            speculated = full.stats.speculation_hits + full.stats.speculation_misses
            assert 0 < speculated <= full.stats.rounds - 1
            if mode == "gumbel":
                # Every round after the first drafting one (the first round is
                # the prefill's token) was speculated and, the draft guessing
                # the bonus with the target's own noise, was a hit.
                assert full.stats.speculation_hits == full.stats.rounds - 2

        # max_new_tokens = 5 < K + 1: the round is cut, never overrun.
        short = await complete(stack.address, prompt_ids, max_new_tokens=5, **common)
        assert len(short.token_ids) == 5 and short.finish_reason == "length"
        assert short.stats.generated_tokens == 5
        if mode == "gumbel":
            assert list(short.token_ids) == reference[:5] and short.stats.rounds == 2
        else:
            # The 4 drafts of the cut round are the long run's first 4; the
            # 5th token is then a bonus draw, not the long run's 5th draft.
            assert list(short.token_ids[:4]) == reference[:4]

        # A stop token id from the middle of the first round.
        stop_id = reference[3]
        end = reference.index(stop_id) + 1
        stopped = await complete(
            stack.address,
            prompt_ids,
            max_new_tokens=STOP_MAX_NEW,
            stop_token_ids=[stop_id],
            **common,
        )
        assert list(stopped.token_ids) == reference[:end]
        assert stopped.finish_reason == "stop"

        # A stop string: the text ends right before its first occurrence.
        def decode(ids):  # as the coordinator does: special tokens are not text
            return tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)[len(prefix) :]

        prefix = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        text = decode(reference)
        assert full.text == text
        stop = text[8:11]
        cut = await complete(
            stack.address, prompt_ids, max_new_tokens=STOP_MAX_NEW, stop=[stop], **common
        )
        assert cut.text == text[: text.index(stop)]
        assert cut.finish_reason == "stop"
        ids = list(cut.token_ids)
        assert ids == reference[: len(ids)] and len(ids) < STOP_MAX_NEW
        assert stop in decode(ids) and stop not in decode(ids[:-1])

    # EOS from the middle of a round ends the output (unless ignore_eos).
    eos = reference[6]
    end = reference.index(eos) + 1
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={eos}
    ) as stack:
        ended = await complete(stack.address, prompt_ids, max_new_tokens=STOP_MAX_NEW, **common)
        ignored = await complete(
            stack.address, prompt_ids, max_new_tokens=STOP_MAX_NEW, ignore_eos=True, **common
        )
    assert list(ended.token_ids) == reference[:end]
    assert ended.finish_reason == "stop"
    assert list(ignored.token_ids) == reference and ignored.finish_reason == "length"


# --- bad sampling input -------------------------------------------------------------------

BAD_INPUTS = {
    "negative temperature": (dict(temperature=-0.5), "temperature"),
    "NaN temperature": (dict(temperature=math.nan), "temperature"),
    "top_p = 0": (dict(temperature=1.0, top_p=0.0), "top_p"),
    "top_p > 1": (dict(temperature=1.0, top_p=1.5), "top_p"),
    "min_p > 1": (dict(temperature=1.0, min_p=1.5), "min_p"),
}


async def test_bad_sampling_input_is_invalid_argument(tiny_target_dir, prompt_ids):
    async with running_stack(tiny_target_dir, drafter=None) as stack:
        async with AsyncClient(stack.address) as client:
            for name, (kwargs, field) in BAD_INPUTS.items():
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.generate(token_ids=prompt_ids, max_new_tokens=4, **kwargs)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert field in info.value.details(), (name, info.value.details())
                # The streaming RPC refuses it the same way.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in client.stream(token_ids=prompt_ids, max_new_tokens=4, **kwargs):
                        pass
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name

        # An enum value this server does not know, straight through the stub.
        request = coordinator_pb2.GenerateRequest(
            token_ids=coordinator_pb2.TokenIds(ids=prompt_ids),
            sampling=coordinator_pb2.SamplingParams(max_new_tokens=4, temperature=1.0),
        )
        request.speculation.verification = 7
        async with grpc.aio.insecure_channel(stack.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await coordinator_pb2_grpc.CoordinatorStub(channel).Complete(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert "verification" in details and "7" in details
        assert all(mode in details for mode in ("greedy", "rejection", "gumbel"))
        assert await stack.sessions_left() == (0, 0)
