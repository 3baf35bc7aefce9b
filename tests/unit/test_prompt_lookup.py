"""Prompt lookup proposals: the continuation of the latest earlier n-gram match."""

import pytest

from outrider.drafters import PromptLookupDrafter
from outrider.engine import InlineEngine
from outrider.session import Session


def propose(tokens, k, **kwargs):
    # A job that needs no forward pass: an engine without a model runs it.
    session = Session("s", list(tokens))
    proposal = InlineEngine().call(
        PromptLookupDrafter(**kwargs).propose, session, session.tokens, k
    )
    assert proposal.probs == []  # deterministic: a point mass, no q
    return proposal.tokens


def test_proposes_the_continuation_of_the_matching_ngram():
    assert propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]


def test_longest_ngram_wins_over_a_later_shorter_match():
    # "2 3" matches at 1; "3" alone also matches later at 6 -> the 2-gram decides.
    assert propose([1, 2, 3, 4, 0, 0, 3, 7, 2, 3], 1, max_ngram=2) == [4]


def test_latest_occurrence_wins_among_equal_length_matches():
    assert propose([5, 6, 1, 5, 6, 2, 5, 6], 1, max_ngram=2) == [2]


def test_proposal_is_cut_at_the_end_of_the_history():
    assert propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]


def test_no_match_proposes_nothing():
    assert propose([1, 2, 3, 4], 3) == []


def test_single_token_history_proposes_nothing():
    assert propose([7], 3) == []


def test_invalid_ngram_bounds_are_refused():
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
