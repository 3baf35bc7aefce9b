"""An EAGLE-3 head's drafts leave the target's distribution unchanged: the
chi-square check of ``test_sampling_distribution`` (its tiny 16-token
target, exact marginals and seeds), with the target's real paged forward
sending its hidden states and a random head drafting on them, in rejection
and Gumbel modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from outrider.coordinator.served_models import Models
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.drafters.eagle import EagleDrafter
from outrider.eagle.forward import EagleForward
from outrider.eagle.head import EagleHead, HeadConfig
from outrider.engine.kv_cache import BlockPool
from outrider.engine.runner import PagedRunner
from outrider.sampling import SamplingParams
from tests.integration.test_sampling_distribution import (
    ALPHA,
    NEW_TOKENS,
    TARGET_SEED,
    VOCAB,
    Letters,
    chi_square_p,
    draft_client,
    exact_marginals,
    load_llama,
    one_thread_quiet_loop,  # noqa: F401 (an autouse fixture)
    paged_runner,
    request,
    run_once,
    target_client,
)

N = 400
K = 2


@pytest.fixture(scope="module")
def eagle_world(tmp_path_factory):
    target = load_llama(tmp_path_factory.mktemp("eagle-sampling") / "target", TARGET_SEED)
    config = HeadConfig.for_target(target.config, draft_vocab_size=12)
    generator = torch.Generator().manual_seed(5)
    head = EagleHead(config)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0.0, 0.5, generator=generator)
        head.set_draft_vocab(torch.randperm(VOCAB, generator=generator)[:12])
    forward = EagleForward(head, target.model.embed_tokens.weight, dtype=torch.float64)
    drafter = EagleDrafter(PagedRunner(forward, BlockPool(64, 16)), model_name="head")
    info = WorkerInfo(
        model="target", drafter="", vocab_size=VOCAB, vocab_fingerprint="", max_context=512
    )
    draft_info = WorkerInfo(
        model="head", drafter="eagle", vocab_size=VOCAB, vocab_fingerprint="", max_context=512,
        hidden_state_layers=config.aux_layers,
    )  # fmt: skip
    models = Models(Letters(), frozenset(), info, draft_info)
    return target, target_client(paged_runner(target)), draft_client(drafter), models


async def sampled(world, mode: str, n: int, drafted: bool) -> tuple[np.ndarray, int, int]:
    target, target_, draft, models = world
    out = np.empty((n, NEW_TOKENS), dtype=np.int64)
    drafts = accepted = 0
    for seed in range(n):
        req = request("T=1.0", mode, seed, K if drafted else 0)
        tokens, stats = await run_once(models, target_, draft if drafted else None, req)
        out[seed] = tokens
        drafts += stats.draft_tokens
        accepted += stats.accepted_tokens
    return out, drafts, accepted


@pytest.mark.parametrize("mode", ["rejection", "gumbel"])
async def test_an_eagle_head_keeps_the_target_distribution(eagle_world, mode):
    n = N if mode == "rejection" else N // 2
    tokens, drafts, accepted = await sampled(eagle_world, mode, n, drafted=True)
    assert drafts > 0 and 0 < accepted < drafts  # both the accept and the reject paths ran
    reference = exact_marginals(eagle_world[0], SamplingParams(temperature=1.0))
    p_values = [chi_square_p(tokens[:, i], reference[i]) for i in range(NEW_TOKENS)]
    assert min(p_values) > ALPHA, p_values
    if mode == "gumbel":  # seed for seed, the tokens of target-only Gumbel decoding
        target_only, _, _ = await sampled(eagle_world, mode, n, drafted=False)
        assert np.array_equal(tokens, target_only)
