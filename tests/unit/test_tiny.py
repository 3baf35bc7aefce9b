"""Sanity checks for the tiny test models and tokenizers (tests/tiny.py, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tests.tiny import (
    EOS_TOKEN_ID,
    build_tiny_llama,
    build_tiny_sentencepiece_tokenizer,
    build_tiny_tokenizer,
)

NON_ASCII = "héllo wörld, Straße 日本語 🙂 🎉 «ok» Привет"


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def _load(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def _prompt_ids(model_dir: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello world"}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    return torch.tensor([ids])


@pytest.mark.parametrize("builder", [build_tiny_tokenizer, build_tiny_sentencepiece_tokenizer])
def test_tokenizer_builder_writes_identical_files_every_call(
    builder: Callable[[Path], PreTrainedTokenizerBase],
    tmp_path: Path,
) -> None:
    builder(tmp_path / "a")
    builder(tmp_path / "b")
    assert _file_bytes(tmp_path / "a") == _file_bytes(tmp_path / "b")


def test_llama_builder_writes_identical_files_every_call(tmp_path: Path) -> None:
    build_tiny_llama(tmp_path / "a", vocab_size=64, seed=3, num_layers=1, hidden_size=32)
    build_tiny_llama(tmp_path / "b", vocab_size=64, seed=3, num_layers=1, hidden_size=32)
    assert _file_bytes(tmp_path / "a") == _file_bytes(tmp_path / "b")


@pytest.mark.parametrize("builder", [build_tiny_tokenizer, build_tiny_sentencepiece_tokenizer])
def test_tokenizer_round_trips_non_ascii_text_with_multi_token_characters(
    builder: Callable[[Path], PreTrainedTokenizerBase],
    tmp_path: Path,
) -> None:
    builder(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode(NON_ASCII)
    assert tokenizer.decode(ids) == NON_ASCII
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some character spans tokens


def test_tokenizer_has_chatml_special_tokens_and_template(tiny_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert tokenizer.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.bos_token_id is None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_dir_is_self_contained_and_loads_in_float64(tiny_target_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = _load(tiny_target_dir)
    assert model.dtype == torch.float64
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == EOS_TOKEN_ID


def test_same_seed_gives_identical_logits(tiny_target_dir: Path, tiny_draft_same_dir: Path) -> None:
    ids = _prompt_ids(tiny_target_dir)
    with torch.no_grad():
        target = _load(tiny_target_dir)(ids).logits
        draft = _load(tiny_draft_same_dir)(ids).logits
    assert torch.equal(target, draft)


def test_different_seeds_give_different_argmaxes(
    tiny_target_dir: Path, tiny_draft_other_dir: Path
) -> None:
    ids = _prompt_ids(tiny_target_dir)
    with torch.no_grad():
        target = _load(tiny_target_dir)(ids).logits.argmax(-1)
        other = _load(tiny_draft_other_dir)(ids).logits.argmax(-1)
    assert (target != other).float().mean() > 0.5


def test_greedy_generation_does_not_collapse_into_one_token(tiny_target_dir: Path) -> None:
    ids = _prompt_ids(tiny_target_dir)
    out = _load(tiny_target_dir).generate(
        ids, max_new_tokens=30, do_sample=False, eos_token_id=None
    )
    generated = out[0, ids.shape[1] :].tolist()
    assert len(generated) == 30
    assert len(set(generated)) >= 5
