"""Sizing the KV cache budget from free memory (outrider.memory)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from outrider import memory
from outrider.memory import (
    GPU_FRACTION,
    MARGIN_BYTES,
    cache_budget,
    kv_bytes_per_token,
    worker_cache_budget,
)

GIB = 1 << 30


def test_kv_bytes_per_token_is_layers_kv_heads_head_dim_two_dtype_size():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; float32.
    config = LlamaConfig(
        num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3
    )
    assert kv_bytes_per_token(config, torch.float32) == 30 * 3 * 64 * 2 * 4 == 46_080
    assert kv_bytes_per_token(config, torch.bfloat16) == 23_040


def test_kv_bytes_per_token_takes_an_explicit_head_dim_and_defaults_kv_heads_to_heads():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=32)
    config.num_key_value_heads = None
    assert kv_bytes_per_token(config, torch.float64) == 2 * 4 * 32 * 2 * 8


def test_budget_is_a_fraction_of_what_is_free_after_the_margin():
    budget = cache_budget(
        kv_bytes_per_token=46_080,
        available_bytes=9 * GIB,
        on_gpu=False,
        max_sessions=64,
        max_context=8192,
    )
    assert (
        budget.max_cached_tokens
        == int((9 * GIB - MARGIN_BYTES) * memory.CPU_FRACTION // 46_080)
        == 74_565
    )
    gpu = cache_budget(
        kv_bytes_per_token=46_080,
        available_bytes=9 * GIB,
        on_gpu=True,
        max_sessions=64,
        max_context=8192,
    )
    assert gpu.max_cached_tokens == int(8 * GIB * GPU_FRACTION // 46_080) > budget.max_cached_tokens


def test_budget_is_capped_at_what_the_sessions_can_hold():
    budget = cache_budget(
        kv_bytes_per_token=1024,
        available_bytes=64 * GIB,
        on_gpu=True,
        max_sessions=4,
        max_context=512,
    )
    assert budget.max_cached_tokens == budget.cap_tokens == 2048


def test_no_free_memory_is_a_clear_error():
    with pytest.raises(ValueError, match="--max-cached-tokens"):
        cache_budget(
            kv_bytes_per_token=1024,
            available_bytes=MARGIN_BYTES // 2,
            on_gpu=False,
            max_sessions=1,
            max_context=8,
        )


def test_available_bytes_reads_mem_available_on_the_cpu(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684092 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n")
    assert memory.available_bytes(torch.device("cpu"), meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(OSError, match="MemAvailable"):
        memory.available_bytes(torch.device("cpu"), meminfo)


@pytest.fixture(scope="module")
def tiny_model():
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(torch.float64)


def test_an_explicit_budget_wins(tiny_model, monkeypatch):
    monkeypatch.setattr(
        memory, "available_bytes", lambda device: pytest.fail("memory was measured")
    )
    assert (
        worker_cache_budget(tiny_model, max_sessions=8, max_context=64, max_cached_tokens=100)
        == 100
    )


def test_the_worker_budget_is_sized_from_the_model_and_free_memory(tiny_model, monkeypatch):
    monkeypatch.setattr(
        memory, "available_bytes", lambda device: MARGIN_BYTES + 10 * 2 * 8 * 2 * 8 * 1000
    )
    # 2 layers x 1 KV head x 8 dims x 2 x 8 bytes = 256 bytes a token; 0.4 of 2,560,000 bytes.
    assert (
        worker_cache_budget(tiny_model, max_sessions=1000, max_context=64, max_cached_tokens=None)
        == 4000
    )


def test_a_cpu_budget_is_capped_at_four_gib():
    budget = cache_budget(
        kv_bytes_per_token=46_080,
        available_bytes=64 * GIB,
        on_gpu=False,
        max_sessions=64,
        max_context=8192,
    )
    assert budget.max_cached_tokens == memory.CPU_MAX_BYTES // 46_080


def test_a_cpu_cache_is_zeroed_and_resident_only_where_written(tiny_target_dir):
    from outrider.engine.causal_lm import load_causal_lm
    from outrider.engine.llama import LlamaForward

    def resident_mib() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / (1 << 20)

    forward = LlamaForward(load_causal_lm(str(tiny_target_dir), dtype=torch.float32))
    before = resident_mib()
    cache = forward.allocate_cache(num_blocks=200_000, block_size=16)  # ~ GiBs of address space
    assert cache.nbytes > 1 << 30
    assert resident_mib() - before < 64
    assert not cache[:, :, :4].any()
    cache[:, :, 1:3] = 1.0
    assert resident_mib() - before < 64
