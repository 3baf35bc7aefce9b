"""Unit tests of outrider.engine.causal_lm and the linears it installs: a
checkpoint loaded frozen, cut to its first layers, its small-batch linears
computing what ``F.linear`` computes.

No network and no real model: tiny randomly initialised models built from a
config.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from outrider.engine import causal_lm, ops
from tests.tiny import tiny_llama

# --------------------------------------------------------------------------- small-batch linears


@pytest.fixture(params=["transposed", "packed"])
def path(request, monkeypatch):
    """Every product computed by one of the engine's own paths, wherever it
    is the slower here; ``pack(weights)`` packs weights for the packed one."""
    monkeypatch.setattr(ops, "_packs", {})
    if request.param == "packed" and ops._pack(torch.zeros(2, 2)) is None:
        pytest.skip("no oneDNN product here")
    with ops.linear_path(request.param):
        yield request.param


def pack(weights) -> None:
    """Packs ``weights`` for oneDNN's product, as a tuning that chose it does."""
    for weight in weights:
        if (packed := ops._pack(weight)) is not None:
            ops._packs[id(weight)] = packed


@pytest.mark.parametrize("rows", [1, 5, 11, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_small_batch_linear_matches_f_linear(rows, bias, path):
    torch.manual_seed(rows)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(1, rows, 24)
    expected = F.linear(x, layer.weight, layer.bias)
    ops.use_small_batch_linears(layer)
    assert isinstance(layer, ops.SmallBatchLinear)
    pack([layer.weight])
    out = layer(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("rows", [1, 5, 11, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_batch_linears_give_stock_logits_on_tiny_llama(rows, dtype, path):
    stock = tiny_llama(dtype)
    fast = copy.deepcopy(stock)
    ops.use_small_batch_linears(fast)
    pack(m.weight for m in fast.modules() if isinstance(m, ops.SmallBatchLinear))
    ids = torch.randint(0, 300, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        expected, out = stock(ids).logits, fast(ids).logits
    torch.testing.assert_close(out, expected)
    assert torch.equal(out.argmax(-1), expected.argmax(-1))


def test_small_batch_linears_swap_every_linear_in_place():
    model = tiny_llama()
    head = model.lm_head.weight
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    ops.use_small_batch_linears(model)
    ops.use_small_batch_linears(model)  # idempotent
    assert linears and all(type(m) is ops.SmallBatchLinear for m in linears)
    assert type(model.lm_head) is ops.SmallBatchLinear
    assert model.lm_head.weight is head  # nothing copied


def test_the_paths_are_timed_in_turn():
    # Timed one after the other, a spell of the machine running slow (another
    # process starting beside the worker) could fall on one path alone.
    calls = []
    fastest = ops._fastest_in_turn(lambda: calls.append("a"), lambda: calls.append("b"))
    assert calls == ["a", "b"] * (1 + ops.TUNING_REPEATS)
    assert len(fastest) == 2 and all(seconds >= 0 for seconds in fastest)


def path_of(product) -> str:
    if product is F.linear:
        return "library"
    return "transposed" if product.func is ops._transposed_linear else "packed"


@pytest.mark.skipif(ops._pack(torch.zeros(2, 2)) is None, reason="no oneDNN product here")
def test_tuning_times_each_count_of_rows_through_every_weight_and_keeps_the_fastest(monkeypatch):
    monkeypatch.setattr(ops, "_paths", {})
    monkeypatch.setattr(ops, "_packs", {})
    timed = []

    def seconds(fn):
        # Transposed is the fastest for even counts of rows, packed for odd
        # ones past 8 and for the counts past 16, the library for the rest.
        product, inputs, weights = fn.args
        path = path_of(product)
        (rows,) = {x.shape[0] for x in inputs.values()}
        timed.append((rows, path))
        assert [tuple(w.shape) for w in weights] == [(8, 4), (8, 4), (3, 4)]  # in turn
        fn()  # each product runs on the input of its width
        if rows > ops.SMALL_BATCH_ROWS:
            return {"library": 1.0, "packed": 0.5}[path]
        fastest = "transposed" if rows % 2 == 0 else "packed" if rows > 8 else "library"
        return 0.5 if path == fastest else 1.0

    monkeypatch.setattr(ops, "_fastest_in_turn", lambda *fns: [seconds(fn) for fn in fns])
    weights = [torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(3, 4), torch.zeros(8), object()]
    # two shapes, 16 counts each and the count past them
    assert ops.tune_linears(weights) == {"library": 8, "transposed": 16, "packed": 10}
    assert len(timed) == len(set(timed)) == 16 * 3 + 2
    assert {rows for rows, _ in timed} == {*range(1, 17), ops.LARGE_BATCH_ROWS}
    assert ops._paths[(8, 4, 2, torch.float32)] == "transposed"
    assert ops._paths[(3, 4, 9, torch.float32)] == "packed"
    assert ops._paths[(3, 4, 17, torch.float32)] == "packed"  # every count past 16
    assert ops._paths[(8, 4, 3, torch.float32)] == "library"
    assert set(ops._packs) == {id(w) for w in weights[:3]}  # kept: packed won somewhere
    for rows in (2, 9, 40):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(ops.linear(x, weights[0]), F.linear(x, weights[0]))


def test_packed_weights_go_with_their_weights(monkeypatch):
    monkeypatch.setattr(ops, "_packs", {})
    last_wins = lambda *fns: [float(len(fns) - i) for i in range(len(fns))]  # noqa: E731
    monkeypatch.setattr(ops, "_fastest_in_turn", last_wins)
    weight = torch.randn(40, 24)
    ops.tune_linears([weight])  # the last path timed wins: packed where there is one
    assert len(ops._packs) == (ops._pack(weight) is not None)
    del weight
    gc.collect()
    assert ops._packs == {}


def test_a_tuned_linear_matches_f_linear_at_every_count_of_rows(monkeypatch):
    monkeypatch.setattr(ops, "_paths", {})
    monkeypatch.setattr(ops, "_packs", {})
    weight, bias = torch.randn(40, 24), torch.randn(40)
    ops.tune_linears([weight])
    for rows in range(1, 2 * ops.SMALL_BATCH_ROWS):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(ops.linear(x, weight, bias), F.linear(x, weight, bias))


# --------------------------------------------------------------------------- loading and early exit


@pytest.fixture
def saved_tiny_llama(tmp_path: Path) -> Path:
    directory = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(directory)
    return directory


def test_load_causal_lm_from_directory_is_frozen_and_fast(saved_tiny_llama):
    model = causal_lm.load_causal_lm(str(saved_tiny_llama))
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert type(model.lm_head) is ops.SmallBatchLinear
    plain = causal_lm.load_causal_lm(str(saved_tiny_llama), fast_small_batch=False)
    assert type(plain.lm_head) is nn.Linear


@pytest.mark.parametrize("layers", [1, 2])
def test_num_layers_keeps_first_layers_and_forward_works(saved_tiny_llama, layers):
    full = causal_lm.load_causal_lm(str(saved_tiny_llama))
    model = causal_lm.load_causal_lm(str(saved_tiny_llama), num_layers=layers)
    assert len(model.model.layers) == layers == model.config.num_hidden_layers
    torch.testing.assert_close(
        model.model.layers[0].mlp.up_proj.weight, full.model.layers[0].mlp.up_proj.weight
    )
    ids = torch.randint(0, 300, (1, 6))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
    assert logits.shape == (1, 6, 300) and torch.isfinite(logits).all()
    assert cache.get_seq_length() == 6 and len(cache.layers) == layers


@pytest.mark.parametrize("layers", [0, 3, -1])
def test_num_layers_out_of_range_names_the_layer_count(saved_tiny_llama, layers):
    with pytest.raises(ValueError, match="between 1 and 2"):
        causal_lm.load_causal_lm(str(saved_tiny_llama), num_layers=layers)


def test_truncation_trims_per_layer_config_lists():
    config = Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    causal_lm.truncate_layers(model, 2)
    assert model.config.layer_types == ["full_attention"] * 2
    with torch.no_grad():
        model(torch.randint(0, 300, (1, 4)), past_key_values=DynamicCache(config=model.config))
