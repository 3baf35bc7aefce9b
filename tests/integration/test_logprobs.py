"""The target's log-probabilities through three real gRPC services on tiny
float64 models: those of speculative rounds equal target-only decoding's
and Hugging Face's over the same tokens, greedy and sampled, streamed and
not; and an out-of-range request is refused."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from outrider.client import AsyncClient
from tests.integration.harness import running_stack

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
MAX_NEW = 24
TOP = 3
NO_EOS = -1


@pytest.fixture(scope="module")
def prompt_ids(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)(PROMPT)["input_ids"]


def reference_logprobs(model_dir, prompt_ids, token_ids) -> torch.Tensor:
    """log-softmax of the target's logits at each generated token's
    position, one forward pass over the whole sequence (float64)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt_ids, *token_ids]])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)


def check_against(reference: torch.Tensor, token_ids, logprobs, top: int) -> None:
    assert len(logprobs) == len(token_ids)
    for row, token, got in zip(reference, token_ids, logprobs, strict=True):
        assert got.logprob == pytest.approx(float(row[token]), abs=1e-4)
        want = row.topk(top)
        assert [t for t, _ in got.top] == want.indices.tolist()
        assert [v for _, v in got.top] == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"temperature": 0.8, "seed": 7},
        {"temperature": 0.8, "seed": 7, "verification": "gumbel"},
    ],
    ids=["greedy", "rejection", "gumbel"],
)
async def test_speculative_logprobs_equal_target_only(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids, sampling
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            runs = {
                k: await client.generate(
                    token_ids=prompt_ids,
                    max_new_tokens=MAX_NEW,
                    num_speculative_tokens=k,
                    logprobs=TOP,
                    **sampling,
                )
                for k in (0, 4)
            }
    assert runs[4].stats.accepted_tokens > 0  # drafts were accepted: rounds of several tokens
    reference = reference_logprobs(tiny_target_dir, prompt_ids, runs[4].token_ids)
    check_against(reference, runs[4].token_ids, runs[4].logprobs, TOP)
    if not sampling or sampling.get("verification") == "gumbel":
        assert runs[0].token_ids == runs[4].token_ids  # (rejection's tokens depend on K)
        for a, b in zip(runs[0].logprobs, runs[4].logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


async def test_streamed_logprobs_follow_their_tokens(
    tiny_target_dir, tiny_draft_same_dir, prompt_ids
):
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_same_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            chunks = [
                chunk
                async for chunk in client.stream(
                    token_ids=prompt_ids, max_new_tokens=MAX_NEW, logprobs=0
                )
            ]
            plain = await client.generate(token_ids=prompt_ids, max_new_tokens=MAX_NEW)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert any(len(c.token_ids) > 1 for c in chunks)  # rounds that committed several
    token_ids = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert all(lp.top == () for lp in logprobs)
    check_against(
        reference_logprobs(tiny_target_dir, prompt_ids, token_ids), token_ids, logprobs, 0
    )
    assert plain.logprobs == ()  # none unless asked for


async def test_too_many_logprobs_is_refused(tiny_target_dir, prompt_ids):
    async with running_stack(tiny_target_dir, drafter=None) as stack:
        async with AsyncClient(stack.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.generate(token_ids=prompt_ids, logprobs=21)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs must be an integer in [0, 20]" in (refused.value.details() or "")
