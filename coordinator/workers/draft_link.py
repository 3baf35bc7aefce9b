"""A generation's draft session, with recovery and pipelined speculation.

The coordinator's history is the truth and a worker's cache only a cache of
it (docs/design.md#protocol). A draft's failure, or no answer within the
per-round deadline, costs only speed: the stream goes on at K = 0 (target
only) and the draft session is reopened in the background, prefilled from
the history, after a back-off; the stream never waits for a lost draft.
Pipelined (docs/design.md#pipelined-rounds), the link also drafts the next
round while the target verifies this one, and hands it over when the
verdict bears out what it assumed. A refusal of the request itself (a bad
argument, a vocabulary mismatch) when the session is first opened is not a
worker failure and reaches the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from outrider.coordinator.workers.protocol import (
    DraftClient,
    DraftSession,
    Reply,
    WorkerInfo,
)
from outrider.errors import FailedPrecondition, OutriderError, ResourceExhausted, Unavailable
from outrider.hidden_states import NONE, HiddenStates, concat
from outrider.logging import get_logger
from outrider.sampling_params import SamplingParams
from outrider.speculation import Proposal

log = get_logger(__name__)


@dataclass
class Speculation:
    """The next round's proposal, drafted while this round is verified."""

    committed_len: int
    """The history's length when it started."""
    assumed: list[int]
    """The drafts it assumes follow; then the draft's guess of the bonus token."""
    task: asyncio.Future[Reply[Proposal]]


class DraftLink:
    """The draft session of one generation; None of it while it is lost.

    A frozen draft stalls the stream once, by one deadline at most: the
    round that finds it unresponsive (or the first open, which waits no
    longer than a round). From then on the draft is lost: it is reopened in
    the background, after a back-off that grows while the reopens keep
    failing, and the rounds go on at K = 0 without waiting for it until a
    reopen has succeeded."""

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
        on_open: Callable[[int, float], None] | None = None,
    ) -> None:
        self.client = client
        self.on_open = on_open
        """Told of each open: the tokens prefilled and the draft's seconds."""
        self.request_id = request_id
        self.target = target
        self.sampling = sampling
        self.deadline_s = deadline_s
        self.open_deadline_s = open_deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.session: DraftSession | None = None
        self.opening: asyncio.Task[DraftSession] | None = None
        """An open running in the background (a reopen, a first open begun
        early or slower than a round)."""
        self.open_started = 0.0
        self.first_open_waited = False
        """A round has waited for the first open (one does, once)."""
        self.opened = False
        self.synced = 0
        self.failures = 0
        """Losses since the last round the draft answered."""
        self.retry_at = 0.0
        self.rounds = 0
        """Ids of the rounds asked for: a proposal must answer the last one."""
        self.speculation: Speculation | None = None
        """At most one speculation in flight."""
        self.hidden_states: list[HiddenStates] = []
        """For a draft head: the target's hidden states of the positions
        committed since the last round (or since the start, before the
        first open), which go with the next round's tokens."""

    def received(self, hidden_states: HiddenStates) -> None:
        """Takes the target's hidden states of the positions its last answer
        made committed (for a draft head; none for other drafters)."""
        if hidden_states.rows:
            self.hidden_states.append(hidden_states)

    def _take_hidden_states(self) -> HiddenStates:
        states, self.hidden_states = concat(self.hidden_states), []
        return states if states.rows else NONE

    @property
    def begun(self) -> bool:
        """Whether a draft session was ever asked for: it is open, opening,
        or was open once."""
        return self.session is not None or self.opening is not None or self.opened

    async def propose(self, history: list[int], k: int) -> tuple[Reply[Proposal] | None, float]:
        """Syncs and proposes: the proposal (None when the draft is lost:
        draft nothing), and the seconds this round spent opening the session.

        The session opens at the first round that drafts (or sooner, by
        :meth:`open_soon`), prefilled with the history, so a generation whose
        rounds never draft (adaptive K at 0) never costs the draft worker
        anything. A refusal of that first open (a bad argument, a vocabulary
        mismatch) reaches the client; a draft that is down, slow or full only
        means K = 0 for now."""
        session, open_s = self.session, 0.0
        if session is None:
            session, open_s = await self._opened(history)
            if session is None:
                return None, open_s
        try:
            async with asyncio.timeout(self.deadline_s):  # no task per round, unlike wait_for
                proposal = await self._ask(session, *self._round(history), k, None)
        except TimeoutError:
            session.failing()
            await self._drop(f"no proposal within the round deadline of {self.deadline_s:g} s")
            return None, open_s
        except OutriderError as exc:
            await self._drop(str(exc))
            return None, open_s
        self.failures = 0
        return proposal, open_s

    async def _opened(self, history: list[int]) -> tuple[DraftSession | None, float]:
        """The session, once its open is done (begun now if none runs, but
        not before the back-off after a loss has passed), and the seconds
        this round waited for it: only the first open is waited for, up to
        a round's deadline from when it began. None while it opens or after
        it failed."""
        open_s = 0.0
        opening = self.opening
        if opening is None:
            if time.monotonic() < self.retry_at:
                return None, 0.0
            opening = self._begin_open(history)
            if self.failures:
                log.debug("reopening the draft session in the background", attempt=self.failures)
        if not opening.done() and not self.opened and not self.first_open_waited:
            # The first open: worth a round's wait, from when it began.
            self.first_open_waited = True
            started = time.perf_counter()
            left = self.open_started + self.deadline_s - time.monotonic()
            await asyncio.wait({opening}, timeout=max(0.0, left))
            open_s = time.perf_counter() - started
            if not opening.done():
                log.warning(
                    "draft session not open within the round deadline: "
                    "rounds go on at K=0 while it opens",
                    deadline_s=self.deadline_s,
                )
        if not opening.done():
            return None, open_s
        self.opening = None
        try:
            session = opening.result()
        except (Unavailable, ResourceExhausted) as exc:
            self._lost(str(exc))
            return None, open_s
        except OutriderError as exc:
            if not self.opened:
                raise
            self._lost(str(exc))
            return None, open_s
        if self.failures:
            log.info("draft session reopened", committed_len=self.synced, failures=self.failures)
        return session, open_s

    def open_soon(self, history: list[int]) -> None:
        """Starts the first open now, in the background, so that the draft's
        prefill runs beside the target's at a generation's start; the first
        round that drafts waits for it until a round's deadline after it
        began, as for any first open."""
        if self.session is None and self.opening is None and not self.opened:
            self._begin_open(history)

    def _begin_open(self, history: list[int]) -> asyncio.Task[DraftSession]:
        log.debug("draft session opening", tokens=len(history))
        # A copy: the history grows while an open runs in the background.
        self.opening = asyncio.ensure_future(self._open(list(history), self._take_hidden_states()))
        self.open_started = time.monotonic()
        return self.opening

    def speculate(self, history: list[int], drafts: list[int], k: int) -> None:
        """Starts a speculation (docs/design.md#pipelined-rounds): while the target verifies
        ``drafts``, the draft proposes the next round of ``k`` drafts as if
        it accepted them whole and committed the draft's guess of its bonus
        token. A lost draft speculates nothing."""
        session = self.session
        if session is None or self.speculation is not None:
            return
        drafts = list(drafts)
        round_ = self._round(history)  # now: the loop's history grows while this runs

        async def ask() -> Reply[Proposal]:
            async with asyncio.timeout(self.deadline_s):
                return await self._ask(session, *round_, k, drafts)

        self.speculation = Speculation(len(history), drafts, asyncio.ensure_future(ask()))

    async def speculated(self, history: list[int]) -> tuple[Reply[Proposal] | None, bool | None]:
        """The proposal of the speculation in flight, if the history is what
        it assumed: ``(proposal, True)`` (a hit); ``(None, False)`` when it is
        not (a miss: the round drafts afresh); ``(None, None)`` without one.
        A lost draft's speculation is a miss."""
        speculation, self.speculation = self.speculation, None
        if speculation is None:
            return None, None
        try:
            reply = await speculation.task
        except TimeoutError:
            if self.session is not None:
                self.session.failing()
            await self._drop(f"no speculation within the round deadline of {self.deadline_s:g} s")
            return None, False
        except OutriderError as exc:
            await self._drop(str(exc))
            return None, False
        committed = history[speculation.committed_len :]  # since the speculation started
        guess = reply.value.guess
        hit = guess is not None and committed == [*speculation.assumed, guess]
        return (reply, True) if hit else (None, False)

    def _round(self, history: list[int]) -> tuple[int, list[int], int, HiddenStates]:
        """The next round's committed length, the tokens committed since the
        last one (the draft's session syncs them), its id, and the target's
        hidden states of those tokens' positions (for a head)."""
        self.rounds += 1
        new_tokens, self.synced = history[self.synced :], len(history)
        return len(history), new_tokens, self.rounds, self._take_hidden_states()

    async def _ask(
        self,
        session: DraftSession,
        committed_len: int,
        new_tokens: list[int],
        round_id: int,
        hidden_states: HiddenStates,
        k: int,
        assumed: list[int] | None,
    ) -> Reply[Proposal]:
        """One round on the session: propose after the committed history (or
        after ``assumed``, when given), and check the answer is that round's."""
        reply = await session.propose(
            committed_len, new_tokens, k, assumed, round_id, hidden_states
        )
        proposal = reply.value
        follows = committed_len if assumed is None else committed_len + len(assumed) + 1
        if proposal.round_id != round_id or (proposal.tokens and proposal.follows_len != follows):
            raise FailedPrecondition(
                f"the draft answered round {proposal.round_id} after {proposal.follows_len} tokens "
                f"where round {round_id} after {follows} was asked for"
            )
        return reply

    async def _open(self, history: Sequence[int], hidden_states: HiddenStates) -> DraftSession:
        self.session, compute_s = await self.client.open(
            history,
            request_id=self.request_id,
            target=self.target,
            sampling=self.sampling,
            deadline_s=self.open_deadline_s,
            hidden_states=hidden_states,
        )
        self.opened = True
        self.synced = len(history)
        if self.on_open is not None:
            self.on_open(len(history), compute_s)
        return self.session

    async def _drop(self, why: str) -> None:
        """The session failed or stopped answering: cut it, and go on without it."""
        await self.close()
        self._lost(why)

    def _lost(self, why: str) -> None:
        self.failures += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1))
        self.retry_at = time.monotonic() + delay
        log.warning(
            "draft lost: continuing at K=0, reopening it in the background",
            error=why,
            failures=self.failures,
            retry_in_s=delay,
        )

    async def close(self, *, finished: bool = False) -> None:
        """Ends the session: closed when the generation ``finished`` (after
        the speculation in flight, whose answer is no longer needed), cut
        otherwise. An open in flight is cancelled; the worker frees the
        session's cache either way."""
        opening, self.opening = self.opening, None
        if opening is not None:
            opening.cancel()  # an open cut short cancels its stream itself
            await asyncio.gather(opening, return_exceptions=True)
        speculation, self.speculation = self.speculation, None
        session, self.session = self.session, None
        if speculation is not None:
            if finished:
                speculation.task.add_done_callback(_ignore_outcome)
            else:
                speculation.task.cancel()
                await asyncio.gather(speculation.task, return_exceptions=True)
        if session is None:
            return
        if finished:
            session.close()
        else:
            session.cancel()


def _ignore_outcome(task: asyncio.Future) -> None:
    """Takes the outcome of a task no one awaits (so asyncio does not log an
    exception as never retrieved)."""
    if not task.cancelled():
        task.exception()
