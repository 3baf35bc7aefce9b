"""Session-wide fixtures: tiny tokenizer and model directories, built once per test session.

Every model directory is self-contained (weights, config, generation config and the
tokenizer files), so `AutoTokenizer.from_pretrained(dir)` and
`AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float64)` both work on it.

* `tiny_target_dir` — the target model (seed 0).
* `tiny_draft_same_dir` — an exact copy of the target (same seed): every draft is accepted.
* `tiny_draft_other_dir` — an unrelated model (seed 1): most drafts are rejected.
* `tiny_head_dir` — a random EAGLE-3 head for the target (most drafts are rejected).
* `tiny_gguf` — the target written as a GGUF file, for the gguf drafter (llama.cpp):
  nearly every draft is accepted.
* `tiny_gguf_other_vocab` — the same model over another tokenizer's vocabulary.
* `cluster` — real service processes (`tests/stress/cluster.py`), stopped after the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import (
    build_tiny_gguf,
    build_tiny_head,
    build_tiny_model_dir,
    build_tiny_sentencepiece_tokenizer,
    build_tiny_tokenizer,
)

TARGET_SEED = 0
OTHER_DRAFT_SEED = 1


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-target"), tiny_tokenizer_dir, seed=TARGET_SEED
    )


@pytest.fixture(scope="session")
def tiny_draft_same_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-draft-same"), tiny_tokenizer_dir, seed=TARGET_SEED
    )


@pytest.fixture(scope="session")
def tiny_draft_other_dir(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path
) -> Path:
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-draft-other"), tiny_tokenizer_dir, seed=OTHER_DRAFT_SEED
    )


@pytest.fixture
async def cluster(tmp_path: Path):
    from tests.stress.cluster import Cluster

    cluster = Cluster(tmp_path)
    try:
        yield cluster
    finally:
        await cluster.close()


@pytest.fixture(scope="session")
def tiny_head_dir(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> Path:
    return build_tiny_head(tmp_path_factory.mktemp("tiny-head"), tiny_target_dir, seed=2)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> Path:
    return build_tiny_gguf(tiny_target_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_gguf_other_vocab(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gguf-other-vocab")
    build_tiny_sentencepiece_tokenizer(directory / "tokenizer")
    return build_tiny_gguf(
        tiny_target_dir, directory / "other.gguf", tokenizer_dir=directory / "tokenizer"
    )
