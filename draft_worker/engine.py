"""The draft engine: open a session (check the vocabulary, prefill), sync and
propose each round, close."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from outrider.drafters import Drafter
from outrider.errors import FailedPrecondition, InvalidArgument
from outrider.sampling import CompactProbs, SamplingParams, compact
from outrider.session import SessionStore
from outrider.validation import check_context, check_token_ids


@dataclass(frozen=True)
class DraftInfo:
    vocab_fingerprint: str
    """sha256 of the drafter's tokenizer vocabulary; empty for model-free drafters."""
    max_context: int
    max_draft_tokens: int


class DraftEngine:
    """Sessions of one drafter. Runs on the worker's engine thread only."""

    def __init__(self, drafter: Drafter, store: SessionStore, info: DraftInfo) -> None:
        self.drafter = drafter
        self.store = store
        self.info = info

    def check_pairing(self, target_vocab_size: int, target_fingerprint: str) -> None:
        """Refuses a target whose vocabulary differs from the drafter's."""
        if self.drafter.vocab_size is None:
            return
        if target_fingerprint and self.info.vocab_fingerprint:
            if target_fingerprint != self.info.vocab_fingerprint:
                raise FailedPrecondition(
                    f"the draft model {self.drafter.model_name!r} has a different tokenizer "
                    "vocabulary than the target: pair it with a draft that shares the target's "
                    "tokenizer, or use --drafter prompt-lookup"
                )
        elif target_vocab_size and target_vocab_size != self.drafter.vocab_size:
            raise FailedPrecondition(
                f"the draft model {self.drafter.model_name!r} has a vocabulary of "
                f"{self.drafter.vocab_size} tokens but the target has {target_vocab_size}: "
                "pair it with a draft that shares the target's tokenizer"
            )

    def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        target_vocab_size: int,
        target_fingerprint: str,
        sampling: SamplingParams = SamplingParams(),
    ) -> int:
        """Opens a session on the committed history and prefills all but its
        last token. Returns the committed length."""
        self.check_pairing(target_vocab_size, target_fingerprint)
        if not tokens:
            raise InvalidArgument("the session's history is empty: send at least one token")
        check_token_ids(tokens, self.drafter.vocab_size or target_vocab_size or None, what="token_ids")
        check_context(len(tokens), self.info.max_context, what="the history")
        runner = self.drafter.runner
        session = self.store.create(
            session_id, tokens, kv=runner.new_kv() if runner else None, sampling=sampling
        )
        if runner is not None and len(tokens) > 1:
            runner.extend(session.kv, tokens[:-1], last_only=True)
        return session.committed_len

    def propose(
        self,
        session_id: str,
        committed_len: int,
        new_tokens: Sequence[int],
        num_draft_tokens: int,
    ) -> tuple[list[int], list[CompactProbs]]:
        """Appends the tokens committed since the last round, then proposes
        up to ``num_draft_tokens`` tokens, with their q in wire form when the
        draft sampled them (else none: a point mass)."""
        session = self.store.get(session_id)
        if session.committed_len + len(new_tokens) != committed_len:
            raise FailedPrecondition(
                f"round builds on committed length {committed_len} but this session has "
                f"{session.committed_len} plus {len(new_tokens)} new tokens; reopen the session "
                "with the full history"
            )
        if not 1 <= num_draft_tokens <= self.info.max_draft_tokens:
            raise InvalidArgument(
                f"num_draft_tokens = {num_draft_tokens}; it must lie in [1, {self.info.max_draft_tokens}]"
            )
        check_token_ids(new_tokens, self.drafter.vocab_size, what="new_token_ids")
        k = min(num_draft_tokens, self.info.max_context - committed_len)
        session.tokens.extend(new_tokens)
        if k <= 0:
            return [], []
        self.store.reserve(session, committed_len + k - 1)
        proposal = self.drafter.propose(session, k)
        return proposal.tokens, [compact(q) for q in proposal.probs or ()]

    def close(self, session_id: str) -> None:
        self.store.close(session_id)
