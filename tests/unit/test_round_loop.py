"""The round loop in one process: engines behind the in-process clients, no
gRPC. Same loop code as across three processes."""

import asyncio
import contextlib
import dataclasses

import pytest
from transformers import AutoTokenizer

from coordinator.adaptive.cost_model import CostModel, CostModels
from coordinator.adaptive.session import AdaptiveK
from coordinator.lockstep import Lockstep
from coordinator.requests import GenerationRequest
from coordinator.round_loop import Generation, generate
from coordinator.served_models import Models
from draft_worker.main import build_sessions as build_draft_sessions
from outrider.config import (
    DraftWorkerConfig,
    EngineConfig,
    Recovery,
    ServiceConfig,
    TargetWorkerConfig,
)
from outrider.errors import Unavailable
from outrider.worker import start_engine
from target_worker.main import build_sessions as build_target_sessions
from tests.inprocess import InProcessDraftClient, InProcessTargetClient
from tests.integration.harness import reference_greedy


@pytest.fixture
async def clients(tiny_target_dir, tiny_draft_other_dir):
    address, engine = ServiceConfig(), EngineConfig(dtype="float64", threads=1)
    target = build_target_sessions(
        TargetWorkerConfig(address, model=str(tiny_target_dir), engine=engine)
    )
    draft = build_draft_sessions(
        DraftWorkerConfig(address, drafter="model", model=str(tiny_draft_other_dir), engine=engine)
    )
    target_engine, draft_engine = (
        start_engine(target, engine, max_rows=8),
        start_engine(draft, engine, max_rows=8),
    )
    yield InProcessTargetClient(target, target_engine), InProcessDraftClient(draft, draft_engine)
    target_engine.shutdown()
    draft_engine.shutdown()


async def run(request, models, target, draft):
    return [delta async for delta in generate(request, models, target, draft)]


async def drafting_models(clients, tiny_target_dir) -> Models:
    """The models of the in-process target and its draft (on the same cores)."""
    target, draft = clients
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    return Models(tokenizer, frozenset(), await target.info(), await draft.info())


@pytest.mark.parametrize("k", [0, 3])
async def test_in_process_loop_matches_target_only(clients, tiny_target_dir, k):
    target, draft = clients
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    prompt = tokenizer("Once upon a time")["input_ids"]
    models = Models(tokenizer, frozenset(), await target.info())
    request = GenerationRequest(
        prompt_ids=tuple(prompt), max_new_tokens=24, num_speculative_tokens=k
    )
    deltas = await run(request, models, target, draft)
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == reference_greedy(tiny_target_dir, prompt, 24, eos=None)
    final = deltas[-1]
    assert final.finish_reason == "length" and final.stats.generated_tokens == 24
    assert (
        "".join(d.text for d in deltas)
        == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
    )
    # Closes are queued on the engines; once a later call has run, they have too.
    await target.engine.run(lambda: None)
    await draft.engine.run(lambda: None)
    assert len(target.sessions.store) == 0 and len(draft.sessions.store) == 0


@pytest.mark.parametrize(
    "where, beside",
    [("apart", True), ("sharing CPU cores", False)],
)
async def test_the_draft_prefills_beside_the_target_unless_they_share_cpu_cores(
    clients, tiny_target_dir, where, beside
):
    """A draft model's prefill starts with the target's, so drafting can
    start at the second round; where the two run on CPUs (one host's cores),
    it starts once the first token is streamed, which then comes as fast as
    without a draft."""
    target, draft = clients
    events: list[str] = []
    target_open, draft_open = target.open, draft.open

    async def opening_target(*args, **kwargs):
        events.append("target open begins")
        try:
            return await target_open(*args, **kwargs)
        finally:
            events.append("target open ends")

    async def opening_draft(*args, **kwargs):
        events.append("draft open begins")
        return await draft_open(*args, **kwargs)

    target.open, draft.open = opening_target, opening_draft
    info = await target.info()
    draft_info = await draft.info()
    assert draft_info.dtype and info.device == draft_info.device == "cpu"
    if where == "apart":
        draft_info = dataclasses.replace(draft_info, device="cuda:0")
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    models = Models(tokenizer, frozenset(), info, draft_info)
    assert models.draft_prefills_beside == beside
    request = GenerationRequest(prompt_ids=(1, 2, 3, 4), max_new_tokens=8, num_speculative_tokens=3)
    deltas = []
    async for delta in generate(request, models, target, draft):
        await asyncio.sleep(0)  # the stream's write
        events.append("delta streamed")
        deltas.append(delta)
    assert sum(len(d.token_ids) for d in deltas) == 8
    draft_at = events.index("draft open begins")
    # (after: once the first token is on its way to the client)
    assert (draft_at > events.index("delta streamed")) != beside
    assert (draft_at > events.index("target open ends")) != beside


async def opens_of_a_session_arriving_in(phase, watched, clients, tiny_target_dir) -> list[str]:
    """Runs a session in a lockstep, and a second that arrives once the
    first is in its first ``phase`` phase, given a second for its open on
    ``watched`` (the target or the draft client) to begin there. The
    lockstep's phase as each of ``watched``'s opens began; both sessions
    give the target's tokens, and leave no phase or cache behind."""
    target, draft = clients
    models = await drafting_models(clients, tiny_target_dir)
    assert models.draft_competes and not models.draft_prefills_beside
    lockstep = Lockstep(max_wait_s=5.0)
    phases: list[str] = []
    opened = asyncio.Event()
    watched_open, enter_phase = watched.open, getattr(lockstep, phase)

    async def opening(*args, **kwargs):
        phases.append(lockstep.phase)
        opened.set()
        return await watched_open(*args, **kwargs)

    async def one(prompt):
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=16, num_speculative_tokens=3)
        gen = generate(request, models, target, draft, lockstep=lockstep)
        return [t async for delta in gen for t in delta.token_ids]

    late: list[asyncio.Task] = []

    async def entering(session, **kwargs):
        await enter_phase(session, **kwargs)
        if not late:  # the first such phase: a second session arrives meanwhile
            opened.clear()
            late.append(asyncio.create_task(one((5, 6, 7))))
            with contextlib.suppress(TimeoutError):  # (its open, were it to begin now)
                await asyncio.wait_for(opened.wait(), 1.0)

    watched.open = opening
    setattr(lockstep, phase, entering)
    first = await one((1, 2, 3, 4))
    second = await late[0]
    assert first == reference_greedy(tiny_target_dir, [1, 2, 3, 4], 16, eos=None)
    assert second == reference_greedy(tiny_target_dir, [5, 6, 7], 16, eos=None)
    assert not lockstep.active
    await target.engine.run(lambda: None)
    await draft.engine.run(lambda: None)
    assert len(target.sessions.store) == 0 and len(draft.sessions.store) == 0
    return phases


async def test_in_the_lockstep_a_draft_opens_in_a_draft_phase_never_beside_a_verify(
    clients, tiny_target_dir
):
    """Where the draft shares the target's cores, a session's draft prefill
    waits for its first draft phase: one whose first token is streamed while
    another session verifies does not open its draft beside that verify."""
    _, draft = clients
    phases = await opens_of_a_session_arriving_in("verify", draft, clients, tiny_target_dir)
    assert phases == ["draft", "draft"]


async def test_in_the_lockstep_a_prompt_is_prefilled_in_a_verify_phase_never_beside_drafts(
    clients, tiny_target_dir
):
    """Where the draft shares the target's cores, a session that arrives
    while others draft waits for a verify phase to prefill its prompt."""
    target, _ = clients
    phases = await opens_of_a_session_arriving_in("draft", target, clients, tiny_target_dir)
    assert len(phases) == 2 and phases[1] == "verify"


async def test_in_the_lockstep_the_first_draft_phase_waits_for_a_prompt_prefilled_meanwhile(
    clients, tiny_target_dir
):
    """Where the draft shares the target's cores, a session's prefill is in
    a verify phase even while no session drafts: the first session to draft
    waits for a prompt another session is prefilling, rather than open its
    draft beside it."""
    target, draft = clients
    models = await drafting_models(clients, tiny_target_dir)
    lockstep = Lockstep(max_wait_s=5.0)
    events: list[str] = []
    slow_begun = asyncio.Event()
    target_open, draft_open = target.open, draft.open

    async def opening_target(tokens, **kwargs):
        if tuple(tokens) != (5, 6, 7):
            return await target_open(tokens, **kwargs)
        slow_begun.set()
        await asyncio.sleep(0.5)  # a long prompt's prefill
        try:
            return await target_open(tokens, **kwargs)
        finally:
            events.append("slow prefill ends")

    async def opening_draft(tokens, **kwargs):
        events.append(f"draft open begins after {len(tokens)} tokens")
        return await draft_open(tokens, **kwargs)

    async def one(prompt):
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=8, num_speculative_tokens=3)
        gen = generate(request, models, target, draft, lockstep=lockstep)
        return [t async for delta in gen for t in delta.token_ids]

    target.open, draft.open = opening_target, opening_draft
    slow = asyncio.create_task(one((5, 6, 7)))
    await slow_begun.wait()
    fast = await one((1, 2, 3, 4))
    assert await slow == reference_greedy(tiny_target_dir, [5, 6, 7], 8, eos=None)
    assert fast == reference_greedy(tiny_target_dir, [1, 2, 3, 4], 8, eos=None)
    assert events.index("slow prefill ends") < events.index("draft open begins after 5 tokens")
    assert not lockstep.active


async def test_adaptive_rounds_stay_within_the_targets_cuda_graphs(clients, tiny_target_dir):
    """A verify of more tokens a row than the target's CUDA graphs hold runs
    eagerly, which its step curve cannot price: adaptive K stays below them."""
    target, draft = clients
    info = dataclasses.replace(await target.info(), graphed_tokens_per_row=3)
    models = Models(AutoTokenizer.from_pretrained(tiny_target_dir), frozenset(), info)
    request = GenerationRequest(
        prompt_ids=(1, 2, 3, 4), max_new_tokens=40, num_speculative_tokens=8, adaptive=True
    )
    deltas = await run(request, models, target, draft)
    stats = deltas[-1].stats
    assert stats.draft_tokens > 0  # it drafted, and never past K = 2
    assert len(stats.rounds_by_k) <= 3 and stats.num_speculative_tokens == 2


async def test_a_session_whose_draft_would_not_pay_runs_target_only_outside_the_lockstep(
    clients, tiny_target_dir, monkeypatch
):
    """Two adaptive sessions whose draft shares the target's CPU cores: the
    prefill of one's draft pays, of the other's not, even beside the first's
    drafts. That one never opens a draft, leaves the plan once the other
    drafts, and its rounds never wait for the other's draft phases (one
    token a phase); both give the target's tokens."""
    target, draft = clients
    models = await drafting_models(clients, tiny_target_dir)
    assert models.draft_competes
    short, long = (1, 2, 3, 4), (5, 6, 7, 8, 9, 10)
    monkeypatch.setattr(
        CostModel, "draft_prefill_pays", lambda self, tokens, *_, **__: tokens < len(long)
    )
    # Every round would draft, but for the gate (the plan's K, from the
    # costs these workers happen to show, could be 0 in a first round).
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, limit: min(self.k_max, limit))
    costs, lockstep = CostModels(), Lockstep(max_wait_s=5.0)
    on_target = target.address  # (its sessions' replica)
    entered: list[int] = []
    draft_phase = lockstep.draft

    async def tracing(session, **kwargs):
        entered.append(len(session.request.prompt_ids))
        await draft_phase(session, **kwargs)

    lockstep.draft = tracing
    planned: list[int] = []  # the sessions in the plan, once the short prompt drafts
    short_drafts = asyncio.Event()

    async def one(prompt):
        request = GenerationRequest(
            prompt_ids=prompt, max_new_tokens=24, num_speculative_tokens=4, adaptive=True
        )
        deltas = []
        if prompt == long:
            await short_drafts.wait()
        async for delta in generate(request, models, target, draft, costs, lockstep=lockstep):
            deltas.append(delta)
            if prompt == short and len(deltas) == 2:  # (a drafting round's)
                short_drafts.set()
            if prompt == long and len(deltas) > 1:  # (it leaves once its first token is out)
                planned.append(len(costs.of(on_target).sessions))
        return deltas

    drafting, target_only = await asyncio.gather(one(short), one(long))
    for prompt, deltas in ((short, drafting), (long, target_only)):
        ids = [t for d in deltas for t in d.token_ids]
        assert ids == reference_greedy(tiny_target_dir, list(prompt), 24, eos=None)
    assert drafting[-1].stats.draft_tokens > 0
    assert target_only[-1].stats.draft_tokens == 0
    assert target_only[-1].stats.rounds == 24  # a token a round
    assert set(entered) == {len(short)}  # only the drafting session's rounds in the lockstep
    assert max(planned) <= 1  # a session that will not draft is planned no more
    assert not costs.of(on_target).sessions and not lockstep.active
    await target.engine.run(lambda: None)
    await draft.engine.run(lambda: None)
    assert len(target.sessions.store) == 0 and len(draft.sessions.store) == 0


@pytest.mark.parametrize("joins", [True, False])
async def test_on_shared_cores_a_draft_that_would_not_pay_is_asked_again_once_others_draft(
    clients, tiny_target_dir, monkeypatch, joins
):
    """Where the draft shares the target's cores, a session whose draft's
    prefill would not pay while no one drafts stays in the plan at K = 0
    and asks again each round. Once others draft (in the lockstep's phases)
    it cannot wait beside them: its draft opens where drafting pays at all
    (``others_draft``), and otherwise it drafts no more. Apart from the
    target (no lockstep), the first refusal is final."""
    target, draft = clients
    models = await drafting_models(clients, tiny_target_dir)
    asked: list[bool] = []

    def gate(self, tokens, tokens_left, *, beside=False, others_draft=False):
        asked.append(others_draft)
        return others_draft and joins

    monkeypatch.setattr(CostModel, "draft_prefill_pays", gate)
    k_chosen = [3]
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, limit: k_chosen[0])
    request = GenerationRequest(
        prompt_ids=(1, 2, 3), max_new_tokens=24, num_speculative_tokens=4, adaptive=True
    )

    def generation(lockstep):
        return Generation(request, models, target, draft, CostModels(), Recovery(), lockstep)

    apart = generation(None)
    assert apart.choose_k(4) == 0 and apart.policy is None and apart.drafts is None
    asked.clear()

    lockstep = Lockstep(max_wait_s=5.0)
    waits = generation(lockstep)
    assert waits.choose_k(4) == 0 and asked == [False]
    assert waits.policy is not None and waits.lockstep is lockstep and waits.drafts is not None
    await lockstep.draft(object())  # another session drafts
    assert waits.choose_k(5) == (3 if joins else 0) and asked == [False, True]
    assert (waits.policy is not None) == joins and (waits.drafts is not None) == joins

    # Beside drafting sessions, a round the plan gives no drafts leaves too.
    k_chosen[0] = 0
    idle = generation(lockstep)
    assert idle.choose_k(4) == 0 and idle.policy is None and idle.lockstep is None
    assert len(asked) == 2  # (a round of no drafts has no prefill to price)


async def test_on_shared_cores_beside_others_a_draft_opens_only_to_join_drafting_sessions(
    clients, tiny_target_dir, monkeypatch
):
    """Where the draft shares the target's cores, sessions beside each other
    none of which drafts open no draft and plan nothing: K = 0's points are
    measured at every step, drafting's only while some session drafts, so
    a plan would weigh the machine now against the machine then. Once one
    drafts they are asked to join it; a session alone is asked at once."""
    target, draft = clients
    models = await drafting_models(clients, tiny_target_dir)
    asked: list[bool] = []
    chosen: list[int] = []

    def gate(self, tokens, tokens_left, *, beside=False, others_draft=False):
        asked.append(others_draft)
        return True

    monkeypatch.setattr(CostModel, "draft_prefill_pays", gate)
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, limit: chosen.append(id(self)) or 3)
    request = GenerationRequest(
        prompt_ids=(1, 2, 3), max_new_tokens=24, num_speculative_tokens=4, adaptive=True
    )
    costs, lockstep = CostModels(), Lockstep(max_wait_s=5.0)
    first, second = (
        Generation(request, models, target, draft, costs, Recovery(), lockstep) for _ in range(2)
    )
    assert [first.choose_k(4), second.choose_k(4)] == [0, 0]
    assert not asked and not chosen and not first.drafts.begun
    assert first.policy is not None and first.lockstep is lockstep  # (they wait in the plan)
    await lockstep.draft(object())  # another session drafts
    assert [first.choose_k(5), second.choose_k(5)] == [3, 3] and asked == [True, True]
    first.target_only()
    second.target_only()

    alone = Generation(request, models, target, draft, costs, Recovery(), Lockstep(5.0))
    assert alone.costs.alone and alone.choose_k(4) == 3 and asked[-1] is False
    alone.target_only()


class TwoReplicas:
    """The in-process target as two replicas, ``a`` and ``b``: each open goes
    to the other, and a session on ``a`` is lost at its third verify."""

    def __init__(self, target: InProcessTargetClient) -> None:
        self.target = target
        self.opens = 0

    async def info(self, timeout_s: float = 10.0):
        return await self.target.info(timeout_s)

    async def open(self, tokens, **kwargs):
        session, reply = await self.target.open(tokens, **kwargs)
        session.address = "ab"[self.opens % 2]
        self.opens += 1
        if session.address == "a":
            verify, verifies = session.verify, [0]

            async def failing_verify(*args, **kwargs):
                verifies[0] += 1
                if verifies[0] == 3:
                    raise Unavailable("replica a is gone")
                return await verify(*args, **kwargs)

            session.verify = failing_verify
        return session, reply


async def test_a_session_is_planned_with_the_sessions_on_its_target_replica(
    clients, tiny_target_dir, monkeypatch
):
    """Sessions share steps only with those on their target replica: a
    session's K is planned in that replica's cost model, and one reopened on
    another replica moves to its model. What the drafts had accepted is the
    models', shared by every replica's."""
    target, draft = clients
    models = await drafting_models(clients, tiny_target_dir)
    costs = CostModels()
    planned_on: list[CostModel] = []
    choose = AdaptiveK.choose

    def recording(self, limit):
        planned_on.append(self.costs)
        assert self.key in self.costs.sessions
        return choose(self, limit)

    monkeypatch.setattr(AdaptiveK, "choose", recording)
    request = GenerationRequest(
        prompt_ids=(1, 2, 3), max_new_tokens=16, num_speculative_tokens=3, adaptive=True
    )
    deltas = [d async for d in generate(request, models, TwoReplicas(target), draft, costs)]
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == reference_greedy(tiny_target_dir, [1, 2, 3], 16, eos=None)
    on_a, on_b = costs.of("a"), costs.of("b")
    assert on_a is not on_b and on_a.acceptance is on_b.acceptance is costs.acceptance
    after_open = [c for c in planned_on if c is not costs.of("")]
    assert after_open[0] is on_a and after_open[-1] is on_b
    assert after_open == sorted(after_open, key=lambda c: c is on_b)  # a, then b for good
    assert on_a.target.steps and on_b.target.steps  # each taught by its replica's answers
    assert not on_a.sessions and not on_b.sessions
