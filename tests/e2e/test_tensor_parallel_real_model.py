"""The real default model split over 3 ranks (9 heads, 3 KV heads; gloo on
the CPU, float32): greedy tokens equal Hugging Face `generate` on 8
MT-Bench prompts × 32 tokens, or differ only where transformers' top two
logits are a near tie (the gap is printed)."""

from __future__ import annotations

import pytest
import torch

from outrider import model_specs
from outrider.engine import parallel
from outrider.engine.kv_cache import BlockPool
from outrider.engine.runner import PagedRunner
from outrider.engine.scheduler import Row
from tests.prompts import mt_bench_chat_ids

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 32
NEAR_TIE = 1e-3
"""A top-two gap (in logits) below which float32 summation order may pick either."""


@pytest.fixture(scope="module")
def default_model_dir() -> str:
    if not model_specs.is_fetched(model_specs.DEFAULT_MODEL):
        pytest.skip("the default model is not fetched: run `outrider models fetch`")
    return str(model_specs.model_path(model_specs.DEFAULT_MODEL))


def test_three_ranks_give_transformers_greedy_tokens(default_model_dir):
    from transformers import AutoModelForCausalLM

    tokenizer = model_specs.load_tokenizer(default_model_dir)
    chats = mt_bench_chat_ids(tokenizer, 8)
    ranks = parallel.start(
        default_model_dir,
        parallel.meta_model(default_model_dir),
        size=3,
        device=torch.device("cpu"),
        dtype=torch.float32,
        num_layers=None,
        timeout_s=60,
        threads=1,
    )
    try:
        runner = PagedRunner(ranks, BlockPool(8 * 40, 16))
        caches = [runner.new_kv() for _ in chats]
        outputs: list[list[int]] = [[] for _ in chats]
        with torch.inference_mode():
            feeds = [list(chat) for chat in chats]
            for _ in range(MAX_NEW_TOKENS):
                for kv, feed in zip(caches, feeds, strict=True):
                    kv.reserve(len(kv) + len(feed))
                steps = runner.execute(
                    [Row(kv, feed, 1) for kv, feed in zip(caches, feeds, strict=True)]
                )
                for out, logits in zip(outputs, steps, strict=True):
                    assert logits is not None
                    out.append(logits.argmax[0])
                feeds = [[out[-1]] for out in outputs]
    finally:
        ranks.close()

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    differences = []
    for i, (chat, ours) in enumerate(zip(chats, outputs, strict=True)):
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([chat]),
                attention_mask=torch.ones(1, len(chat), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(chat) :].tolist()
        if generated == ours:
            continue
        at = next(j for j, (a, b) in enumerate(zip(generated, ours, strict=True)) if a != b)
        with torch.inference_mode():
            logits = model(torch.tensor([chat + generated[:at]])).logits[0, -1]
        top = logits.topk(2).values
        gap = float(top[0] - top[1])
        differences.append((i, at, gap))
        print(f"\nprompt {i}: first difference at token {at}, HF top-two gap {gap:.2e}")
    print(f"\n{len(chats) - len(differences)} of {len(chats)} prompts identical to HF generate")
    assert all(gap < NEAR_TIE for *_, gap in differences), differences
