"""Rounds in lockstep: every drafting session drafts while no verify is in
flight, and verifies once every session of the draft phase has its drafts."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.lockstep import Lockstep
from coordinator.stats import RoundRecord, Stats
from outrider.speculation import Verdict


class Trace:
    """What the sessions did, in order: (session, "draft" | "verify" | "back")."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def phases(self) -> list[str]:
        """The sequence of phases with repeats merged."""
        merged: list[str] = []
        for _, event in self.events:
            phase = "verify" if event == "back" else event
            if not merged or merged[-1] != phase:
                merged.append(phase)
        return merged


async def rounds(
    lockstep: Lockstep, trace: Trace, name: str, *, draft_s: float, verify_s: float, count: int
) -> None:
    for _ in range(count):
        await lockstep.draft(name)
        trace.events.append((name, "draft"))
        await asyncio.sleep(draft_s)
        await lockstep.verify(name)
        trace.events.append((name, "verify"))
        await asyncio.sleep(verify_s)
        lockstep.leave(name)
        trace.events.append((name, "back"))
    lockstep.leave(name)


async def test_sessions_that_draft_for_different_times_verify_together():
    lockstep, trace = Lockstep(max_wait_s=5.0), Trace()
    await asyncio.gather(
        rounds(lockstep, trace, "short", draft_s=0.001, verify_s=0.01, count=3),
        rounds(lockstep, trace, "long", draft_s=0.03, verify_s=0.01, count=3),
        rounds(lockstep, trace, "none", draft_s=0.0, verify_s=0.01, count=3),
    )
    # Three rounds, each a draft phase then a verify phase, never overlapping.
    assert trace.phases() == ["draft", "verify"] * 3
    verifies = [i for i, (_, event) in enumerate(trace.events) if event == "verify"]
    drafts = [i for i, (_, event) in enumerate(trace.events) if event == "draft"]
    for r in range(3):
        round_verifies = verifies[3 * r : 3 * r + 3]
        round_drafts = drafts[3 * r : 3 * r + 3]
        assert max(round_drafts) < min(round_verifies)


async def test_a_session_arriving_while_others_verify_waits_for_their_verdicts():
    lockstep, trace = Lockstep(max_wait_s=5.0), Trace()

    async def late() -> None:
        await asyncio.sleep(0.005)  # arrives during the first verify phase
        await rounds(lockstep, trace, "late", draft_s=0.001, verify_s=0.01, count=1)

    await asyncio.gather(
        rounds(lockstep, trace, "early", draft_s=0.001, verify_s=0.03, count=1), late()
    )
    late_draft = trace.events.index(("late", "draft"))
    assert trace.events.index(("early", "back")) < late_draft


async def test_a_session_held_up_holds_the_others_no_longer_than_the_wait():
    lockstep = Lockstep(max_wait_s=0.05)
    await lockstep.draft("stuck")  # drafts and never comes back
    await lockstep.draft("other")
    loop = asyncio.get_running_loop()
    started = loop.time()
    await lockstep.verify("other")
    assert 0.04 <= loop.time() - started < 1.0
    assert lockstep.phase == "verify"


async def test_a_session_that_leaves_releases_the_others():
    lockstep = Lockstep(max_wait_s=5.0)
    await lockstep.draft("leaving")
    await lockstep.draft("other")
    waiting = asyncio.ensure_future(lockstep.verify("other"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    lockstep.leave("leaving")  # its generation ended mid-round
    await asyncio.wait_for(waiting, timeout=1.0)
    assert lockstep.phase == "verify"


@pytest.mark.parametrize("sessions", [1, 8])
async def test_many_rounds_of_many_sessions_never_deadlock(sessions):
    lockstep, trace = Lockstep(max_wait_s=5.0), Trace()
    await asyncio.wait_for(
        asyncio.gather(
            *(
                rounds(lockstep, trace, f"s{i}", draft_s=0.001 * (i % 3), verify_s=0.002, count=20)
                for i in range(sessions)
            )
        ),
        timeout=10.0,
    )
    assert sum(event == "back" for _, event in trace.events) == 20 * sessions


def test_a_rounds_overhead_leaves_out_its_waits_for_the_other_sessions():
    # A target-only round waited 300 ms for the others' draft phase: that is
    # their drafting, priced as such, not what its own round costs.
    record = RoundRecord(verify_s=0.080, lockstep_s=0.300)
    record.round_s = 0.385
    assert record.overhead_s == pytest.approx(0.005)


def test_a_rounds_overhead_leaves_out_the_step_its_verify_waited_behind():
    # The verify came while a newcomer's 200 ms prefill ran: the engine took
    # it after that step. The wait is that session's work, priced as a step;
    # counted as this round's overhead it would make every round look dearer.
    record = RoundRecord(verify_s=0.045, queued_s=0.200)
    record.round_s = 0.250
    assert record.overhead_s == pytest.approx(0.005)
    stats = Stats(accepted_per_position=[])
    stats.record_round(None, Verdict(num_accepted=0, next_token=1), record, streamed=1)
    assert stats.verify_time_s == pytest.approx(0.245)  # the time at the target, all of it
    assert stats.overhead_time_s == pytest.approx(0.005)
    assert record.critical_path_s == pytest.approx(0.005)  # no drafts to wait for


async def test_it_is_active_while_a_session_is_in_a_round_that_drafts():
    lockstep = Lockstep(max_wait_s=1.0)
    async with lockstep.verifying("target-only"):  # a round at K = 0, none drafting
        assert not lockstep.active
    await lockstep.draft("a")
    assert lockstep.active
    await lockstep.draft("b", drafts=False)  # at K = 0 beside it
    await lockstep.verify("a")
    lockstep.leave("a")
    assert not lockstep.active
    lockstep.leave("b")


async def test_rounds_at_k0_verify_at_once_and_a_first_draft_waits_for_them():
    lockstep = Lockstep(max_wait_s=5.0)
    order: list[str] = []

    async def verify_at_k0(name: str, seconds: float) -> None:
        async with lockstep.verifying(name) as waited:
            assert waited < 0.01  # none drafts: nothing to wait for
            await asyncio.sleep(seconds)
        order.append(f"{name} verified")

    async def first_draft() -> None:
        await asyncio.sleep(0.01)  # once both verifies are in flight
        await lockstep.draft("drafter")
        order.append("drafter drafts")
        await lockstep.verify("drafter")
        lockstep.leave("drafter")

    await asyncio.gather(verify_at_k0("x", 0.05), verify_at_k0("y", 0.1), first_draft())
    assert order == ["x verified", "y verified", "drafter drafts"]
