"""Bad hidden-state requests get precise refusals, on both workers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from outrider.draft_worker.sessions import DraftSessions
from outrider.drafters.eagle import EagleDrafter
from outrider.drafters.model import DraftInfo
from outrider.eagle.forward import EagleForward
from outrider.eagle.head import EagleHead, HeadConfig
from outrider.engine import InlineEngine
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import FallbackRunner, PagedRunner
from outrider.errors import FailedPrecondition, InvalidArgument
from outrider.hidden_states import HiddenStates
from outrider.sampling_params import SamplingParams
from outrider.session import SessionStore
from outrider.target_worker.sessions import TargetInfo, TargetSessions

CONFIG = LlamaConfig(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def target(runner) -> TargetSessions:
    store = SessionStore(max_sessions=2, pool=runner.pool)
    return TargetSessions(runner, store, TargetInfo("t", 97, "", 128))


def test_a_target_refuses_layers_it_does_not_have():
    runner = PagedRunner(LlamaForward(LlamaForCausalLM(CONFIG)), BlockPool(16, 16))
    with pytest.raises(InvalidArgument, match=r"layers \[4\]: this target has layers 0 to 3"):
        InlineEngine(runner).call(
            target(runner).open, "s", [1, 2, 3], SamplingParams(), True, [1, 4]
        )


def test_a_target_off_the_paged_forward_cannot_send_hidden_states():
    runner = FallbackRunner(LlamaForCausalLM(CONFIG), BlockPool(64, 1))
    with pytest.raises(FailedPrecondition, match="cannot send hidden states"):
        InlineEngine(runner).call(target(runner).open, "s", [1, 2, 3], SamplingParams(), True, [1])


@pytest.fixture
def draft() -> DraftSessions:
    head = EagleHead(HeadConfig.for_target(CONFIG, draft_vocab_size=40))
    forward = EagleForward(head, torch.randn(97, 32))
    drafter = EagleDrafter(PagedRunner(forward, BlockPool(16, 16)), model_name="head")
    store = SessionStore(max_sessions=4, pool=drafter.runner.pool)
    return DraftSessions(drafter, store, DraftInfo("", 128, 8))


def rows(n: int, width: int = 96) -> HiddenStates:
    return HiddenStates(bytes(2 * width * n), n)


def test_a_head_refuses_hidden_states_of_the_wrong_width_or_count(draft):
    engine = InlineEngine(draft.runner)
    with pytest.raises(InvalidArgument, match="a row is 96 bfloat16 values"):
        engine.call(draft.open, "s", [1, 2, 3], 0, "", SamplingParams(), rows(2, width=95))
    with pytest.raises(InvalidArgument, match="3 rows of hidden states for 2 positions"):
        engine.call(draft.open, "t", [1, 2, 3], 0, "", SamplingParams(), rows(3))
    engine.call(draft.open, "u", [1, 2, 3], 0, "", SamplingParams(), rows(2))
    with pytest.raises(InvalidArgument, match="2 rows of hidden states for 1 positions"):
        engine.call(draft.propose, "u", 4, [9], 2, None, rows(2))


def test_a_model_drafter_refuses_hidden_states(tiny_target_dir):
    from outrider.config import DraftWorkerConfig, EngineConfig
    from outrider.draft_worker.main import build_sessions

    sessions = build_sessions(
        DraftWorkerConfig(
            model=str(tiny_target_dir), drafter="model", engine=EngineConfig(dtype="float64")
        )
    )
    with pytest.raises(InvalidArgument, match="reads no hidden states"):
        InlineEngine(sessions.runner).call(
            sessions.open, "s", [1, 2, 3], 0, "", SamplingParams(), rows(2)
        )
