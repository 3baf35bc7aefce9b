"""The two words of a speculative round, shared by the three services.

* a :class:`Proposal` — what the drafter offers: draft tokens ``d_1 .. d_K``
  after a history (and, for a sampling draft in rejection mode, the
  distribution ``q`` each was drawn from, as :class:`CompactProbs`);
* a :class:`Verdict` — what the target decides: how many leading drafts it
  accepts, and its own next token (the *recovered* token at the first
  rejection, or the *bonus* token after all K).

Both are plain data: no tensors, no protobuf (``outrider.wire`` translates
them at the edge).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class CompactProbs:
    """One row of ``q`` as it crosses the wire.

    ``probs`` are float16 little-endian, scaled so the largest is 1.0 (which
    keeps float16's precision where the mass is; :func:`outrider.sampling.expand`
    renormalises). ``token_ids`` are the support, int32 little-endian,
    ascending, one per entry of ``probs``; ``None`` means dense: ``probs``
    covers the whole vocabulary.
    """

    token_ids: bytes | None
    probs: bytes

    @property
    def nbytes(self) -> int:
        return len(self.probs) + (len(self.token_ids) if self.token_ids is not None else 0)


@dataclass(frozen=True)
class Proposal:
    """Draft tokens proposed to follow a history."""

    tokens: list[int]
    """The draft tokens, at most the K asked for (fewer, even none, when the
    drafter has no confident guess)."""
    probs: list[CompactProbs] = field(default_factory=list)
    """``q`` of each draft token when the draft sampled it (rejection mode);
    empty: the draft is deterministic, a point mass on each token."""
    follows_len: int = 0
    """The length of the history the tokens follow: the committed length, or
    for a speculation the committed length plus the assumed drafts and the
    guess."""
    guess: int | None = None
    """A speculation's guess of the target's bonus token after the assumed
    drafts (the tokens follow it); None for a proposal after the committed
    history."""
    round_id: int = 0
    """The round it answers, as the coordinator numbered it (echoed)."""

    def prefix(self, k: int) -> Proposal:
        """Its first ``k`` drafts: a proposal too (a verifier may take fewer)."""
        if k >= len(self.tokens):
            return self
        return replace(self, tokens=self.tokens[:k], probs=self.probs[:k])


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probabilities at one committed token's position: the
    log-softmax of its logits there before temperature and the filters
    (after a structured output's mask), as vLLM reports them."""

    logprob: float
    """Of the committed token."""
    top: tuple[tuple[int, float], ...] = ()
    """The most likely tokens and theirs, most likely first."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one round's draft tokens."""

    num_accepted: int
    """How many leading draft tokens were accepted (0 .. K)."""
    next_token: int
    """The recovered token when ``num_accepted < K``, else the bonus token."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """When the session asked for them: those of the committed tokens, the
    accepted drafts' then the next token's."""
