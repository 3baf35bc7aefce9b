"""An EAGLE-3 head drafting through the three real gRPC services on tiny
float64 models: the target's hidden states reach the head (its drafts are
the dense head's on the target's own features), and the output is
target-only greedy decoding at any K, adaptive or pipelined, and through
the loss of the draft worker."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from outrider.client import AsyncClient
from outrider.config import Recovery
from outrider.draft_worker.sessions import DraftSessions
from outrider.drafters.eagle import EagleDrafter
from outrider.drafters.model import DraftInfo
from outrider.eagle.forward import EagleForward
from outrider.eagle.head import load_head
from outrider.engine import InlineEngine
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import PagedRunner
from outrider.sampling_params import SamplingParams
from outrider.session import SessionStore
from outrider.target_worker.sessions import TargetInfo, TargetSessions
from tests.integration.harness import reference_greedy, running_stack
from tests.integration.test_worker_loss import stream_and_then

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
MAX_NEW = 40
NO_EOS = -1
FAST = Recovery(draft_deadline_s=2.0, draft_backoff_s=0.05)


@pytest.fixture(scope="module")
def prompt_ids(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def reference(tiny_target_dir, prompt_ids):
    return reference_greedy(tiny_target_dir, prompt_ids, MAX_NEW, eos=None)


async def test_the_head_drafts_on_the_targets_hidden_states(tiny_target_dir, tiny_head_dir):
    """Target open → its hidden states → the draft's open → 3 greedy drafts:
    those of the dense head on the features transformers computes."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float64).eval()
    head = load_head(tiny_head_dir, dtype=torch.float64)
    layers = head.config.aux_layers
    prompt = [5, 17, 42, 8, 99, 23, 61, 7, 30]

    target_runner = PagedRunner(LlamaForward(copy.deepcopy(model)), BlockPool(32, 16))
    target = TargetSessions(
        target_runner,
        SessionStore(max_sessions=1, pool=target_runner.pool),
        TargetInfo("t", model.config.vocab_size, "", 256),
    )
    embed = target_runner.forward.embed
    forward = EagleForward(head, embed, dtype=torch.float64)
    drafter = EagleDrafter(PagedRunner(forward, BlockPool(32, 16)), model_name="head")
    draft = DraftSessions(
        drafter, SessionStore(max_sessions=1, pool=drafter.runner.pool), DraftInfo("", 256, 8)
    )
    _, first, features, _ = InlineEngine(target_runner).call(
        target.open, "s", prompt, SamplingParams(), True, layers
    )
    history = [*prompt, first.next_token]
    assert features.rows == len(prompt)  # every position but the new last token's
    engine = InlineEngine(drafter.runner)
    engine.call(draft.open, "s", history, 0, "", SamplingParams(), features)
    proposal = engine.call(draft.propose, "s", len(history), [], 3)

    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[i][0] for i in layers], dim=-1).to(torch.bfloat16).double()
        tokens = torch.tensor(history[1:])
        fused = head.fc(aux)
        want = []
        embeds, feats = embed[tokens], fused
        for _ in range(3):
            positions = torch.arange(len(embeds))
            logits, prenorm = head(embeds[None], feats[None], positions[None])
            token = int(head.draft_to_target[logits[0, -1].argmax()])
            want.append(token)
            embeds = torch.cat([embeds, embed[token][None]])
            feats = torch.cat([feats, prenorm[0, -1:]])
    assert proposal.tokens == want


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(num_speculative_tokens=0), id="k0"),
        pytest.param(dict(num_speculative_tokens=4), id="k4"),
        pytest.param(dict(num_speculative_tokens=4, pipeline=True), id="k4-pipelined"),
        pytest.param(dict(adaptive=True), id="adaptive"),
    ],
)
async def test_eagle_output_equals_target_only(
    tiny_target_dir, tiny_head_dir, prompt_ids, reference, kwargs
):
    async with running_stack(
        tiny_target_dir, drafter="eagle", head_dir=tiny_head_dir, eos_token_ids={NO_EOS}
    ) as stack:
        async with AsyncClient(stack.address) as client:
            result = await client.generate(token_ids=prompt_ids, max_new_tokens=MAX_NEW, **kwargs)
            info = await client.model_info()
        assert await stack.sessions_left() == (0, 0)
    assert list(result.token_ids) == reference
    assert info.drafter == "eagle"
    if kwargs.get("num_speculative_tokens") == 4:
        assert result.stats.draft_tokens > 0


async def test_a_lost_draft_worker_leaves_the_stream_at_k0_identical(
    tiny_target_dir, tiny_head_dir, prompt_ids
):
    async with running_stack(
        tiny_target_dir,
        drafter="eagle",
        head_dir=tiny_head_dir,
        eos_token_ids={NO_EOS},
        recovery=FAST,
    ) as stack:
        ids, stats = await stream_and_then(
            stack.address,
            prompt_ids,
            lambda: stack.draft_server.stop(None),
            at=3,
            num_speculative_tokens=4,
        )
        assert ids == reference_greedy(tiny_target_dir, prompt_ids, len(ids), eos=None)
        assert stats.draft_tokens < stats.rounds * 4 / 2  # the rounds after the loss were K = 0
        assert await stack.sessions_left() == (0, 0)
