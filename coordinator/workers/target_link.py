"""A generation's target session, with recovery.

The coordinator's history is the truth and a worker's cache only a cache of
it (docs/design.md#protocol): a failure, or no verdict in time from a
worker whose engine is not at work, reopens the session on the history on
another replica (or the same one once it is back) and the round is retried;
the client sees latency, not an error. With no target left the request
ends UNAVAILABLE. A refusal of the request itself (a bad argument) when the
session is first opened is not a worker failure and reaches the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from outrider.coordinator.workers.protocol import Judged, Reply, TargetClient, TargetSession
from outrider.errors import Unavailable
from outrider.logging import get_logger
from outrider.sampling_params import SamplingParams
from outrider.speculation import Proposal, Verdict

log = get_logger(__name__)


class TargetLink:
    """The target session of one generation, reopened on failure."""

    def __init__(
        self,
        client: TargetClient,
        *,
        request_id: str,
        sampling: SamplingParams,
        attempts: int,
        open_deadline_s: Callable[[int], float | None] = lambda tokens: None,
        hidden_state_layers: Sequence[int] = (),
    ) -> None:
        """``open_deadline_s(tokens)``: how long opening a session on that
        many tokens may take before the replica counts as lost (None: no limit)."""
        self.client = client
        self.request_id = request_id
        self.sampling = sampling
        self.attempts = attempts
        self.open_deadline_s = open_deadline_s
        self.hidden_state_layers = tuple(hidden_state_layers)
        """The layers whose hidden states its answers carry, for a draft head."""
        self.session: TargetSession | None = None

    async def open(
        self, history: Sequence[int], *, first_token: bool = False
    ) -> Reply[Verdict | None]:
        """Opens a session on the history, on another replica after a
        failure; with ``first_token``, the target also draws the token after
        the history (the stream's first). A reopen's hidden states are those
        the first open and the verdicts sent already: only a first open's
        reach the round loop."""
        self.session, opened = await self._open(history, first_token)
        return opened

    async def _open(
        self, history: Sequence[int], first_token: bool
    ) -> tuple[TargetSession, Reply[Verdict | None]]:
        for attempt in range(self.attempts):
            try:
                return await self.client.open(
                    history,
                    request_id=self.request_id,
                    sampling=self.sampling,
                    deadline_s=self.open_deadline_s(len(history)),
                    first_token=first_token,
                    hidden_state_layers=self.hidden_state_layers,
                )
            except Unavailable as exc:
                log.warning("target unavailable", error=str(exc), attempt=attempt)
                last = exc
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        raise Unavailable(f"no target worker is available: {last}")

    async def verify(
        self,
        history: list[int],
        proposal: Proposal,
        deadline_s: float | None = None,
    ) -> tuple[Reply[Judged], float]:
        """Verifies, reopening the session on the history after a failure or
        after no answer within ``deadline_s`` (a frozen or overloaded worker:
        the reopen goes to another replica while there is one). Returns the
        verdict and the compute time of any reopening prefill."""
        reopen_s = 0.0
        for attempt in range(self.attempts):
            session = self.session
            if session is None:
                session, opened = await self._open(history, False)
                self.session = session
                reopen_s += opened.compute_s
                log.info("target session reopened", committed_len=len(history))
            try:
                return await session.verify(len(history), proposal, deadline_s), reopen_s
            except Unavailable as exc:
                log.warning(
                    "target lost: reopening on the history", error=str(exc), attempt=attempt
                )
                last = exc
            except TimeoutError:
                log.warning(
                    "target gave no verdict in time: reopening on the history",
                    deadline_s=deadline_s,
                )
                last = Unavailable(f"the target gave no verdict within {deadline_s:.3g} s")
                session.failing()
            self.close()
        raise Unavailable(f"no target worker could finish the request: {last}")

    def close(self, *, finished: bool = False) -> None:
        """Ends the session: closed when the generation ``finished``, cut otherwise."""
        session, self.session = self.session, None
        if session is None:
            return
        if finished:
            session.close()
        else:
            session.cancel()
