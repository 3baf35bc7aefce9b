"""Prompt lookup in the coordinator: its matches, the plan of K on what
each session's match offers, and the round loop drafting by it."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from outrider.config import EngineConfig, ServiceConfig, TargetWorkerConfig
from outrider.coordinator.adaptive.acceptance import DEPLOYMENT_DECAY, Acceptance, Depths
from outrider.coordinator.adaptive.cost_model import CostModel
from outrider.coordinator.adaptive.session import AdaptiveK
from outrider.coordinator.requests import GenerationRequest
from outrider.coordinator.round_loop import generate
from outrider.coordinator.served_models import Models
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.drafters.lookup import Match, PromptLookup
from outrider.engine_load import EngineLoad
from outrider.target_worker.main import build_sessions as build_target_sessions
from outrider.worker import start_engine
from tests.inprocess import InProcessTargetClient
from tests.integration.harness import reference_greedy


@pytest.mark.parametrize(
    "history, k, max_ngram, match",
    [
        ([1, 2, 3, 4, 5, 9, 2, 3], 2, 3, Match(2, [4, 5])),
        ([1, 2, 3, 9, 1, 2, 3], 2, 3, Match(3, [9, 1])),
        ([4, 9, 7, 4], 3, 3, Match(1, [9, 7, 4])),
        # "2 3" matches at 1, "3" alone later at 6: the longer match decides.
        ([1, 2, 3, 4, 0, 0, 3, 7, 2, 3], 1, 2, Match(2, [4])),
        ([5, 6, 1, 5, 6, 2, 5, 6], 1, 2, Match(2, [2])),  # the latest of equal matches
        ([1, 2, 3, 1, 2], 5, 3, Match(2, [3, 1, 2])),  # no more than the history holds
        ([1, 2, 3, 4], 3, 3, Match(0, [])),  # no match
        ([7], 3, 3, Match(0, [])),
    ],
)
def test_a_match_is_what_followed_the_latest_occurrence_of_the_last_ngram(
    history, k, max_ngram, match
):
    assert PromptLookup(max_ngram=max_ngram).index().match(history, k) == match


def latest_match(history: list[int], k: int, max_ngram: int) -> Match:
    """The definition, by scanning: the longest n first, its latest earlier occurrence."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        starts = [s for s in range(len(history) - n) if history[s : s + n] == history[-n:]]
        if starts:
            return Match(n, history[starts[-1] + n : starts[-1] + n + k])
    return Match(0, [])


@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    steps=st.lists(st.integers(1, 5), max_size=10),
    max_ngram=st.integers(1, 4),
)
def test_a_session_s_index_matches_as_a_scan_of_its_whole_history_would(tokens, steps, max_ngram):
    index = PromptLookup(max_ngram=max_ngram).index()
    end = 0
    for step in [*steps, len(tokens)]:  # the history grows by a round's tokens at a time
        end = min(end + step, len(tokens))
        history = tokens[:end]
        assert index.match(history, 3) == latest_match(history, 3, max_ngram)


def test_an_index_refuses_a_history_that_shrank():
    index = PromptLookup().index()
    index.match([1, 2, 3], 2)
    with pytest.raises(ValueError):
        index.match([1, 2], 2)


def test_invalid_ngram_bounds_are_refused():
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=1, min_ngram=2)


def cpu_like(rows: int) -> CostModel:
    """A target whose step costs 20 ms and 2 ms a token, ``rows`` rows at a token each."""
    counts = [float(1 << i) for i in range(11)]
    costs = CostModel(decay=0.0, planning_share=math.inf)
    costs.target = EngineLoad(tuple((1.0, t, 0.02 + 0.002 * t) for t in counts), rows, rows, 1)
    costs.draft_per_token.update(0.0)  # (a lookup: microseconds, in the coordinator)
    return costs


def test_the_plan_drafts_on_strong_matches_and_not_on_weak_ones_or_none():
    costs = cpu_like(rows=4)
    for _ in range(200):  # what the deployment's drafts on each n have made
        for drafts, accepted, n in ((4, 4, 3), (1, 0, 1)):
            costs.observe(
                num_drafts=drafts,
                num_accepted=accepted,
                evidence=n,
                draft_s=0.0,
                overhead_s=0.0,
                drafted=False,
            )
    sessions = [AdaptiveK(8, costs) for _ in range(4)]
    for policy in sessions:
        policy.k_last = 0
    offers = [(3, 8), (1, 8), (0, 0), (3, 2)]
    for policy, (n, tokens) in zip(sessions, offers, strict=True):
        policy.offer(n, tokens)
    assert [policy.choose(limit=100) for policy in sessions] == [8, 0, 0, 2]
    # A new offer is planned at once: the weak match became a strong one.
    sessions[1].offer(3, 5)
    assert sessions[1].choose(limit=100) == 5


def test_a_session_drafting_on_recorded_evidence_does_not_probe():
    # Under load a weak match does not pay. Where the deployment's drafts on
    # it have a record, a probe would teach nothing that record does not: the
    # session stays at K = 0. On evidence nothing was drafted on yet, it looks.
    costs = cpu_like(rows=4)
    for _ in range(20):
        costs.observe(
            num_drafts=1, num_accepted=0, evidence=1, draft_s=0.0, overhead_s=0.0, drafted=False
        )
    recorded, unrecorded = AdaptiveK(8, costs), AdaptiveK(8, costs)
    recorded.offer(1, 8)
    unrecorded.offer(2, 8)
    for policy in (recorded, unrecorded):
        policy.k_last = 0
    choices = [(recorded.choose(limit=100), unrecorded.choose(limit=100)) for _ in range(64)]
    assert {r for r, _ in choices} == {0}
    assert [i for i, (_, u) in enumerate(choices) if u] == [7, 15, 23, 31, 39, 47, 55, 63]


def test_drafts_on_evidence_are_judged_depth_by_depth():
    """A draft at depth j is judged where every one before it was accepted:
    a round of 4 drafts that accepted 2 judged the first three."""
    depths = Depths()
    depths.observe(num_drafts=4, num_accepted=2)
    assert depths.judged == [1.0, 1.0, 1.0, 0.0] and depths.accepted == [1.0, 1.0, 0.0, 0.0]
    depths.observe(num_drafts=2, num_accepted=2)
    decay = DEPLOYMENT_DECAY
    assert depths.judged == [decay + 1, decay + 1, decay, 0.0]
    assert depths.accepted == [decay + 1, decay + 1, 0.0, 0.0]


def test_drafts_that_come_in_runs_are_priced_by_depth_not_by_a_per_token_rate():
    """Of drafts copied from the history, the first is often rejected and
    the later ones almost never once it was not: here 7 rounds in 10 reject
    the first of 4, and 3 accept all. S(j) stays near 0.3 to the fourth,
    and beyond it the last depth's acceptance carries on; a per-token rate
    (0.63) prices the first at twice that and the fourth at half."""
    acceptance = Acceptance()
    for i in range(400):
        acceptance.observe(num_drafts=4, num_accepted=4 if i % 10 < 3 else 0, evidence=2)
    survival = acceptance.survival_of(2, 6, prior_weight=8.0)
    alpha = acceptance.accepted_on_evidence / acceptance.judged_on_evidence
    assert alpha == pytest.approx(12 / 19, abs=0.02) and acceptance.alpha is None
    assert survival[0] == pytest.approx(0.3, abs=0.03) and alpha > 1.9 * survival[0]
    assert survival[-1] > 0.8 * survival[0] and alpha**4 < 0.6 * survival[3]
    assert np.all(np.diff(survival) <= 0)
    # Nothing drafted on it yet: the deployment's per-token rate, depth by depth.
    assert acceptance.survival_of(1, 2, prior_weight=8.0) == pytest.approx([alpha, alpha**2])
    assert acceptance.judged_on(2) > 90 and acceptance.judged_on(1) == 0


def test_the_plan_of_a_session_drafting_runs_follows_its_depths():
    """A session alone whose match's drafts come in runs (every other round
    accepts all 8, the others none): each K's goodput is
    (1 + Σ S(j)) / c(K + 1), and the plan drafts all 8 — the best of them
    — where a per-token rate (0.89) would stop at 5."""
    costs = CostModel(decay=0.0, planning_share=math.inf)
    counts = [float(1 << i) for i in range(11)]
    costs.target = EngineLoad(tuple((1.0, t, 0.02 + 0.008 * t) for t in counts), 1.0, 1.0, 1)
    for i in range(400):
        costs.observe(
            num_drafts=8,
            num_accepted=8 if i % 2 else 0,
            evidence=2,
            draft_s=0.0,
            overhead_s=0.0,
            drafted=False,
        )
    policy = AdaptiveK(8, costs)
    policy.k_last = 0
    policy.offer(2, 8)

    def best(gains):
        step = costs.target.step_costs(np.arange(1.0, 10.0), 1.0)
        return int(np.argmax([(1 + gains[:k].sum()) / step[k] for k in range(9)]))

    acceptance = costs.acceptance
    alpha = acceptance.accepted_on_evidence / acceptance.judged_on_evidence
    assert best(alpha ** np.arange(1, 9)) == 5
    assert best(policy.gains(8)) == 8 and policy.choose(limit=100) == 8


@pytest.fixture
async def target(tiny_target_dir):
    engine = EngineConfig(dtype="float64", threads=1)
    sessions = build_target_sessions(
        TargetWorkerConfig(ServiceConfig(), model=str(tiny_target_dir), engine=engine)
    )
    target_engine = start_engine(sessions, engine, max_rows=8)
    yield InProcessTargetClient(sessions, target_engine)
    target_engine.shutdown()


@pytest.mark.parametrize("adaptive", [False, True])
async def test_the_loop_drafting_by_prompt_lookup_gives_the_target_s_tokens(
    target, tiny_target_dir, adaptive
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    prompt = tokenizer("a b c a b c a b c a b")["input_ids"]
    lookup = PromptLookup()
    models = Models(tokenizer, frozenset(), await target.info(), WorkerInfo.of_lookup(lookup.name))
    request = GenerationRequest(
        prompt_ids=tuple(prompt),
        max_new_tokens=24,
        num_speculative_tokens=3,
        adaptive=adaptive,
        pipeline=True,  # (a lookup has nothing to overlap: its rounds are synchronous)
    )
    deltas = [delta async for delta in generate(request, models, target, lookup)]
    assert [t for d in deltas for t in d.token_ids] == reference_greedy(
        tiny_target_dir, prompt, 24, eos=None
    )
    stats = deltas[-1].stats
    assert stats.draft_tokens > 0 and not stats.pipeline
    await target.engine.run(lambda: None)  # (once a later call ran, the close has)
    assert len(target.sessions.store) == 0


def test_drafts_looked_up_beside_a_draft_model_cost_no_draft_step():
    """Suffix decoding beside a draft model whose step costs more than a
    target step: the plan gives the session drafting the model's drafts
    (α 0.5) K = 0 and the one drafting a strong lookup offer all of it —
    its drafts take no row in the draft's steps."""
    costs = cpu_like(rows=2)
    costs.draft_per_token.update(0.05)
    for _ in range(200):
        for evidence in (None, 3):
            accepted = 4 if evidence else 1
            costs.observe(
                num_drafts=4,
                num_accepted=accepted,
                evidence=evidence,
                draft_s=0.2 if evidence is None else 0.0,
                draft_steps=None if evidence is None else 0,
                overhead_s=0.0,
                drafted=evidence is None,
            )
    modelled, looked_up = AdaptiveK(8, costs), AdaptiveK(8, costs)
    for policy in (modelled, looked_up):
        policy.k_last = 0
    modelled.offer(None, None)
    looked_up.offer(3, 6)
    assert (modelled.choose(limit=100), looked_up.choose(limit=100)) == (0, 6)
    assert costs.acceptance.alpha == pytest.approx(0.5, abs=0.01)  # the model's rounds alone
    assert modelled.bid().looked_up is False and looked_up.bid().looked_up is True


def test_a_session_alone_rates_free_drafts_above_the_same_drafts_from_a_model():
    """The rate that chooses a round's drafter beside a draft model: the
    same gains make more tokens a second looked up than drafted a step
    each, and drafts that add nothing leave the rate of K = 0."""
    costs = cpu_like(rows=1)
    costs.draft_per_token.update(0.01)
    gains = 0.8 ** np.arange(1.0, 7.0)
    step = costs.target.step_costs(np.arange(1.0, 8.0), 1.0)
    looked_up = costs.best_rate_alone(gains, drafted=False)
    drafted = costs.best_rate_alone(gains, drafted=True)
    assert looked_up == pytest.approx(max((1 + gains[:k].sum()) / step[k] for k in range(7)))
    assert drafted == pytest.approx(
        max((1 + gains[:k].sum()) / (step[k] + 0.01 * k) for k in range(7))
    )
    assert looked_up > drafted > 1 / step[0]
    assert costs.best_rate_alone(np.zeros(4), drafted=False) == pytest.approx(1 / step[0])
    unmeasured = CostModel()
    assert unmeasured.best_rate_alone(gains[:2], drafted=True) == pytest.approx(1 + 0.8 + 0.64)
