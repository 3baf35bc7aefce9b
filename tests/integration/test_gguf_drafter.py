"""The gguf drafter (a GGUF file on llama.cpp) across three real gRPC
services: the output is target-only greedy decoding for K = 0, fixed K and
adaptive K, synchronous and pipelined, one stream and eight at once; the
draft's rows of a step run in one decode; a GGUF over another vocabulary
is refused at the coordinator's start in one line naming both models."""

from __future__ import annotations

import asyncio

import pytest

from outrider.client import AsyncClient
from outrider.config import CoordinatorConfig, ServiceConfig
from outrider.startup import StartupError
from tests.integration.harness import reference_greedy, running_stack

pytest.importorskip("llama_cpp", reason="the gguf drafter needs llama-cpp-python")

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
PROMPTS = [
    PROMPT,
    "Once upon a time there was a little robot",
    "def add(a, b):\n    return",
    "User: What is the capital of France?\nAssistant:",
    "Hello world, hello again",
    "Numbers: 0 1 2 3",
    "The capital of Japan is",
    "Speculative decoding lets a small draft model",
]
MAX_NEW = 40
NO_EOS = -1  # an id no model emits: runs go to max_new_tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def references(tiny_target_dir, tokenizer):
    return {
        prompt: reference_greedy(tiny_target_dir, tokenizer(prompt)["input_ids"], MAX_NEW, eos=None)
        for prompt in PROMPTS
    }


def speculation(run: str) -> dict:
    """The request's speculation for a run's name."""
    return {
        "k0": dict(num_speculative_tokens=0),
        "k4": dict(num_speculative_tokens=4),
        "adaptive": dict(adaptive=True),
        "k4-pipelined": dict(num_speculative_tokens=4, pipeline=True),
        "adaptive-pipelined": dict(adaptive=True, pipeline=True),
    }[run]


RUNS = ["k0", "k4", "adaptive", "k4-pipelined", "adaptive-pipelined"]


@pytest.mark.parametrize("streams", [1, 8])
async def test_output_equals_target_only(
    tiny_target_dir, tiny_gguf, tokenizer, references, streams
):
    prompts = PROMPTS[:streams]
    async with running_stack(
        tiny_target_dir, drafter="gguf", draft_dir=tiny_gguf, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            info = await client.model_info()
            for run in RUNS:
                results = await asyncio.gather(
                    *(
                        client.generate(
                            token_ids=tokenizer(prompt)["input_ids"],
                            max_new_tokens=MAX_NEW,
                            **speculation(run),
                        )
                        for prompt in prompts
                    )
                )
                for prompt, result in zip(prompts, results, strict=True):
                    assert list(result.token_ids) == references[prompt], (run, prompt)
                    stats = result.stats
                    if run == "k0":
                        assert stats.draft_tokens == 0
                    elif run.startswith("k4"):
                        # The same weights in float32: nearly every draft is accepted.
                        assert stats.acceptance_rate > 0.9, (run, prompt)
                    if run == "k4-pipelined":
                        assert stats.pipeline and stats.speculation_hits > 0
        assert await stack.sessions_left() == (0, 0)
    assert info.drafter == "gguf" and info.draft_model == tiny_gguf.name


async def test_the_drafts_of_concurrent_sessions_share_decodes(
    tiny_target_dir, tiny_gguf, tokenizer
):
    async with running_stack(
        tiny_target_dir, drafter="gguf", draft_dir=tiny_gguf, eos_token_ids={NO_EOS}
    ) as stack:
        runner = stack.draft_engine.runner
        rows_per_decode: list[int] = []
        execute = runner.execute

        def counting(rows):
            rows_per_decode.append(len(rows))
            return execute(rows)

        runner.execute = counting
        async with AsyncClient(stack.address) as client:
            await asyncio.gather(
                *(
                    client.generate(
                        token_ids=tokenizer(prompt)["input_ids"],
                        max_new_tokens=MAX_NEW,
                        num_speculative_tokens=4,
                    )
                    for prompt in PROMPTS
                )
            )
    assert max(rows_per_decode) > 1


async def test_a_gguf_over_another_vocabulary_is_refused_at_start(
    tiny_target_dir, tiny_gguf_other_vocab
):
    from outrider.coordinator.main import serve as serve_coordinator

    async with running_stack(
        tiny_target_dir, drafter="gguf", draft_dir=tiny_gguf_other_vocab
    ) as stack:
        target = stack.target_servers[0].address
        draft = stack.draft_server.address
        config = CoordinatorConfig(
            service=ServiceConfig(), target=(target,), draft=(draft,), worker_wait_s=10
        )
        with pytest.raises(StartupError) as refused:
            await serve_coordinator(config, None)
    message = str(refused.value)
    assert "\n" not in message
    assert tiny_gguf_other_vocab.name in message and tiny_target_dir.name in message
    assert "vocabulary" in message
