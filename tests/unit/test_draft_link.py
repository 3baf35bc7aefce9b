"""DraftLink: a draft session open slower than the round deadline never
stalls the stream; it finishes in the background while rounds run at K = 0."""

from __future__ import annotations

import asyncio
import time

from coordinator.recovery import DraftLink
from coordinator.workers import Proposal, WorkerInfo
from outrider.sampling import SamplingParams

TARGET = WorkerInfo(model="t", drafter="", vocab_size=100, vocab_fingerprint="", max_context=512)


class RecordingSession:
    def __init__(self) -> None:
        self.rounds: list[tuple[int, list[int]]] = []
        self.closed = False

    async def propose(self, committed_len, new_tokens, k) -> Proposal:
        self.rounds.append((committed_len, list(new_tokens)))
        return Proposal([7] * k, 0.001)

    async def close(self) -> None:
        self.closed = True


class SlowOpenDraft:
    """A draft client whose open (prefill) takes ``open_s`` seconds."""

    def __init__(self, open_s: float) -> None:
        self.open_s = open_s
        self.opened_with: list[list[int]] = []
        self.sessions: list[RecordingSession] = []

    async def open(self, tokens, *, request_id, target, sampling):
        await asyncio.sleep(self.open_s)
        self.opened_with.append(list(tokens))
        self.sessions.append(RecordingSession())
        return self.sessions[-1], self.open_s


def link(client: SlowOpenDraft, deadline_s: float) -> DraftLink:
    return DraftLink(client, request_id="r", target=TARGET, sampling=SamplingParams(), deadline_s=deadline_s)


async def test_an_open_slower_than_the_deadline_goes_on_in_the_background_while_rounds_run_at_k0():
    client = SlowOpenDraft(open_s=0.3)
    draft = link(client, deadline_s=0.05)
    history = [1, 2, 3]

    started = time.monotonic()
    proposal, open_s = await draft.propose(history, 4)
    assert proposal is None  # waited one deadline, not the whole open
    assert 0.04 < open_s <= time.monotonic() - started < 0.25  # and says so: the round's time went to the draft
    history.append(4)
    started = time.monotonic()
    assert await draft.propose(history, 4) == (None, 0.0)  # the open is still running: no wait at all
    assert time.monotonic() - started < 0.02

    await asyncio.sleep(0.35)
    history.append(5)
    proposal, open_s = await draft.propose(history, 4)
    assert proposal is not None and proposal.draft_tokens == [7] * 4
    assert open_s == 0.0  # the prefill overlapped earlier rounds
    # Opened on the history as it was when the open started, then synced with what came since.
    assert client.opened_with == [[1, 2, 3]]
    assert client.sessions[0].rounds == [(5, [4, 5])]
    await draft.close()
    assert client.sessions[0].closed


async def test_closing_while_an_open_runs_in_the_background_cancels_it():
    client = SlowOpenDraft(open_s=30.0)
    draft = link(client, deadline_s=0.05)
    assert (await draft.propose([1, 2, 3], 4))[0] is None
    started = time.monotonic()
    await draft.close()
    assert time.monotonic() - started < 1.0
    assert draft.opening is None and client.sessions == []
