"""The EAGLE-3 head's paged forward against its dense reference, the target's
hidden states against transformers', and the published layout loading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from outrider.eagle.forward import EagleForward, check_head
from outrider.eagle.head import EagleHead, HeadConfig, load_head
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import PagedRunner
from outrider.engine.scheduler import Row

TARGET = LlamaConfig(
    vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


def random_head(config: HeadConfig, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(config)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0, 0.3)
        head.set_draft_vocab(torch.randperm(config.vocab_size)[: config.draft_vocab_size])
    return head.double()


def test_paged_forward_equals_the_dense_head_over_chunks_and_rows():
    config = HeadConfig.for_target(TARGET, draft_vocab_size=40)
    head = random_head(config)
    embed = torch.randn(TARGET.vocab_size, TARGET.hidden_size, dtype=torch.float64)
    forward = EagleForward(head, embed, dtype=torch.float64)
    runner = PagedRunner(forward, BlockPool(16, 4))
    tokens = torch.randint(0, 97, (2, 11))
    features = torch.randn(2, 11, config.hidden_size, dtype=torch.float64)
    positions = torch.arange(11).expand(2, 11)
    want_logits, want_prenorm = head(embed[tokens], features, positions)

    caches = [runner.new_kv(), runner.new_kv()]
    got: list[list[torch.Tensor]] = [[], []]
    hidden: list[list[torch.Tensor]] = [[], []]
    for start, stop in ((0, 5), (5, 6), (6, 11)):  # a prefill chunk, a step, a verify-like chunk
        rows = []
        for r, kv in enumerate(caches):
            kv.reserve(stop)
            rows.append(
                Row(kv, tokens[r, start:stop].tolist(), stop - start, features[r, start:stop])
            )
        with torch.inference_mode():
            for r, out in enumerate(runner.execute(rows)):
                assert out is not None and out.hidden is not None
                got[r].append(out.values)
                hidden[r].append(out.hidden)
    draft_ids = head.draft_to_target
    for r in range(2):
        logits = torch.cat(got[r])
        torch.testing.assert_close(logits[:, draft_ids], want_logits[r])
        off_vocabulary = torch.ones(97, dtype=torch.bool)
        off_vocabulary[draft_ids] = False
        assert torch.isinf(logits[:, off_vocabulary]).all()
        torch.testing.assert_close(torch.cat(hidden[r]), want_prenorm[r])


def test_target_hidden_states_are_the_inputs_of_the_named_layers():
    torch.manual_seed(1)
    model = LlamaForCausalLM(TARGET).double().eval()
    tokens = torch.randint(0, 97, (13,))
    with torch.no_grad():
        want = model(tokens[None], output_hidden_states=True).hidden_states
    runner = PagedRunner(LlamaForward(model), BlockPool(16, 4))
    kv, sink = runner.new_kv(), []
    for start, stop in ((0, 8), (8, 13)):
        kv.reserve(stop)
        row = Row(kv, tokens[start:stop].tolist(), 1, features=sink, feature_layers=(2, 3, 1))
        with torch.inference_mode():
            runner.execute([row])
    got = torch.cat(sink)
    torch.testing.assert_close(got, torch.cat([want[2][0], want[3][0], want[1][0]], dim=-1))


def test_the_published_layout_loads_and_runs(tmp_path):
    """EAGLE-3's Llama-3.1-8B head as published (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
    its config.json fields and weight names, at a small size, with random weights."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000,
        "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 48,
        "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 256,
        "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": 97, "draft_vocab_size": 32,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    h, i = 48, 96
    shapes = {
        "fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (32, h),
        "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (h, 2 * h),
        "midlayer.self_attn.k_proj.weight": (24, 2 * h),
        "midlayer.self_attn.v_proj.weight": (24, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, h),
        "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
    }  # fmt: skip
    torch.manual_seed(2)
    weights = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in shapes.items()}
    draft_ids = torch.randperm(97)[:32].sort().values
    weights["d2t"] = draft_ids - torch.arange(32)
    weights["t2d"] = torch.zeros(97, dtype=torch.bool)
    weights["t2d"][draft_ids] = True
    save_file(weights, str(tmp_path / "model.safetensors"))

    head = load_head(tmp_path, target_num_layers=TARGET.num_hidden_layers)
    assert head.config.aux_layers == (2, 3, 3)
    assert head.config.draft_vocab_size == 32 and head.config.target_hidden_size == 48
    check_head(head.config, TARGET)
    forward = EagleForward(head, torch.randn(97, 48))
    runner = PagedRunner(forward, BlockPool(8, 4))
    kv = runner.new_kv()
    kv.reserve(3)
    fused = forward.fuse(torch.randn(3, 3 * 48))
    with torch.inference_mode():
        (out,) = runner.execute([Row(kv, [5, 6, 7], 3, fused)])
    assert out is not None
    assert set(out.argmax) <= set(draft_ids.tolist())


def test_the_speculators_layout_loads(tmp_path):
    """vllm-project/speculators' EAGLE-3 format: the layer in transformer_layer_config, the
    aux layers at the top, weights under layers.0., the head's own embeddings, and the norm
    before the residual unless it says otherwise (as vLLM reads it)."""
    layer = {
        "hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "model_type": "llama",
    }  # fmt: skip
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer, "draft_vocab_size": 32,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = EagleHead(HeadConfig.from_json(config))
    state = {
        k.replace("midlayer.", "layers.0.", 1): v
        for k, v in reference.state_dict().items()
        if not k.startswith("rotary.")
    }
    state["embed_tokens.weight"] = torch.randn(97, 48)
    save_file(state, str(tmp_path / "model.safetensors"))
    head = load_head(tmp_path)
    assert head.config.aux_layers == (1, 3, 4) and head.config.norm_before_residual
    assert head.embed_tokens is not None
    torch.testing.assert_close(head.embed_tokens.weight, state["embed_tokens.weight"])


def test_a_head_for_another_target_is_refused():
    config = HeadConfig.for_target(TARGET, draft_vocab_size=40)
    other = LlamaConfig(**{**TARGET.to_dict(), "hidden_size": 64})
    with pytest.raises(ValueError, match="hidden states 48 wide"):
        check_head(config, other)
