"""Suffix decoding on the real default model, through `outrider up`: alone
(``--drafter suffix``) and beside the default drafter (``--suffix-decoding``,
each round drafting by whichever pays), the greedy tokens of agentic turns —
which resend earlier code — are target-only decoding's, at one stream and
at eight, the later turns drafting from the earlier turns' outputs."""

from __future__ import annotations

import asyncio

import pytest

from outrider import model_specs
from outrider.bench.prompts import PROMPT_SETS, load_prompts
from outrider.client import AsyncClient
from tests.e2e.stack import outrider_up

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 64
TURNS = 8


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    if not model_specs.is_fetched(model_specs.DEFAULT_MODEL):
        pytest.skip("the default model is not fetched: run `outrider models fetch`")
    return [p.text for p in load_prompts(PROMPT_SETS["agentic"])[:TURNS]]  # (sessions in order)


def greedy(address: str, prompts: list[str], streams: int, **speculation) -> list[list[int]]:
    """Each prompt's greedy token ids, ``streams`` at a time."""

    async def run() -> list[list[int]]:
        semaphore = asyncio.Semaphore(streams)
        async with AsyncClient(address, timeout=300) as client:

            async def one(prompt: str) -> list[int]:
                async with semaphore:
                    reply = await client.generate(
                        prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, **speculation
                    )
                    return list(reply.token_ids)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run())


@pytest.mark.parametrize("flags", [("--drafter", "suffix"), ("--suffix-decoding",)])
def test_suffix_decoding_gives_the_target_only_tokens(prompts, flags):
    with outrider_up(*flags) as (address, _):
        target_only = greedy(address, prompts, 1, num_speculative_tokens=0)
        alone = greedy(address, prompts, 1, adaptive=True)
        loaded = greedy(address, prompts, 8, adaptive=True)
        fixed = greedy(address, prompts, 8, num_speculative_tokens=4)
    assert alone == target_only
    assert loaded == target_only
    assert fixed == target_only
