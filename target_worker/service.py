"""gRPC servicer of the target worker: translate, delegate to the engine, translate back."""

from __future__ import annotations

from outrider.session_stream import SessionServicer
from outrider.target_worker.sessions import TargetSessions
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from outrider.wire import (
    hidden_states_to_pb,
    load_to_pb,
    logprobs_to_pb,
    probs_from_pb,
    sampling_from_pb,
    verdict_to_pb,
)


class TargetWorkerService(SessionServicer, worker_pb2_grpc.TargetWorkerServicer):
    sessions: TargetSessions

    async def _open(self, session_id: str, request: pb.SessionOpen) -> pb.VerifyResponse:
        (committed_len, first, features, cached), timing = await self.engine.timed(
            self.sessions.open,
            session_id,
            list(request.token_ids),
            sampling_from_pb(request.sampling),
            request.first_token,
            list(request.hidden_state_layers),
        )
        return pb.VerifyResponse(
            opened=pb.SessionOpened(
                committed_len=committed_len,
                cached_tokens=cached,
                compute_s=timing.compute_s,
                load=load_to_pb(self.engine.load),
                first_token_id=None if first is None else first.next_token,
                hidden_states=hidden_states_to_pb(features),
                logprobs=None if first is None else logprobs_to_pb(first.logprobs),
            )
        )

    async def _round(self, session_id: str, request: pb.VerifyRound) -> pb.VerifyResponse:
        (verdict, verified, features), timing = await self.engine.timed(
            self.sessions.verify,
            session_id,
            request.committed_len,
            list(request.draft_token_ids),
            probs_from_pb(request.draft_probs),
        )
        return pb.VerifyResponse(
            verdict=verdict_to_pb(
                verdict,
                compute_s=timing.compute_s,
                queued_s=timing.queued_s,
                num_verified=verified,
                load=self.engine.load,
                hidden_states=features,
            )
        )

    async def GetWorkerInfo(self, request, context) -> pb.WorkerInfo:
        info = self.sessions.info
        return self._worker_info(model=info.model_name, vocab_size=info.vocab_size)
