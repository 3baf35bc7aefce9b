"""Suffix decoding in the coordinator: drafts from every output the
deployment has produced, not only the session's own history.

SuffixDecoding (Arctic Inference; Oliaro et al., arXiv 2411.04975; vLLM's
``method: suffix``) keeps the session's prompt and the outputs of earlier
requests in suffix trees, finds the longest suffix of the history that
occurred before, and drafts the continuation that most often followed it,
each token as long as the estimated chance of the path so far stays above
``min_token_prob`` and no further than ``max_spec_factor`` × the match
length: a long match earns a long draft, a common continuation a likely
one. Agents, coding assistants and RAG pipelines resend and rewrite the same
text, which is where it pays.

Arctic's trees are C++ (path-compressed, every suffix counted). Here a
:class:`SuffixIndex` keeps, for every 3-gram, where it was followed — the
latest :data:`SAMPLES` occurrences — and a draft walks those occurrences as
Arctic walks the tree below the matched node: each occurrence's match is
extended backwards (up to :data:`MAX_DEPTH` tokens), and for the longest
matches the continuation is chosen token by token by how many of the
occurrences still following the path continue with it. A lookup costs a
dictionary access and a walk over at most :data:`SAMPLES` occurrences,
whatever the tree holds; an update a dictionary append per token.

Each session matches two indexes and keeps the better draft (the higher
sum of estimated probabilities, as Arctic chooses): its own history (prompt
and output), and the deployment's :class:`SuffixCache` of outputs, shared by
every session of this coordinator, up to a token budget, the oldest output
evicted first. Like prompt lookup, it drafts in this process, as soon as a
round commits; the plan of K learns its drafts' acceptance by the
estimated probability of their first token (:attr:`SuffixDraft.evidence`),
depth by depth.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outrider.drafters.lookup import Lookup, Match

if TYPE_CHECKING:
    from outrider.config import CoordinatorConfig

DRAFTER = "suffix"
NGRAM = 3
"""Occurrences are indexed by the 3 tokens before them: the shortest match."""
MAX_DEPTH = 24
"""The longest match counted (vLLM's ``suffix_decoding_max_tree_depth``)."""
SAMPLES = 16
"""The latest occurrences of a 3-gram a draft is drawn from."""
LONGEST_MATCHES = 3
"""How many of the longest distinct match lengths a lookup tries."""
EVIDENCE_LEVELS = 5
"""The first draft's estimated probability in this many bands: the
evidence the plan of K learns acceptance by (1 .. 5)."""
_ID = (1 << 21) - 1


def _key(a: int, b: int, c: int) -> int:
    """A 3-gram as one int (ids of 21 bits: every vocabulary; a wider id only
    shares a key, and the match check drops it)."""
    return ((a & _ID) << 42) | ((b & _ID) << 21) | (c & _ID)


@dataclass(frozen=True)
class SuffixDraft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    """Each token's estimated probability of the path up to it."""
    match_len: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)

    @property
    def evidence(self) -> int:
        """The first token's estimated probability, banded (0: no draft)."""
        if not self.probs:
            return 0
        return 1 + min(EVIDENCE_LEVELS - 1, int(self.probs[0] * EVIDENCE_LEVELS))


NO_DRAFT = SuffixDraft()


@dataclass(frozen=True)
class Limits:
    """How far a draft goes: at most ``max_spec_factor`` × its match length
    + ``max_spec_offset`` tokens, each while the path's estimated probability
    is at least ``min_token_prob`` (Arctic's and vLLM's parameters)."""

    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1


class SuffixIndex:
    """Token sequences, and where each 3-gram of them was followed (the
    latest :data:`SAMPLES` times)."""

    def __init__(self) -> None:
        self.sequences: dict[int, array[int]] = {}
        self.tokens = 0
        self._followed: dict[int, list[int]] = {}
        """3-gram → ``sequence << 32 | position`` of the tokens that followed it, oldest first."""

    def extend(self, sequence: int, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to ``sequence`` (a new one: empty)."""
        seq = self.sequences.setdefault(sequence, array("i"))
        start = len(seq)
        seq.extend(tokens)
        self.tokens += len(tokens)
        followed = self._followed
        for pos in range(max(start, NGRAM), len(seq)):
            key = _key(seq[pos - 3], seq[pos - 2], seq[pos - 1])
            at = followed.get(key)
            if at is None:
                followed[key] = [sequence << 32 | pos]
            else:
                at.append(sequence << 32 | pos)
                if len(at) > SAMPLES:
                    del at[0]

    def remove(self, sequence: int) -> None:
        seq = self.sequences.pop(sequence)
        self.tokens -= len(seq)
        for pos in range(NGRAM, len(seq)):
            key = _key(seq[pos - 3], seq[pos - 2], seq[pos - 1])
            at = self._followed.get(key)
            if at is not None and (sequence << 32 | pos) in at:
                at.remove(sequence << 32 | pos)
                if not at:
                    del self._followed[key]

    def draft(self, context: Sequence[int], max_tokens: int, limits: Limits) -> SuffixDraft:
        """The likeliest continuation of ``context``'s longest suffixes
        that occurred here (see the module docstring)."""
        if len(context) < NGRAM or max_tokens <= 0:
            return NO_DRAFT
        at = self._followed.get(_key(context[-3], context[-2], context[-1]))
        if not at:
            return NO_DRAFT
        matches = []  # (match length, sequence, position), the latest first
        tail = array("i", context[-NGRAM:])
        for found in reversed(at):
            seq, pos = self.sequences[found >> 32], found & 0xFFFFFFFF
            if seq[pos - NGRAM : pos] != tail:
                continue  # a wide id's shared key
            n, reach = NGRAM, min(MAX_DEPTH, pos, len(context))
            while n < reach and seq[pos - n - 1] == context[-n - 1]:
                n += 1
            matches.append((n, seq, pos))
        best = NO_DRAFT
        for length in sorted({n for n, _, _ in matches}, reverse=True)[:LONGEST_MATCHES]:
            budget = int(length * limits.max_spec_factor + limits.max_spec_offset + 1e-6)
            followers = [(seq, pos) for n, seq, pos in matches if n >= length]
            draft = _walk(followers, min(max_tokens, budget), limits.min_token_prob, length)
            if draft.score > best.score:
                best = draft
        return best


def _walk(
    followers: list[tuple[array[int], int]], max_tokens: int, min_prob: float, match_len: int
) -> SuffixDraft:
    """Token by token, the continuation most of ``followers`` (sequence,
    position: the latest first) take, its chance the share of those still
    on the path that take it, times the chance of the path before it."""
    tokens: list[int] = []
    probs: list[float] = []
    prob, j = 1.0, 0
    while len(tokens) < max_tokens and followers:
        counts: dict[int, int] = {}
        for seq, pos in followers:
            if pos + j < len(seq):
                token = seq[pos + j]
                counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)  # ties: the latest
        prob *= counts[token] / len(followers)
        if prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        followers = [(s, p) for s, p in followers if p + j < len(s) and s[p + j] == token]
        j += 1
    return SuffixDraft(tokens, probs, match_len) if tokens else NO_DRAFT


class SuffixCache:
    """The deployment's outputs, for every session's drafts: at most
    ``max_tokens`` tokens, the oldest output evicted first."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"a suffix cache needs room for a token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.index = SuffixIndex()
        self._order: OrderedDict[int, None] = OrderedDict()
        self._ids = itertools.count()
        self.lookups = 0
        """Drafts looked up (for the metrics: and of those, ``hits``)."""
        self.hits = 0
        """Lookups whose draft came from here (a better one than the session's own)."""

    @property
    def tokens(self) -> int:
        return self.index.tokens

    def new_output(self) -> int:
        """An id for a new output."""
        output = next(self._ids)
        self._order[output] = None
        return output

    def extend(self, output: int, tokens: Sequence[int]) -> None:
        """Adds the tokens an output just committed, evicting the oldest outputs past the budget."""
        if not tokens or output not in self._order:  # (evicted while it ran)
            return
        self.index.extend(output, tokens)
        while self.index.tokens > self.max_tokens and len(self._order) > 1:
            oldest = next(iter(self._order))
            if oldest == output:
                break
            del self._order[oldest]
            if oldest in self.index.sequences:
                self.index.remove(oldest)


class SuffixDecoding(Lookup):
    """The ``suffix`` drafter: a :class:`SuffixSession` per session, over
    the shared :class:`SuffixCache`."""

    name = DRAFTER

    def __init__(self, *, max_cached_tokens: int = 1 << 20, limits: Limits = Limits()) -> None:
        self.cache = SuffixCache(max_cached_tokens)
        self.limits = limits

    def index(self, prompt_len: int = 0) -> SuffixSession:
        return SuffixSession(self.cache, self.limits, prompt_len)


class SuffixSession:
    """One session's drafts: its own history indexed, its output shared."""

    def __init__(self, cache: SuffixCache, limits: Limits, prompt_len: int) -> None:
        self.cache = cache
        self.limits = limits
        self.prompt_len = prompt_len
        """The history's first tokens that are the prompt: all the rest is output, shared."""
        self.own = SuffixIndex()
        self.output: int | None = None

    def match(self, history: Sequence[int], k: int) -> Match:
        """Up to ``k`` tokens to follow ``history``, which extends the
        history of the previous call: the better of the drafts its own
        history and the deployment's outputs offer, its evidence banded."""
        self._grown(history)
        context = history[-MAX_DEPTH - 1 :]
        own = self.own.draft(context, k, self.limits)
        shared = self.cache.index.draft(context, k, self.limits)
        self.cache.lookups += 1
        draft = own
        if shared.score > own.score:
            self.cache.hits += 1
            draft = shared
        return Match(draft.evidence, draft.tokens)

    def ended(self, history: Sequence[int]) -> None:
        """Shares the output's last tokens."""
        self._grown(history)

    def _grown(self, history: Sequence[int]) -> None:
        """Indexes what the history gained since the last call, and shares
        what of it is output."""
        seen = len(self.own.sequences.get(0, ()))
        if len(history) < seen:
            raise ValueError("a suffix session's history only grows")
        self.own.extend(0, history[seen:])
        output = history[max(seen, self.prompt_len) :]
        if output:
            if self.output is None:
                self.output = self.cache.new_output()
            self.cache.extend(self.output, output)


def load(config: CoordinatorConfig) -> SuffixDecoding:
    """``--suffix-decoding``, its cache and limits from its flags."""
    limits = Limits(
        max_spec_factor=config.suffix_max_spec_factor,
        min_token_prob=config.suffix_min_token_prob,
    )
    return SuffixDecoding(max_cached_tokens=config.suffix_cache_tokens, limits=limits)
