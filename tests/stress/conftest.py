"""Fixtures of the stress tests: the prompt they all send and its reference
output (each test's cluster of real service processes: ``cluster`` in
tests/conftest.py)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.integration.harness import reference_greedy

PROMPT = "Once upon a time there was a fox"
MAX_NEW = 400
"""Long enough for a stream to outlive a kill and a restart (the tiny model's context is 512)."""


@pytest.fixture(scope="session")
def prompt_ids(tiny_target_dir) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny_target_dir)(PROMPT)["input_ids"]


@pytest.fixture(scope="session")
def reference(tiny_target_dir, prompt_ids) -> list[int]:
    """Target-only greedy output (Hugging Face generate), EOS ignored."""
    ids = reference_greedy(tiny_target_dir, prompt_ids, MAX_NEW, eos=None)
    assert len(ids) == MAX_NEW
    return ids
