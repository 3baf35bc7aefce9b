"""Rounds in lockstep (docs/design.md#rounds-in-lockstep).

Where the draft and the target share CPU cores, a coordinator's drafting
sessions run their rounds in two phases, together, as the sequences of a
batch do in a single-process engine: all of them draft, then all of them
verify. The draft engine steps the drafting sessions at once, the target
engine verifies them in one step, and neither runs beside the other. Left
alone the sessions drift apart: the draft steps of some run beside the
target steps of others, each slowing the other on the shared cores, and the
engines step more often with fewer rows — where the cost model
(coordinator/adaptive/) prices one step for all. Every verify of a session
that may draft is in a verify phase, its prompt's prefill and its rounds
at K = 0 too: while none drafts they all join the one verify phase and
wait for nothing, and the first session to draft waits for those in flight
rather than draft beside them.

A phase ends when every session in it has done its part (or left); the
sessions that arrived for the next phase meanwhile start it together, and a
session that arrives while its phase runs joins it. A wait is bounded
(``max_wait_s``): a session held up by a slow worker holds the others up no
longer than that, and the next phase then starts without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["draft", "verify"]


@dataclass
class _Arrivals:
    """The sessions waiting for a phase to start, and the event that starts it."""

    sessions: set[object] = field(default_factory=set)
    started: asyncio.Event = field(default_factory=asyncio.Event)


class Lockstep:
    """The two phases of the rounds of a coordinator's drafting sessions."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self.phase: Phase = "verify"
        self._running: set[object] = set()
        """The sessions in the current phase that have not done their part."""
        self._arrivals: dict[Phase, _Arrivals] = {"draft": _Arrivals(), "verify": _Arrivals()}
        self._drafting: set[object] = set()
        """The sessions in a round that drafts, from :meth:`draft` until they leave."""

    @property
    def active(self) -> bool:
        """Whether some session drafts: is in a round that drafts."""
        return bool(self._drafting)

    async def draft(self, session: object, *, drafts: bool = True) -> None:
        """Before ``session`` drafts (or, not ``drafts``, goes on with none
        while others draft): waits until no verify is in flight."""
        if drafts:
            self._drafting.add(session)
        await self._enter("draft", session)

    async def verify(self, session: object) -> None:
        """Before ``session`` verifies: waits until every session of this
        draft phase has its drafts."""
        self._done(session)
        await self._enter("verify", session)

    @asynccontextmanager
    async def verifying(self, session: object) -> AsyncIterator[float]:
        """``session``'s verify phase, from :meth:`verify` until it leaves
        (its verdict came back, or it failed); yields the seconds it waited."""
        started = time.perf_counter()
        await self.verify(session)
        try:
            yield time.perf_counter() - started
        finally:
            self.leave(session)

    def leave(self, session: object) -> None:
        """``session``'s verdict came back, or its generation ended."""
        self._drafting.discard(session)
        self._done(session)
        for arrivals in self._arrivals.values():
            arrivals.sessions.discard(session)

    async def _enter(self, phase: Phase, session: object) -> None:
        if self.phase == phase:
            self._running.add(session)  # the phase runs: join it
            return
        arrivals = self._arrivals[phase]
        arrivals.sessions.add(session)
        if not self._running:
            self._start(phase)
            return
        try:
            await asyncio.wait_for(arrivals.started.wait(), self.max_wait_s)
        except TimeoutError:
            if self.phase != phase:  # held up: start without the others
                self._start(phase)

    def _done(self, session: object) -> None:
        """``session`` has done its part of the current phase."""
        self._running.discard(session)
        if not self._running:
            following: Phase = "draft" if self.phase == "verify" else "verify"
            if self._arrivals[following].sessions:
                self._start(following)

    def _start(self, phase: Phase) -> None:
        arrivals = self._arrivals[phase]
        self._arrivals[phase] = _Arrivals()
        self.phase = phase
        self._running = arrivals.sessions
        arrivals.started.set()
