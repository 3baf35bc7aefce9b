"""The round loop's worker sessions, with recovery.

The coordinator's history is the truth and a worker's cache only a cache of
it (DESIGN §2, invariant 1), so a lost session is rebuilt by opening a new one
on the history:

* **draft** — a failure, or no answer within the per-round deadline, costs
  only speed: the stream goes on at K = 0 (target only) and the draft session
  is reopened, prefilled from the history, after a back-off.
* **target** — a failure reopens the session on another replica (or the same
  one once it is back) and the round is retried; the client sees latency, not
  an error. With no target left the request ends UNAVAILABLE.

A refusal of the request itself (a bad argument, a vocabulary mismatch) when
a session is first opened is not a worker failure and reaches the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from coordinator.workers import DraftClient, Proposal, TargetClient, VerifyResult, WorkerInfo
from outrider.errors import OutriderError, ResourceExhausted, Unavailable
from outrider.logging import get_logger
from outrider.sampling import CompactProbs, SamplingParams

log = get_logger(__name__)


class DraftLink:
    """The draft session of one generation; None of it while it is lost."""

    def __init__(
        self,
        client: DraftClient,
        *,
        request_id: str,
        target: WorkerInfo,
        sampling: SamplingParams,
        deadline_s: float,
        open_deadline_s: float = 60.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
    ) -> None:
        self.client = client
        self.request_id = request_id
        self.target = target
        self.sampling = sampling
        self.deadline_s = deadline_s
        self.open_deadline_s = open_deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.session = None
        self.opening: asyncio.Task | None = None
        """An open still running after its round's deadline (a slow prefill, a frozen draft)."""
        self.opened = False
        self.synced = 0
        self.failures = 0
        self.retry_at = 0.0

    async def propose(self, history: list[int], k: int) -> tuple[Proposal | None, float]:
        """Syncs and proposes: the proposal (None when the draft is lost:
        draft nothing), and the seconds this round spent opening the session.

        The session opens at the first round that drafts, prefilled with the
        history, so a generation whose rounds never draft (adaptive K at 0)
        never costs the draft worker anything. A refusal of that first open
        (a bad argument, a vocabulary mismatch) reaches the client; a draft
        that is down, slow or full only means K = 0 for now. An open waits no
        longer than a round: past the deadline it goes on in the background
        while the rounds go on at K = 0, so a frozen draft never stalls the
        stream for more than one deadline."""
        open_s = 0.0
        if self.session is None:
            if self.opening is None:
                if time.monotonic() < self.retry_at:
                    return None, 0.0
                # A copy: the history grows while an open runs in the background.
                self.opening = asyncio.ensure_future(asyncio.wait_for(self._open(list(history)), self.open_deadline_s))
                started = time.perf_counter()
                await asyncio.wait({self.opening}, timeout=self.deadline_s)
                open_s = time.perf_counter() - started
            if not self.opening.done():
                return None, open_s
            opening, self.opening = self.opening, None
            try:
                opening.result()
            except (Unavailable, ResourceExhausted, TimeoutError) as exc:
                self._lost(exc)
                return None, open_s
            except OutriderError as exc:
                if not self.opened:
                    raise
                self._lost(exc)
                return None, open_s
            if self.failures:
                log.info("draft session reopened", committed_len=self.synced)
        try:
            async with asyncio.timeout(self.deadline_s):  # no task per round, unlike wait_for
                proposal = await self.session.propose(len(history), history[self.synced :], k)
        except (OutriderError, TimeoutError) as exc:
            await self.close()
            self._lost(exc)
            return None, open_s
        self.synced = len(history)
        self.failures = 0
        return proposal, open_s

    async def _open(self, history: Sequence[int]) -> None:
        self.session, _ = await self.client.open(
            history, request_id=self.request_id, target=self.target, sampling=self.sampling
        )
        self.opened = True
        self.synced = len(history)

    def _lost(self, exc: BaseException) -> None:
        self.failures += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1))
        self.retry_at = time.monotonic() + delay
        reason = str(exc) or f"no answer within {self.deadline_s} s"
        log.warning("draft lost: continuing at K=0", error=reason, retry_in_s=delay)

    async def close(self) -> None:
        opening, self.opening = self.opening, None
        if opening is not None:
            opening.cancel()  # an open cut short closes its stream itself
            await asyncio.gather(opening, return_exceptions=True)
        session, self.session = self.session, None
        if session is not None:
            await session.close()


class TargetLink:
    """The target session of one generation, reopened on failure."""

    def __init__(self, client: TargetClient, *, request_id: str, sampling: SamplingParams, attempts: int) -> None:
        self.client = client
        self.request_id = request_id
        self.sampling = sampling
        self.attempts = attempts
        self.session = None

    async def open(self, history: Sequence[int]) -> float:
        """Opens a session on the history, on another replica after a failure."""
        for attempt in range(self.attempts):
            try:
                self.session, compute_s = await self.client.open(
                    history, request_id=self.request_id, sampling=self.sampling
                )
                return compute_s
            except Unavailable as exc:
                log.warning("target unavailable", error=str(exc), attempt=attempt)
                last = exc
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        raise Unavailable(f"no target worker is available: {last}")

    async def verify(
        self, history: list[int], draft_tokens: list[int], draft_probs: Sequence[CompactProbs]
    ) -> tuple[VerifyResult, float]:
        """Verifies, reopening the session on the history after a failure.
        Returns the verdict and the compute time of any reopening prefill."""
        reopen_s = 0.0
        for attempt in range(self.attempts):
            if self.session is None:
                reopen_s += await self.open(history)
                log.info("target session reopened", committed_len=len(history))
            try:
                return await self.session.verify(len(history), draft_tokens, draft_probs), reopen_s
            except Unavailable as exc:
                log.warning("target lost: reopening on the history", error=str(exc), attempt=attempt)
                await self.close()
                last = exc
        raise Unavailable(f"no target worker could finish the request: {last}")

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await session.close()
