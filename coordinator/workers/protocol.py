"""How the round loop talks to its workers: the small protocols it sees.

``outrider.coordinator.workers.grpc_client`` implements them over gRPC (one
bidirectional stream per session). The test suite has an in-process
implementation (``tests/inprocess.py``) that calls the workers' engines
directly, so the whole speculative loop also runs in one process — the same
loop code either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from outrider.engine_load import EngineLoad
from outrider.hidden_states import NONE, HiddenStates
from outrider.sampling_params import SamplingParams
from outrider.speculation import Proposal, Verdict

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerInfo:
    model: str
    drafter: str
    vocab_size: int
    vocab_fingerprint: str
    max_context: int
    device: str = ""
    dtype: str = ""
    graphed_tokens_per_row: int = 0
    """The most tokens a row may feed in a step replayed from a CUDA graph (0: none is)."""
    hidden_state_layers: tuple[int, ...] = ()
    """A draft head's: the target layers whose input hidden states it reads."""

    @classmethod
    def of_lookup(cls, drafter: str) -> WorkerInfo:
        """A drafter in the coordinator as a worker would describe itself:
        any vocabulary, any context."""
        return cls(
            model=drafter, drafter=drafter, vocab_size=0, vocab_fingerprint="", max_context=0
        )


@dataclass(frozen=True)
class Reply(Generic[T]):
    """A worker's answer and the compute it took there (its engine's steps,
    shared with other sessions, included)."""

    value: T
    compute_s: float
    load: EngineLoad | None = None
    """The worker's engine as it answered (None: it reported none)."""
    queued_s: float = 0.0
    """How long the call waited for the engine to take it: behind the rest
    of a step of other sessions under way (the target's verify reports it)."""
    hidden_states: HiddenStates = NONE
    """A target's, for a session that asked for them: the hidden states of
    the positions the answer made committed but the last."""
    cached_tokens: int = 0
    """An open's: tokens of the history the worker found in its prefix
    cache, and did not prefill."""


class DraftSession(Protocol):
    async def propose(
        self,
        committed_len: int,
        new_tokens: Sequence[int],
        k: int,
        assumed: Sequence[int] | None = None,
        round_id: int = 0,
        hidden_states: HiddenStates = NONE,
    ) -> Reply[Proposal]:
        """Syncs the new committed tokens (and, for a head, the target's
        hidden states of their positions) and proposes up to k drafts after
        the history; given ``assumed`` drafts (even none), a speculation:
        a guess of the bonus token after them, then the drafts after that."""
        ...

    def failing(self) -> None:
        """Says the session's worker stopped answering: new sessions go to
        other replicas for a while."""

    def close(self) -> None:
        """Ends the session, its generation finished (in the background)."""

    def cancel(self) -> None:
        """Cuts the session (its generation failed or was cancelled, or the
        worker stopped answering)."""


@dataclass(frozen=True)
class Judged:
    """A verify's outcome: the proposal as the target verified it (all of
    it, or a prefix of its drafts when its step had no room for the rest),
    and the verdict on it."""

    proposal: Proposal
    verdict: Verdict


class TargetSession(Protocol):
    address: str
    """The worker replica's."""

    async def verify(
        self, committed_len: int, proposal: Proposal, deadline_s: float | None = None
    ) -> Reply[Judged]:
        """The verdict on ``proposal``; TimeoutError when the worker gives
        none within ``deadline_s`` and its engine is not at work (frozen: a
        busy worker is waited for)."""
        ...

    def failing(self) -> None:
        """Says the session's worker stopped answering: new sessions go to
        other replicas for a while."""

    def close(self) -> None:
        """Ends the session, its generation finished (in the background)."""

    def cancel(self) -> None:
        """Cuts the session (its generation failed or was cancelled, or the
        worker stopped answering)."""


class DraftClient(Protocol):
    async def info(self, timeout_s: float = 10.0) -> WorkerInfo: ...

    async def open(
        self,
        tokens: Sequence[int],
        *,
        request_id: str,
        target: WorkerInfo,
        sampling: SamplingParams,
        deadline_s: float | None = None,
        hidden_states: HiddenStates = NONE,
    ) -> tuple[DraftSession, float]: ...


class TargetClient(Protocol):
    async def info(self, timeout_s: float = 10.0) -> WorkerInfo: ...

    async def open(
        self,
        tokens: Sequence[int],
        *,
        request_id: str,
        sampling: SamplingParams,
        deadline_s: float | None = None,
        first_token: bool = False,
        hidden_state_layers: Sequence[int] = (),
    ) -> tuple[TargetSession, Reply[Verdict | None]]:
        """A session on the history ``tokens`` (prefilled); with
        ``first_token``, the verdict of a round with no drafts: the token
        that follows it, drawn and committed.
        Naming ``hidden_state_layers``, its answers carry the hidden states
        entering those layers (:attr:`Reply.hidden_states`)."""
        ...
