"""The target worker's sessions: open one (prefill), verify a round, close.

``open`` and ``verify`` are engine jobs (:mod:`outrider.engine.core`): they
check the request, ``yield`` the forward pass they need, and the worker's
engine batches it with every other session's."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from outrider.engine import Feed, Job, Logits
from outrider.engine.hidden_states import pack
from outrider.errors import FailedPrecondition, InvalidArgument
from outrider.grammar import Grammars
from outrider.hidden_states import NONE, HiddenStates, concat
from outrider.sampling import constrain, expand, hold_back, token_logprobs
from outrider.sampling_params import SamplingParams
from outrider.session import Session, SessionStore
from outrider.speculation import CompactProbs, Verdict
from outrider.target_worker.verify import verify, verify_greedy
from outrider.validation import check_context, check_token_ids


@dataclass(frozen=True)
class TargetInfo:
    model_name: str
    vocab_size: int
    vocab_fingerprint: str
    max_context: int
    device: str = "cpu"
    dtype: str = "float32"


class TargetSessions:
    """Sessions of the target model; its methods run on the worker's engine."""

    def __init__(
        self, runner, store: SessionStore, info: TargetInfo, grammars: Grammars | None = None
    ) -> None:
        self.runner = runner
        self.store = store
        self.info = info
        self.grammars = grammars
        """Structured output's, for the model's tokenizer (None: it has none)."""

    def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        first_token: bool = False,
        feature_layers: Sequence[int] = (),
    ) -> Job[tuple[int, Verdict | None, HiddenStates, int]]:
        """Opens a session on the committed history ``tokens`` and prefills
        everything but its last token, after the prefix the cache holds
        already. With ``first_token``, it then runs the
        stream's first round with no drafts: the token after the history is
        drawn and committed (the recovered token of an empty proposal).
        Returns the committed length, that round's verdict (or None), the hidden
        states entering ``feature_layers`` at every position now committed
        but the last (none when no layers are named), and how many tokens of
        the history came from the prefix cache (none where hidden states are
        sent: a cached block has none)."""
        layers = self._check_layers(feature_layers)
        session = self.store.open(
            session_id,
            tokens,
            self.runner.new_kv,
            vocab_size=self.info.vocab_size,
            max_context=self.info.max_context,
            grammars=self.grammars,
            sampling=sampling,
            room=first_token,
            reuse=not layers,
        )
        session.feature_layers = layers
        kv = session.kv
        features: list[torch.Tensor] | None = [] if layers else None
        cached = len(kv)
        if len(tokens) - 1 > cached:
            yield Feed(
                kv, list(tokens[cached:-1]), num_logits=0, features=features, feature_layers=layers
            )
        kv.seal(len(kv))
        prefilled = _packed(features)
        if not first_token:
            return session.committed_len, None, prefilled, cached
        verdict, _, more = yield from self._round(session, [], None)
        return session.committed_len, verdict, concat([prefilled, more]), cached

    def _check_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """The layers a session's hidden states come from, checked."""
        forward = getattr(self.runner, "forward", None)  # (the fallback runner has none)
        num_layers = getattr(forward, "num_layers", 0) if layers else 0
        if layers and not num_layers:
            raise FailedPrecondition(
                "this target's runner cannot send hidden states (a model outside the Llama "
                "family): draft with a drafter that reads none"
            )
        if bad := [la for la in layers if not 0 <= la < num_layers]:
            raise InvalidArgument(
                f"hidden_state_layers {bad}: this target has layers 0 to {num_layers - 1}"
            )
        return tuple(layers)

    def verify(
        self,
        session_id: str,
        committed_len: int,
        draft_tokens: Sequence[int],
        draft_probs: Sequence[CompactProbs] = (),
    ) -> Job[tuple[Verdict, int, HiddenStates]]:
        session = self.store.get(session_id)
        session.check_builds_on(committed_len)
        check_token_ids(draft_tokens, self.info.vocab_size, what="draft_token_ids")
        k = len(draft_tokens)
        q = self.draft_distribution(draft_probs, k)
        check_context(committed_len + k, self.info.max_context, what="history plus draft tokens")
        return (yield from self._round(session, draft_tokens, q))

    def _round(
        self, session: Session, draft_tokens: Sequence[int], q: torch.Tensor | None
    ) -> Generator[Feed, Logits, tuple[Verdict, int, HiddenStates]]:
        """Verifies ``draft_tokens`` after the session's history and commits
        the verdict; returns it, the drafts verified (all, or a prefix when
        the step had no room for the rest), and the hidden states of the
        positions it made committed but the last (when the session sends
        them)."""
        committed_len = session.committed_len
        masks, draft_tokens = _allowed(session, draft_tokens, q)  # 0. structured output
        k = len(draft_tokens)

        # 1. One forward pass over [x_n, d_1 .. d_K]: K + 1 distributions
        #    (or over [x_n, d_1 .. d_m]: a prefix is a proposal too).
        kv = session.kv
        assert kv is not None  # a target session always keeps a cache
        tokens = [*session.tokens[len(kv) :], *draft_tokens]
        features: list[torch.Tensor] | None = [] if session.feature_layers else None
        out = yield Feed(
            kv,
            tokens,
            num_logits=len(tokens),
            trimmable=k,
            features=features,
            feature_layers=session.feature_layers,
        )
        verified = len(out.argmax) - 1
        if verified < k:
            draft_tokens, q = draft_tokens[:verified], None if q is None else q[:verified]
        logits, argmax = _restricted(out, masks, session.sampling, committed_len)

        # 2. Verify (greedy against the argmaxes the engine took for the whole step).
        try:
            if session.sampling.is_greedy:
                verdict = verify_greedy(draft_tokens, argmax)
            else:
                verdict = verify(
                    draft_tokens, q, logits, session.sampling, start_position=committed_len
                )
        except ValueError as exc:  # e.g. a draft token its own q gives no mass
            kv.crop(len(session.tokens) - 1)  # the round never happened
            raise InvalidArgument(str(exc)) from None

        # 3. Commit the accepted drafts and the recovered/bonus token; keep in
        #    the cache everything committed but that last token.
        committed = len(tokens) - k + verdict.num_accepted  # fed history, accepted drafts
        new = [*draft_tokens[: verdict.num_accepted], verdict.next_token]
        if (num_top := session.sampling.logprobs) is not None:
            verdict = replace(verdict, logprobs=token_logprobs(logits, new, num_top))
        session.tokens.extend(draft_tokens[: verdict.num_accepted])
        kv.crop(len(session.tokens))
        kv.seal(len(kv))  # committed: no later round crops it
        session.tokens.append(verdict.next_token)
        if session.grammar is not None:
            session.grammar.extend(new)
        return verdict, verified, _packed(features, committed)

    def draft_distribution(self, rows: Sequence[CompactProbs], k: int) -> torch.Tensor | None:
        """q as the draft sent it, [K, vocab]; None for a deterministic draft."""
        if not rows:
            return None
        if len(rows) != k:
            raise InvalidArgument(
                f"{len(rows)} draft_probs rows for {k} draft tokens: send one per token or none"
            )
        try:
            return torch.stack([expand(row, self.info.vocab_size) for row in rows])
        except ValueError as exc:
            raise InvalidArgument(f"draft_probs: {exc}") from None

    def close(self, session_id: str) -> None:
        self.store.close(session_id)


def _allowed(
    session: Session, draft_tokens: Sequence[int], q: torch.Tensor | None
) -> tuple[np.ndarray | None, Sequence[int]]:
    """Structured output's masks of a round's positions (None: the session
    has none), and the drafts to verify: a deterministic draft the grammar
    forbids is rejected for sure (p(d) = 0, and the recovered token is then
    drawn from p itself), so none after it is verified."""
    if session.grammar is None:
        return None, draft_tokens
    masks, allowed = session.grammar.masks(draft_tokens)
    return masks, draft_tokens if q is not None else draft_tokens[: allowed + 1]


def _restricted(
    out: Logits, masks: np.ndarray | None, sampling: SamplingParams, position: int
) -> tuple[torch.Tensor, list[int]]:
    """A round's logits (of the positions from ``position``) with what the
    request forbids at each at -inf — its structured output's ``masks``,
    min_tokens' held-back stop tokens — and their argmaxes."""
    logits = out.values if masks is None else constrain(out.values, masks[: len(out.argmax)])
    logits = hold_back(logits, sampling, position)
    if logits is out.values:
        return logits, out.argmax
    return logits, logits.argmax(dim=-1).tolist()


def _packed(features: list[torch.Tensor] | None, rows: int | None = None) -> HiddenStates:
    """The first ``rows`` (default: all) of a feed's hidden states, packed."""
    if not features:
        return NONE
    return pack(torch.cat(features)[:rows])
