"""In-process worker clients: the coordinator's ``TargetClient`` and
``DraftClient`` protocols (``outrider.coordinator.workers``) over the workers' sessions
and engines in this process, no gRPC — so the whole speculative loop runs in
one process, with the same loop code as across three."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace

from outrider.coordinator.workers.protocol import Judged, Reply, WorkerInfo
from outrider.draft_worker.sessions import DraftSessions
from outrider.engine import Engine, InlineEngine
from outrider.hidden_states import NONE, HiddenStates
from outrider.sampling import SamplingParams
from outrider.speculation import Proposal
from outrider.target_worker.sessions import TargetSessions


class InProcessTargetClient:
    """Runs a target worker's session jobs on its engine directly."""

    def __init__(self, sessions: TargetSessions, engine: Engine | InlineEngine) -> None:
        self.sessions = sessions
        self.engine = engine
        self.address = f"in-process:{id(engine):x}"
        """Its sessions' replica, as a worker's address names it."""

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        i = self.sessions.info
        return WorkerInfo(
            i.model_name, "", i.vocab_size, i.vocab_fingerprint, i.max_context, i.device, i.dtype
        )

    async def open(
        self,
        tokens: Sequence[int],
        *,
        request_id: str,
        sampling: SamplingParams,
        deadline_s: float | None = None,
        first_token: bool = False,
        hidden_state_layers: Sequence[int] = (),
    ):
        session_id = uuid.uuid4().hex[:16]
        (_, first, features, cached), timing = await self.engine.timed(
            self.sessions.open,
            session_id,
            list(tokens),
            sampling,
            first_token,
            list(hidden_state_layers),
        )
        session = _InProcessTargetSession(self, session_id)
        return session, Reply(
            first, timing.compute_s, self.engine.load, hidden_states=features, cached_tokens=cached
        )


class _InProcessTargetSession:
    def __init__(self, client: InProcessTargetClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id
        self.address = client.address

    async def verify(
        self, committed_len: int, proposal: Proposal, deadline_s: float | None = None
    ) -> Reply[Judged]:
        (verdict, verified, features), timing = await self.client.engine.timed(
            self.client.sessions.verify,
            self.session_id,
            committed_len,
            list(proposal.tokens),
            list(proposal.probs),
        )
        judged = Judged(proposal.prefix(verified), verdict)
        load = self.client.engine.load
        return Reply(judged, timing.compute_s, load, timing.queued_s, features)

    def failing(self) -> None:
        pass

    def close(self) -> None:
        self.client.engine.submit(self.client.sessions.close, self.session_id)

    cancel = close


class InProcessDraftClient:
    """Runs a draft worker's session jobs on its engine directly."""

    def __init__(self, sessions: DraftSessions, engine: Engine | InlineEngine) -> None:
        self.sessions = sessions
        self.engine = engine

    async def info(self, timeout_s: float = 10.0) -> WorkerInfo:
        d, i = self.sessions.drafter, self.sessions.info
        return WorkerInfo(
            d.model_name,
            d.kind,
            d.vocab_size or 0,
            i.vocab_fingerprint,
            i.max_context,
            i.device,
            i.dtype,
            hidden_state_layers=d.hidden_state_layers,
        )

    async def open(
        self,
        tokens: Sequence[int],
        *,
        request_id: str,
        target: WorkerInfo,
        sampling: SamplingParams,
        deadline_s: float | None = None,
        hidden_states: HiddenStates = NONE,
    ):
        session_id = uuid.uuid4().hex[:16]
        _, timing = await self.engine.timed(
            self.sessions.open,
            session_id,
            list(tokens),
            target.vocab_size,
            target.vocab_fingerprint,
            sampling,
            hidden_states,
        )
        return _InProcessDraftSession(self, session_id), timing.compute_s


class _InProcessDraftSession:
    def __init__(self, client: InProcessDraftClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    async def propose(
        self, committed_len, new_tokens, k, assumed=None, round_id=0, hidden_states=NONE
    ):
        proposal, timing = await self.client.engine.timed(
            self.client.sessions.propose,
            self.session_id,
            committed_len,
            list(new_tokens),
            k,
            assumed,
            hidden_states,
        )
        proposal = replace(proposal, round_id=round_id)
        return Reply(proposal, timing.compute_s, self.client.engine.load)

    def failing(self) -> None:
        pass

    def close(self) -> None:
        self.client.engine.submit(self.client.sessions.close, self.session_id)

    cancel = close
