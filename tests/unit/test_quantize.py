"""The int4 drafter's weights: 4-bit groups and 8-bit rows computed by
torch's kernels equal the weights they stand for, the Llama-family forward
runs on them as transformers does, and the draft worker really quantizes."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from outrider.config import (
    DraftWorkerConfig,
    EngineConfig,
    ServiceConfig,
    TargetWorkerConfig,
    WorkerLimits,
)
from outrider.engine.build import build_runner
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import PagedRunner
from outrider.engine.scheduler import Row
from outrider.quantize import Int4Weight, Int8Weight, QuantizedLinear, quantize_linears


def _bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the kernels' bfloat16 activations and sums."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=0.02 * scale)


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_int4_levels_are_within_half_a_step_of_the_weight(group_size):
    torch.manual_seed(0)
    weight = torch.randn(96, 512)
    dequantized = Int4Weight.quantize(weight, group_size).dequantize()
    groups = weight.reshape(-1, group_size)
    half_step = (
        ((groups.amax(1) - groups.amin(1)) / 15 / 2)
        .repeat_interleave(group_size)
        .reshape(weight.shape)
    )
    error = (dequantized - weight).abs()
    assert (error <= half_step * 1.05 + 0.01).all()  # bfloat16 scales and zeros: a little more
    assert error.mean() > 0.01  # it is not the float weight


@pytest.mark.parametrize(
    "shape", [(48, 64), (10, 40), (33, 100)], ids=["aligned", "padded rows", "padded both"]
)
def test_int4_linear_is_the_product_with_its_levels_at_any_shape(shape):
    torch.manual_seed(1)
    weight, bias = torch.randn(shape), torch.randn(shape[0])
    quantized = Int4Weight.quantize(weight)
    assert quantized.shape == shape
    x = torch.randn(2, 5, shape[1], dtype=torch.float64)
    out = quantized.linear(x, bias.double())
    assert out.shape == (2, 5, shape[0]) and out.dtype == torch.float64
    _bf16_close(out, x @ quantized.dequantize().double().T + bias.double())


def test_int4_weights_take_a_sixth_of_float32_bytes():
    weight = torch.randn(1536, 576)
    assert Int4Weight.quantize(weight).nbytes <= weight.nbytes / 6


def test_unsupported_group_size_is_refused():
    with pytest.raises(ValueError, match="group size 48"):
        Int4Weight.quantize(torch.randn(16, 96), 48)


def test_int8_rows_are_within_half_a_step_and_multiply_as_their_levels():
    torch.manual_seed(2)
    weight = torch.randn(100, 64)
    quantized = Int8Weight.quantize(weight)
    step = weight.abs().amax(1, keepdim=True) / 127
    assert ((quantized.dequantize() - weight).abs() <= step * 0.51).all()
    x = torch.randn(3, 64)
    _bf16_close(quantized.linear(x), x @ quantized.dequantize().T)


@pytest.mark.parametrize("quantize", [Int4Weight.quantize, Int8Weight.quantize], ids=["4", "8"])
def test_a_product_of_no_rows_is_empty_and_calls_no_kernel(quantize, monkeypatch):
    """A step none of whose tokens needs logits (a draft's prefill) puts no
    rows through the LM head: torch's CUDA int8 kernel launches an empty grid
    for them and leaves an error for the next operation (tests/cuda)."""
    quantized = quantize(torch.randn(40, 64))
    for kernel in ("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"):
        monkeypatch.setattr(torch.ops.aten, kernel, None)  # any call fails
    out = quantized.linear(torch.randn(0, 64, dtype=torch.float64), torch.zeros(40))
    assert out.shape == (0, 40) and out.dtype == torch.float64


SHAPE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.float64).eval()


def test_quantize_linears_gives_every_projection_4_bits_and_the_head_8(llama):
    model = copy.deepcopy(llama)
    assert quantize_linears(model) == 2 * 7 + 1
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.quantized, Int4Weight)
    assert isinstance(layer.mlp.down_proj.quantized, Int4Weight)
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(
        model.lm_head.quantized, Int8Weight
    )
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_the_paged_int4_forward_equals_transformers_on_the_same_4_bit_weights(llama):
    torch.manual_seed(3)
    sequence = torch.randint(0, 97, (30,)).tolist()
    reference = copy.deepcopy(llama)
    quantize_linears(reference)
    runner = PagedRunner(LlamaForward(copy.deepcopy(llama), int4_group_size=32), BlockPool(16, 4))
    kv = runner.new_kv()
    kv.reserve(len(sequence))
    with torch.inference_mode():
        expected = reference(torch.tensor([sequence])).logits[0]
        out = runner.execute([Row(kv, sequence, len(sequence))])[0]
        full = llama(torch.tensor([sequence])).logits[0]
    # q/k/v and gate/up are fused before quantizing: the same groups, so the same levels.
    _bf16_close(out.values, expected)
    assert (out.values - full).abs().max() > 1e-3  # and they are not the float weights


def test_int4_needs_the_llama_family_forward():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(ValueError, match="int4 drafter runs the Llama-family forward only"):
        build_runner(
            model,
            limits=WorkerLimits(max_cached_tokens=64),
            engine=EngineConfig(threads=1),
            max_context=64,
            int4_group_size=32,
        )


def test_the_int4_draft_worker_quantizes_and_agrees_with_its_target(tiny_target_dir):
    """The test that fails if quantization is silently skipped: the draft
    worker's logits are not the target's, yet their argmax mostly is."""
    from outrider.draft_worker.main import build_sessions
    from outrider.target_worker.main import build_sessions as build_target

    limits = WorkerLimits(max_cached_tokens=1024)
    engine = EngineConfig(dtype="float64", threads=1)
    address = ServiceConfig()
    draft = build_sessions(
        DraftWorkerConfig(
            service=address,
            drafter="int4",
            model=str(tiny_target_dir),
            engine=engine,
            limits=limits,
        )
    )
    target = build_target(
        TargetWorkerConfig(
            service=address, model=str(tiny_target_dir), engine=engine, limits=limits
        )
    )
    layer = draft.runner.forward.layers[0]
    assert isinstance(layer.qkv, Int4Weight) and isinstance(
        draft.runner.forward.lm_head, Int8Weight
    )
    torch.manual_seed(4)
    sequence = torch.randint(0, draft.runner.vocab_size, (200,)).tolist()
    logits = []
    for runner in (draft.runner, target.runner):
        kv = runner.new_kv()
        kv.reserve(len(sequence))
        with torch.inference_mode():
            logits.append(runner.execute([Row(kv, sequence, len(sequence))])[0].values)
        kv.free()
    drafted, verified = logits
    assert (drafted - verified).abs().max() > 1e-2
    assert (drafted.argmax(-1) == verified.argmax(-1)).double().mean() >= 0.9
