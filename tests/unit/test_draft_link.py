"""DraftLink: a draft session open slower than the round deadline never
stalls the stream; it finishes in the background while rounds run at K = 0.
A frozen draft stalls the stream once, by one deadline: it is reopened in the
background, with a back-off that grows while the reopens fail, and drafting
resumes once one succeeds.
A speculation (the next round drafted while this one is verified) is a hit
only if the verdict committed what it assumed; one whose draft fails, is
late or answers another round is a miss, and the draft is lost for a while."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
import structlog.testing

from outrider.coordinator.workers.draft_link import DraftLink
from outrider.coordinator.workers.protocol import Reply, WorkerInfo
from outrider.errors import Unavailable
from outrider.hidden_states import HiddenStates
from outrider.sampling import SamplingParams
from outrider.speculation import Proposal

TARGET = WorkerInfo(model="t", drafter="", vocab_size=100, vocab_fingerprint="", max_context=512)


class EndingSession:
    """Records how the session ended: closed (its generation finished) or cancelled (cut)."""

    def __init__(self) -> None:
        self.ended: str | None = None

    @property
    def closed(self) -> bool:
        return self.ended is not None

    def failing(self) -> None:
        pass

    def close(self) -> None:
        self.ended = "closed"

    def cancel(self) -> None:
        self.ended = "cancelled"


class RecordingSession(EndingSession):
    def __init__(self) -> None:
        super().__init__()
        self.rounds: list[tuple[int, list[int]]] = []
        self.hidden_states: list[HiddenStates | None] = []

    async def propose(
        self, committed_len, new_tokens, k, assumed=None, round_id=0, hidden_states=None
    ) -> Reply[Proposal]:
        self.rounds.append((committed_len, list(new_tokens)))
        self.hidden_states.append(hidden_states)
        return Reply(Proposal([7] * k, round_id=round_id, follows_len=committed_len), 0.001)


class SlowOpenDraft:
    """A draft client whose open (prefill) takes ``open_s`` seconds."""

    def __init__(self, open_s: float) -> None:
        self.open_s = open_s
        self.opened_with: list[list[int]] = []
        self.open_hidden_states: list[HiddenStates | None] = []
        self.sessions: list[RecordingSession] = []

    async def open(self, tokens, *, request_id, target, sampling, deadline_s=None, **kwargs):
        await asyncio.sleep(self.open_s)
        self.opened_with.append(list(tokens))
        self.open_hidden_states.append(kwargs.get("hidden_states"))
        self.sessions.append(RecordingSession())
        return self.sessions[-1], self.open_s


def link(client: SlowOpenDraft, deadline_s: float) -> DraftLink:
    return DraftLink(
        client, request_id="r", target=TARGET, sampling=SamplingParams(), deadline_s=deadline_s
    )


async def test_the_targets_hidden_states_go_with_the_tokens_of_their_positions():
    """For a head: the open carries those of the history, each round those of its new tokens."""
    client = SlowOpenDraft(open_s=0.0)
    draft = link(client, deadline_s=1.0)

    def rows(n: int, fill: int) -> HiddenStates:
        return HiddenStates(bytes([fill]) * 4 * n, n)  # 2 bfloat16 values a row

    history = [1, 2, 3, 4]
    draft.received(rows(3, 1))  # the target's prefill: every position but the last
    await draft.propose(history, 2)
    assert client.open_hidden_states == [rows(3, 1)]
    history += [5, 6]
    draft.received(rows(1, 2))  # a verdict's: the last committed token's,
    draft.received(rows(1, 3))  # and the next's
    await draft.propose(history, 2)
    session = client.sessions[0]
    assert session.rounds[-1] == (6, [5, 6])
    assert session.hidden_states[-1] == HiddenStates(bytes([2]) * 4 + bytes([3]) * 4, 2)
    await draft.close()


async def test_an_open_slower_than_the_deadline_goes_on_in_the_background_while_rounds_run_at_k0():
    client = SlowOpenDraft(open_s=0.3)
    draft = link(client, deadline_s=0.05)
    history = [1, 2, 3]

    started = time.monotonic()
    reply, open_s = await draft.propose(history, 4)
    assert reply is None  # waited one deadline, not the whole open
    assert (
        0.04 < open_s <= time.monotonic() - started < 0.25
    )  # and says so: the round's time went to the draft
    history.append(4)
    started = time.monotonic()
    assert await draft.propose(history, 4) == (
        None,
        0.0,
    )  # the open is still running: no wait at all
    assert time.monotonic() - started < 0.02

    await asyncio.sleep(0.35)
    history.append(5)
    reply, open_s = await draft.propose(history, 4)
    assert reply is not None and reply.value.tokens == [7] * 4
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


# --- speculation (docs/design.md#pipelined-rounds) -------------------------------


@dataclass(frozen=True)
class Call:
    committed_len: int
    new_tokens: list[int]
    k: int
    assumed: list[int] | None
    round_id: int


class SpeculatingSession(EndingSession):
    """A draft session that drafts 7s; asked to speculate, it guesses
    ``guess`` as the bonus token and drafts 8s after it. ``fail`` makes a
    speculation raise, ``stall`` holds it until set, and ``bad_answer``
    (``"round_id"`` or ``"follows_len"``) makes it answer something other
    than what was asked."""

    def __init__(
        self,
        *,
        guess: int = 9,
        fail: Exception | None = None,
        stall: asyncio.Event | None = None,
        bad_answer: str | None = None,
    ) -> None:
        self.guess = guess
        self.fail = fail
        self.stall = stall
        self.bad_answer = bad_answer
        super().__init__()
        self.calls: list[Call] = []
        self.cancelled = False
        """A speculation was cancelled while the worker drafted it."""

    async def propose(
        self, committed_len, new_tokens, k, assumed=None, round_id=0, hidden_states=None
    ) -> Reply[Proposal]:
        self.calls.append(
            Call(
                committed_len,
                list(new_tokens),
                k,
                None if assumed is None else list(assumed),
                round_id,
            )
        )
        if assumed is None:
            return Reply(Proposal([7] * k, round_id=round_id, follows_len=committed_len), 0.001)
        try:
            if self.stall is not None:
                await self.stall.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.fail is not None:
            raise self.fail
        follows_len = committed_len + len(assumed) + 1
        if self.bad_answer == "round_id":
            round_id -= 1  # a stale answer, to the round before
        elif self.bad_answer == "follows_len":
            follows_len -= 1
        return Reply(
            Proposal([8] * k, round_id=round_id, follows_len=follows_len, guess=self.guess), 0.001
        )


class OneSessionDraft:
    """A draft client whose opens return ``session`` at once."""

    def __init__(self, session: SpeculatingSession) -> None:
        self.session = session
        self.opened_with: list[list[int]] = []

    async def open(self, tokens, *, request_id, target, sampling, deadline_s=None, **_):
        self.opened_with.append(list(tokens))
        return self.session, 0.0


async def speculating(
    session: SpeculatingSession, history: list[int], **kwargs
) -> tuple[DraftLink, OneSessionDraft]:
    """A link that proposed [7, 7] after ``history`` and speculates 3 drafts after them."""
    client = OneSessionDraft(session)
    draft = DraftLink(
        client,
        request_id="r",
        target=TARGET,
        sampling=SamplingParams(),
        **{"deadline_s": 1.0, **kwargs},
    )
    reply, _ = await draft.propose(history, 2)
    assert reply.value.tokens == [7, 7]
    draft.speculate(history, reply.value.tokens, 3)
    assert draft.speculation is not None
    return draft, client


async def test_speculation_hit_returns_its_proposal_and_next_round_syncs_assumed_drafts_and_guess():
    session = SpeculatingSession(guess=9)
    history = [1, 2, 3]
    draft, _ = await speculating(session, history)
    history += [7, 7, 9]  # both drafts accepted, and the target's bonus token is the draft's guess

    reply, hit = await draft.speculated(history)
    assert hit is True
    assert (
        reply.value.tokens == [8, 8, 8] and reply.value.guess == 9 and reply.value.follows_len == 6
    )
    # The speculation synced nothing: it drafted after the history it knew plus the assumed drafts.
    assert session.calls == [Call(3, [], 2, None, 1), Call(3, [], 3, [7, 7], 2)]

    # The round after the hit: its new tokens are what the speculation only
    # assumed (the drafts and the guess), then what that round committed.
    history += [8, 8, 8, 4]
    reply, _ = await draft.propose(history, 2)
    assert reply.value.tokens == [7, 7]
    assert session.calls[-1] == Call(10, [7, 7, 9, 8, 8, 8, 4], 2, None, 3)
    assert draft.failures == 0
    await draft.close()
    assert session.closed


@pytest.mark.parametrize(
    "committed",
    [
        pytest.param([7, 5], id="a-draft-rejected"),
        pytest.param([7, 7, 4], id="another-bonus-token"),
    ],
)
async def test_speculation_miss_returns_nothing_and_next_propose_syncs_the_real_committed_tokens(
    committed,
):
    session = SpeculatingSession(guess=9)
    history = [1, 2, 3]
    draft, _ = await speculating(session, history)
    history += committed

    assert await draft.speculated(history) == (None, False)
    assert draft.speculation is None and draft.session is session  # a miss is not a loss
    reply, _ = await draft.propose(history, 2)
    assert reply.value.tokens == [7, 7] and reply.value.follows_len == len(history)
    assert session.calls[-1] == Call(len(history), committed, 2, None, 3)
    assert draft.failures == 0
    await draft.close()


async def test_without_a_speculation_speculated_says_so():
    draft, _ = await speculating(SpeculatingSession(), [1, 2, 3])
    await draft.speculated([1, 2, 3, 7, 7, 9])
    assert await draft.speculated([1, 2, 3, 7, 7, 9]) == (None, None)
    await draft.close()


@pytest.mark.parametrize(
    "session",
    [
        pytest.param(
            lambda: SpeculatingSession(fail=Unavailable("draft worker gone")), id="unavailable"
        ),
        pytest.param(lambda: SpeculatingSession(stall=asyncio.Event()), id="past-the-deadline"),
        pytest.param(lambda: SpeculatingSession(bad_answer="round_id"), id="wrong-round-id"),
        pytest.param(lambda: SpeculatingSession(bad_answer="follows_len"), id="wrong-follows-len"),
    ],
)
async def test_a_failed_speculation_is_a_miss_and_the_draft_is_lost_until_its_back_off_ends(
    session,
):
    session = session()
    history = [1, 2, 3]
    draft, client = await speculating(session, history, deadline_s=0.1, backoff_s=0.2)
    history += [7, 7, 9]  # what the speculation assumed: a hit, had it answered

    assert await draft.speculated(history) == (None, False)
    assert draft.session is None and session.closed and draft.failures == 1
    # Lost: no speculation, and K = 0 without a reopen until the back-off ends.
    draft.speculate(history, [], 3)
    assert draft.speculation is None
    assert await draft.propose(history, 2) == (None, 0.0)
    assert client.opened_with == [[1, 2, 3]]

    await asyncio.sleep(0.25)
    history.append(5)
    session.fail = session.stall = session.bad_answer = None
    # The back-off over, the reopen runs in the background: this round does not wait for it.
    assert await draft.propose(history, 2) == (None, 0.0)
    await asyncio.sleep(0)
    assert client.opened_with == [[1, 2, 3], history]  # reopened on the whole history
    reply, _ = await draft.propose(history, 2)
    assert reply is not None and reply.value.tokens == [7, 7]
    assert session.calls[-1] == Call(len(history), [], 2, None, 3)
    assert draft.failures == 0
    await draft.close()


async def test_cutting_the_session_while_a_speculation_is_in_flight_cancels_it():
    session = SpeculatingSession(stall=asyncio.Event())
    draft, _ = await speculating(session, [1, 2, 3], deadline_s=30.0)
    task = draft.speculation.task
    await asyncio.sleep(0.01)  # the speculation is waiting on the worker
    assert session.calls[-1].assumed == [7, 7]

    started = time.monotonic()
    await draft.close()
    assert time.monotonic() - started < 0.5
    assert task.cancelled() and session.cancelled and session.ended == "cancelled"
    assert draft.speculation is None and draft.session is None
    assert await draft.speculated([1, 2, 3, 7, 7, 9]) == (None, None)


async def test_a_finished_generation_closes_its_session_without_cutting_the_speculation_in_flight():
    stall = asyncio.Event()
    session = SpeculatingSession(stall=stall)
    draft, _ = await speculating(session, [1, 2, 3], deadline_s=30.0)
    task = draft.speculation.task
    await asyncio.sleep(0.01)  # the speculation is waiting on the worker

    started = time.monotonic()
    await draft.close(finished=True)
    assert time.monotonic() - started < 0.05  # the close itself runs in the background
    assert session.ended == "closed" and not task.done()
    stall.set()  # the worker answers; the session's close follows that answer
    await task
    assert not session.cancelled and draft.session is None


# --- a frozen draft ----------------------------------------------------------------


class FreezableDraft:
    """A draft worker that can be frozen, as SIGSTOP freezes one: an open or a
    round sent while it is frozen gets no answer until it thaws, and an open
    past its deadline fails as the gRPC client's does."""

    def __init__(self) -> None:
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.open_times: list[float] = []

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    async def open(self, tokens, *, request_id, target, sampling, deadline_s=None, **_):
        self.open_times.append(time.monotonic())
        try:
            await asyncio.wait_for(self.thawed.wait(), deadline_s)
        except TimeoutError:
            raise Unavailable(
                f"draft worker d did not open the session within {deadline_s:.3g} s"
            ) from None
        return FreezableSession(self), 0.001


class FreezableSession(RecordingSession):
    def __init__(self, draft: FreezableDraft) -> None:
        super().__init__()
        self.draft = draft

    async def propose(self, committed_len, new_tokens, k, assumed=None, round_id=0, *_):
        await self.draft.thawed.wait()
        return await super().propose(committed_len, new_tokens, k, assumed, round_id)


async def test_a_draft_frozen_for_good_stalls_one_round_and_reopens_back_off_more_each_time():
    client = FreezableDraft()
    draft = DraftLink(
        client,
        request_id="r",
        target=TARGET,
        sampling=SamplingParams(),
        deadline_s=0.05,
        open_deadline_s=0.1,
        backoff_s=0.02,
        max_backoff_s=0.08,
    )
    history = [1, 2, 3]
    assert (await draft.propose(history, 2))[0] is not None
    client.freeze()
    waited_s = 0.0
    with structlog.testing.capture_logs() as logs:
        until = time.monotonic() + 1.2
        while time.monotonic() < until:  # rounds at K = 0, ~5 ms each
            history.append(4)
            started = time.monotonic()
            reply, _ = await draft.propose(history, 2)
            waited_s += time.monotonic() - started
            assert reply is None
            await asyncio.sleep(0.005)
    assert waited_s < 0.05 + 0.03  # the round that found it frozen; nothing after
    lost = [entry for entry in logs if entry["event"].startswith("draft lost")]
    assert lost[0]["error"] == "no proposal within the round deadline of 0.05 s"
    assert {entry["error"] for entry in lost[1:]} == {
        "draft worker d did not open the session within 0.1 s"
    }
    assert [entry["retry_in_s"] for entry in lost[:5]] == [0.02, 0.04, 0.08, 0.08, 0.08]
    # The first open, then one reopen after each loss (the last one still waiting).
    assert len(client.open_times) == 1 + len(lost)

    # Thawed: the reopen in flight succeeds, and drafting resumes without a wait.
    client.thaw()
    started = time.monotonic()
    while (reply := (await draft.propose(history, 2))[0]) is None:
        await asyncio.sleep(0.005)
    assert time.monotonic() - started < 0.2
    assert reply.value.tokens == [7, 7] and draft.failures == 0
    await draft.close()
