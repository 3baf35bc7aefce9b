"""Greedy verification on hand-made target tokens (and logits), where the
verdict is known exactly."""

import pytest
import torch

from outrider.sampling import SamplingParams
from outrider.target_worker.verify import verify, verify_greedy

VOCAB = 8


def logits_preferring(*tokens: int) -> torch.Tensor:
    """One row per position; row t puts its maximum on tokens[t]."""
    rows = torch.zeros(len(tokens), VOCAB)
    for t, token in enumerate(tokens):
        rows[t, token] = 5.0
    return rows


def test_mismatch_at_first_position_emits_recovered_token():
    verdict = verify_greedy([3, 4, 5], [6, 4, 5, 1])
    assert (verdict.num_accepted, verdict.next_token) == (0, 6)
    assert verdict.num_accepted + 1 == 1


def test_mismatch_in_the_middle_accepts_the_prefix_then_recovers():
    verdict = verify_greedy([3, 4, 5], [3, 4, 7, 1])
    assert (verdict.num_accepted, verdict.next_token) == (2, 7)


def test_all_drafts_accepted_emits_bonus_token():
    verdict = verify_greedy([3, 4, 5], [3, 4, 5, 1])
    assert (verdict.num_accepted, verdict.next_token) == (3, 1)
    assert verdict.num_accepted + 1 == 4


def test_no_drafts_is_plain_greedy_decoding():
    verdict = verify_greedy([], [2])
    assert (verdict.num_accepted, verdict.next_token) == (0, 2)


def test_acceptance_stops_at_first_mismatch_even_if_later_drafts_match():
    verdict = verify_greedy([3, 0, 5], [3, 4, 5, 1])
    assert (verdict.num_accepted, verdict.next_token) == (1, 4)


@pytest.mark.parametrize("n", [2, 5])
def test_target_tokens_must_number_one_more_than_drafts(n):
    with pytest.raises(ValueError, match=r"K \+ 1 = 4 target tokens"):
        verify_greedy([1, 2, 3], [0] * n)


def test_greedy_verify_takes_the_argmax_of_each_logits_row():
    verdict = verify(
        [3, 4, 5], None, logits_preferring(3, 4, 7, 1), SamplingParams(), start_position=0
    )
    assert (verdict.num_accepted, verdict.next_token) == (2, 7)


@pytest.mark.parametrize("rows", [2, 5])
def test_logits_must_have_one_row_more_than_drafts(rows):
    with pytest.raises(ValueError, match=r"\[K \+ 1, vocab\]"):
        verify([1, 2, 3], None, torch.zeros(rows, VOCAB), SamplingParams(), start_position=0)
