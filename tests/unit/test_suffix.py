"""Suffix decoding's drafts: the continuation that most often followed the
history's longest earlier match, in the session's own history or in the
outputs of earlier sessions, as long as the match and as likely as the
limits allow; the shared outputs bounded by a token budget."""

import random

import pytest

from outrider.drafters.suffix import (
    MAX_DEPTH,
    SAMPLES,
    Limits,
    SuffixCache,
    SuffixDecoding,
    SuffixIndex,
)

WIDE = Limits(max_spec_factor=4.0, min_token_prob=0.0)


def run_session(drafter: SuffixDecoding, prompt: list[int], output: list[int]):
    """A session that committed ``output`` one token a round: its drafts."""
    session = drafter.index(len(prompt))
    history = list(prompt)
    drafts = [session.match(history, 8)]
    for token in output:
        history.append(token)
        drafts.append(session.match(history, 8))
    return session, drafts


def test_a_later_session_drafts_what_an_earlier_one_output():
    drafter = SuffixDecoding(limits=WIDE)
    passage = list(range(100, 130))
    run_session(drafter, [1, 2, 3], passage)
    session = drafter.index(12)
    match = session.match([7, 8, *passage[:10]], 8)
    assert match.tokens == passage[10:18]
    assert drafter.cache.hits == 1


def test_the_draft_follows_the_most_frequent_continuation():
    index = SuffixIndex()
    for i, follow in enumerate([[9, 9], [9, 9], [9, 9], [5, 5]]):
        index.extend(i, [1, 2, 3, 4, *follow])
    draft = index.draft([0, 2, 3, 4], 8, WIDE)
    assert draft.tokens[0] == 9 and draft.probs[0] == pytest.approx(0.75)
    assert draft.match_len == 3


def test_a_longer_match_picks_the_continuation_after_it_and_drafts_further():
    index = SuffixIndex()
    index.extend(0, [7, 7, 1, 2, 3, 5, 6, 7, 8])
    index.extend(1, [0, 0, 1, 2, 3, 9, 9, 9, 9])
    index.extend(2, [4, 4, 1, 2, 3, 9, 9, 9, 9])
    draft = index.draft([7, 7, 1, 2, 3], 8, Limits(max_spec_factor=1.0, min_token_prob=0.1))
    assert draft.tokens == [5, 6, 7, 8] and draft.match_len == 5  # (most follow 9, but not here)
    short = index.draft([6, 1, 2, 3], 8, Limits(max_spec_factor=1.0, min_token_prob=0.1))
    assert len(short.tokens) <= 3  # max_spec_factor × a match of 3


def test_min_token_prob_ends_the_draft_where_the_path_gets_unlikely():
    index = SuffixIndex()
    for i in range(4):
        index.extend(i, [1, 2, 3, 4, 10 + i])  # one path to 4, then four ways on
    draft = index.draft([1, 2, 3], 8, Limits(max_spec_factor=4.0, min_token_prob=0.3))
    assert draft.tokens == [4]


def test_only_the_latest_samples_of_an_ngram_are_kept():
    index = SuffixIndex()
    for i in range(SAMPLES + 5):
        index.extend(i, [1, 2, 3, 50 + i])
    draft = index.draft([1, 2, 3], 1, WIDE)
    assert draft.tokens == [50 + SAMPLES + 4]  # ties: the latest
    assert draft.probs[0] == pytest.approx(1 / SAMPLES)


def test_removed_sequences_leave_no_occurrence():
    index = SuffixIndex()
    index.extend(0, [1, 2, 3, 4])
    index.extend(1, [1, 2, 3, 5])
    index.remove(0)
    assert index.draft([1, 2, 3], 1, WIDE).tokens == [5]
    index.remove(1)
    assert index.tokens == 0 and not index._followed


def test_the_shared_outputs_keep_to_their_budget_the_oldest_evicted_first():
    cache = SuffixCache(max_tokens=100)
    outputs = [cache.new_output() for _ in range(5)]
    rng = random.Random(0)
    for output in outputs:
        cache.extend(output, [rng.randrange(1000) for _ in range(40)])
        assert cache.tokens <= 100 or len(cache.index.sequences) == 1
    assert sorted(cache.index.sequences) == outputs[-2:]


def test_a_session_prefers_the_better_of_its_own_and_the_shared_draft():
    drafter = SuffixDecoding(limits=WIDE)
    # Three sessions output [1, 2, 3] and then 40s; this session's own
    # history followed [1, 2, 3] with 41 once and 42 once.
    for _ in range(3):
        run_session(drafter, [0], [1, 2, 3, *[40] * 6])
    own_history = [1, 2, 3, 41, 5, 1, 2, 3, 42, 6, 1, 2, 3]
    hits = drafter.cache.hits
    assert (
        drafter.index(len(own_history)).match(own_history, 4).tokens == [40] * 4
    )  # certain beats even odds
    assert drafter.cache.hits == hits + 1
    mine = SuffixDecoding(limits=WIDE).index(len(own_history)).match(own_history, 4)
    assert mine.tokens[0] == 42 and mine.n == 3  # alone: the latest of two, p = 0.5


def test_a_match_reaches_back_at_most_max_depth():
    index = SuffixIndex()
    context = list(range(1, MAX_DEPTH + 20))
    index.extend(0, [*context, 999])
    assert index.draft(context, 4, WIDE).match_len == MAX_DEPTH


def test_the_evidence_bands_the_first_drafts_probability():
    drafter = SuffixDecoding(limits=WIDE)
    session = drafter.index(3)
    assert session.match([1, 2, 3], 4).n == 0  # nothing to draft from
    history = [1, 2, 3, 4, 1, 2, 3]
    match = session.match(history, 4)
    assert match.tokens[:1] == [4] and match.n == 5  # the only continuation: p = 1
