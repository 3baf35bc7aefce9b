"""The session store both workers use: one session per generation stream,
each with its copy of the committed history and its KV cache.

What a worker has cached between rounds (the rollback invariant). Let
``x_1 .. x_n`` be the committed history.

* **target** — the KV of ``x_1 .. x_{n-1}``. The last committed token ``x_n``
  is the recovered or bonus token the target itself produced last round and
  has not yet been fed. A round feeds ``[x_n, d_1 .. d_K]`` in one pass, then
  crops the cache to ``x_1 .. x_n, d_1 .. d_a`` (the ``a`` accepted drafts):
  again everything committed but the new last token.
* **draft** — the KV of a prefix of the committed history followed by its own
  speculative tokens ``d_1 .. d_{K-1}``: ``d_K`` was sampled but never fed, the
  draft "has not yet seen its own last token" (gpt-fast). The next round crops
  the cache to the longest prefix it shares with the new history (never
  beyond ``x_{n-1}``) and feeds the rest — one token after a rejection, two
  (``d_K`` and the bonus) after a full accept. After a speculation (a
  pipelined round) the cache runs on past ``d_K`` through its guess of the
  bonus token and the next round's drafts; the same crop keeps all of it
  when the guess was right and the committed part when it was not.

Rollback is a crop (:meth:`outrider.engine.kv_cache.KVCache.crop`): it sets
the cache's length and hands the blocks it no longer needs back to the pool;
nothing is copied or recomputed. A worker that loses a session rebuilds it by
prefilling the history the coordinator sends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outrider.engine.kv_cache import BlockPool, KVCache
from outrider.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    SessionNotFound,
)
from outrider.sampling_params import SamplingParams
from outrider.validation import check_context, check_token_ids

if TYPE_CHECKING:
    from outrider.grammar import Grammars, Matcher


@dataclass
class Session:
    """One generation's state on a worker."""

    session_id: str
    tokens: list[int]
    """The committed history, as this worker knows it."""
    kv: KVCache
    """The model's cache."""
    sampling: SamplingParams = SamplingParams()
    """How this session turns logits into tokens (the same on both workers)."""
    drafter_state: object | None = None
    """What a drafter keeps of the session beside its cache (an EAGLE head's
    features: ``outrider.drafters.eagle.HeadState``)."""
    feature_layers: tuple[int, ...] = ()
    """A target session's: the layers whose input hidden states its answers
    carry, for a draft head that reads them (none: no draft head does)."""
    grammar: Matcher | None = None
    """Where the session stands in its structured output (None: it has
    none): at the committed history on the target, at the last proposal's
    drafts on the draft worker."""

    def follow(self, grammars: Grammars | None) -> None:
        """Starts following the session's structured output, if it has one,
        at its history."""
        output = self.sampling.structured_output
        if output is None:
            return
        if grammars is None:
            raise FailedPrecondition(
                "this worker's model has no tokenizer to compile structured output with: "
                "send the request without one"
            )
        self.grammar = grammars.matcher(output)
        self.grammar.sync(self.tokens[self.sampling.start :])

    @property
    def committed_len(self) -> int:
        return len(self.tokens)

    def check_builds_on(self, committed_len: int, new_tokens: int = 0) -> None:
        """A round builds on the committed history this session holds, plus
        the ``new_tokens`` it brings: FailedPrecondition otherwise."""
        if self.committed_len + new_tokens != committed_len:
            plus = f" plus {new_tokens} new tokens" if new_tokens else ""
            raise FailedPrecondition(
                f"round builds on committed length {committed_len} but this session has "
                f"{self.committed_len}{plus}; reopen the session with the full history"
            )

    @property
    def cached_tokens(self) -> int:
        return len(self.kv)


class SessionStore:
    """Sessions of one worker, at most ``max_sessions``, their caches drawn
    from ``pool``. All methods run on the thread of the worker's engine;
    the metrics endpoint only reads ``len``, ``cached_tokens`` and
    ``usage``, from its own."""

    def __init__(self, *, max_sessions: int, pool: BlockPool) -> None:
        self.max_sessions = max_sessions
        self.pool = pool
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def max_cached_tokens(self) -> int:
        return self.pool.capacity

    @property
    def cached_tokens(self) -> int:
        # A snapshot of the sessions: the metrics thread reads this too.
        return sum(s.cached_tokens for s in list(self._sessions.values()))

    @property
    def usage(self) -> float:
        """The fraction of the pool's blocks in use, 0 to 1."""
        return self.pool.used_blocks / self.pool.num_blocks

    def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        new_kv: Callable[[], KVCache],
        *,
        vocab_size: int,
        max_context: int,
        grammars: Grammars | None,
        sampling: SamplingParams = SamplingParams(),
        room: int = 0,
        reuse: bool = True,
    ) -> Session:
        """A worker's new session on the history ``tokens``, once they are
        checked (not empty, ids within ``vocab_size``, ``room`` tokens more
        within ``max_context``), following its structured output; nothing
        stays open when any of it is refused."""
        if not tokens:
            raise InvalidArgument("the session's history is empty: send at least one token")
        check_token_ids(tokens, vocab_size, what="token_ids")
        check_context(len(tokens) + room, max_context, what="the history")
        session = self.create(session_id, tokens, new_kv(), sampling, reuse=reuse)
        try:
            session.follow(grammars)
        except Exception:
            self.close(session_id)
            raise
        return session

    def create(
        self,
        session_id: str,
        tokens: Sequence[int],
        kv: KVCache,
        sampling: SamplingParams = SamplingParams(),
        *,
        reuse: bool = True,
    ) -> Session:
        """A new session; its cache starts with the cached blocks of its
        history's prefix (``reuse``, where the pool caches; never the last
        token, whose logits the first round needs) and gets room for the
        whole history at once, so its prefill cannot run out of memory halfway."""
        if session_id in self._sessions:
            raise InvalidArgument(f"session {session_id!r} is already open")
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"worker is full: {len(self._sessions)} of {self.max_sessions} sessions open; "
                "retry later or on another replica"
            )
        if reuse:
            kv.reuse(tokens[:-1])
        try:
            kv.reserve(len(tokens))
        except ResourceExhausted:
            kv.free()
            raise
        session = Session(session_id=session_id, tokens=list(tokens), kv=kv, sampling=sampling)
        self._sessions[session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"no session {session_id!r} on this worker") from None

    def close(self, session_id: str) -> None:
        """Frees the session and its KV cache at once (idempotent)."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.kv.free()
