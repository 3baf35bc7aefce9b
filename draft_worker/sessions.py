"""The draft worker's sessions: open one (check the vocabulary, prefill), sync and
propose each round, close.

``open`` and ``propose`` are engine jobs (:mod:`outrider.engine.core`): a
model drafter's K draft steps run as K engine steps, each batched with the
other sessions drafting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from outrider.drafters.model import Drafter, DraftInfo
from outrider.engine import Job
from outrider.errors import FailedPrecondition, InvalidArgument
from outrider.grammar import Grammars
from outrider.hidden_states import HiddenStates
from outrider.sampling_params import SamplingParams
from outrider.session import Session, SessionStore
from outrider.speculation import Proposal
from outrider.validation import check_token_ids


class DraftSessions:
    """Sessions of one drafter; its methods run on the worker's engine."""

    def __init__(
        self,
        drafter: Drafter,
        store: SessionStore,
        info: DraftInfo,
        grammars: Grammars | None = None,
    ) -> None:
        self.drafter = drafter
        self.store = store
        self.info = info
        self.grammars = grammars
        """Structured output's, for the model's tokenizer (None: it has none)."""

    @property
    def runner(self):
        """The drafter's model runner."""
        return self.drafter.runner

    def check_pairing(self, target_vocab_size: int, target_fingerprint: str) -> None:
        """Refuses a target whose vocabulary differs from the drafter's."""
        if target_fingerprint and self.info.vocab_fingerprint:
            if target_fingerprint != self.info.vocab_fingerprint:
                raise FailedPrecondition(
                    f"the draft model {self.drafter.model_name!r} has a different tokenizer "
                    "vocabulary than the target: pair it with a draft that shares the target's "
                    "tokenizer, or draft by prompt lookup (the coordinator's --prompt-lookup)"
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
        features: HiddenStates | None = None,
    ) -> Job[tuple[int, int]]:
        """Opens a session on the committed history and caches what its
        first round builds on (the drafter's ``open``): given the target's
        ``features`` of the history's last positions, for a drafter that
        reads them. Returns the committed length and how many tokens of the
        history came from the prefix cache."""
        self.check_pairing(target_vocab_size, target_fingerprint)
        session = self.store.open(
            session_id,
            tokens,
            self.drafter.runner.new_kv,
            vocab_size=self.drafter.vocab_size,
            max_context=self.info.max_context,
            grammars=self.grammars,
            sampling=sampling,
        )
        cached = len(session.kv)
        yield from self.drafter.open(session, features)
        return session.committed_len, cached

    def propose(
        self,
        session_id: str,
        committed_len: int,
        new_tokens: Sequence[int],
        num_speculative_tokens: int,
        assumed: Sequence[int] | None = None,
        features: HiddenStates | None = None,
    ) -> Job[Proposal]:
        """Appends the tokens committed since the last round, then proposes
        up to ``num_speculative_tokens`` tokens, with their q in wire form when the
        draft sampled them (else none: a point mass).

        Given ``assumed`` tokens, even none (a speculation,
        docs/design.md#pipelined-rounds), it proposes after them instead, as
        if the target accepted them whole: it drafts one token more, its guess
        of the target's bonus token, which the drafts then follow. Nothing of
        the assumption is committed; the next round's new tokens say what
        was. ``features``: the target's, of the positions the new tokens
        made committed (for a drafter that reads them)."""
        session = self.store.get(session_id)
        guessing = assumed is not None
        assumed = assumed or []
        self._check_round(session, committed_len, new_tokens, num_speculative_tokens, assumed)
        # Rollback: the cache agrees with the history up to the last round's
        # committed length; keep the longest prefix it shares with the
        # history to draft after, never its last token (the draft feeds it).
        kv = session.kv
        agreed = min(len(kv), session.committed_len)
        self.drafter.receive(session, len(new_tokens), features)
        session.tokens.extend(new_tokens)
        history = [*session.tokens, *assumed] if guessing else session.tokens
        k = min(num_speculative_tokens + guessing, self.info.max_context - len(history))
        if k <= 0:
            return Proposal([], follows_len=len(history))
        self.drafter.rollback(session, history, agreed)
        kv.reserve(len(history) + k - 1)
        proposal = yield from self.drafter.propose(session, history, k)
        if not guessing or not proposal.tokens:  # (no guess: nothing to speculate on)
            return proposal
        return _after_the_guess(proposal, len(history))

    def _check_round(
        self,
        session: Session,
        committed_len: int,
        new_tokens: Sequence[int],
        num_speculative_tokens: int,
        assumed: Sequence[int],
    ) -> None:
        """The round builds on what the session holds, asks for a K it may,
        assumes no more than one round's drafts, and names tokens of the
        drafter's vocabulary."""
        session.check_builds_on(committed_len, len(new_tokens))
        if not 1 <= num_speculative_tokens <= self.info.max_draft_tokens:
            raise InvalidArgument(
                f"num_speculative_tokens = {num_speculative_tokens};"
                f" it must lie in [1, {self.info.max_draft_tokens}]"
            )
        if len(assumed) > self.info.max_draft_tokens:
            raise InvalidArgument(
                f"{len(assumed)} assumed_token_ids; a speculation assumes at most "
                f"{self.info.max_draft_tokens} (one round's drafts)"
            )
        check_token_ids(new_tokens, self.drafter.vocab_size, what="new_token_ids")
        check_token_ids(assumed, self.drafter.vocab_size, what="assumed_token_ids")

    def close(self, session_id: str) -> None:
        self.store.close(session_id)


def _after_the_guess(proposal: Proposal, history_len: int) -> Proposal:
    """A speculation's proposal as the coordinator takes it: its first token
    is the guess of the target's bonus token, which the drafts follow."""
    guess, *tokens = proposal.tokens
    return replace(
        proposal, tokens=tokens, probs=proposal.probs[1:], follows_len=history_len + 1, guess=guess
    )
