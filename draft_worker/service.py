"""gRPC servicer of the draft worker: translate, delegate to the engine, translate back."""

from __future__ import annotations

from dataclasses import replace

from outrider.draft_worker.sessions import DraftSessions
from outrider.session_stream import SessionServicer
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import hidden_states_from_pb, proposal_to_pb, sampling_from_pb


class DraftWorkerService(SessionServicer, worker_pb2_grpc.DraftWorkerServicer):
    sessions: DraftSessions

    async def _open(self, session_id: str, request: pb.SessionOpen) -> pb.DraftResponse:
        (committed_len, cached), timing = await self.engine.timed(
            self.sessions.open,
            session_id,
            list(request.token_ids),
            request.target_vocab_size,
            request.target_vocab_fingerprint,
            sampling_from_pb(request.sampling),
            hidden_states_from_pb(request.hidden_states),
        )
        return pb.DraftResponse(
            opened=pb.SessionOpened(
                committed_len=committed_len, cached_tokens=cached, compute_s=timing.compute_s
            )
        )

    async def _round(self, session_id: str, request: pb.DraftRound) -> pb.DraftResponse:
        proposal, timing = await self.engine.timed(
            self.sessions.propose,
            session_id,
            request.committed_len,
            list(request.new_token_ids),
            request.num_speculative_tokens,
            list(request.assumed_token_ids) if request.speculate else None,
            hidden_states_from_pb(request.hidden_states),
        )
        answer = replace(proposal, round_id=request.round_id)
        return pb.DraftResponse(
            proposal=proposal_to_pb(answer, compute_s=timing.compute_s, load=self.engine.load)
        )

    async def GetWorkerInfo(self, request, context) -> pb.WorkerInfo:
        drafter = self.sessions.drafter
        return self._worker_info(
            model=drafter.model_name,
            drafter=drafter.kind,
            vocab_size=drafter.vocab_size or 0,
            hidden_state_layers=drafter.hidden_state_layers,
        )
