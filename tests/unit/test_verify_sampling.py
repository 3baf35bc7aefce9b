"""Rejection and Gumbel verification on hand-made p and q, where the answer
is known exactly: acceptance probabilities, recovered distributions, and
that the committed tokens are distributed exactly as target-only sampling.

Statistical checks use many seeds (every seed is an independent draw,
since all randomness is keyed by (seed, stream, position)), a separate block
of seeds for each check so that no two share their random numbers, and
print their p-values; each asserts p > 0.01. The seeds are fixed, so the
checks are deterministic.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import outrider.target_worker.verify as verify_module
from outrider.sampling import (
    SamplingParams,
    Stream,
    Verification,
    draw,
    gumbel_draw,
    probabilities,
    sample,
    uniform,
)
from outrider.target_worker.verify import Verdict, verify, verify_gumbel, verify_rejection

START = 5  # the committed length: absolute position of the first draft token
TRIALS = 1200  # draws per one-position check
LOOP_TRIALS = 600  # decodes per whole-loop check


def seeds(block: int, n: int = TRIALS) -> range:
    """The seeds of one statistical check: block ``block`` of ``n`` seeds."""
    return range(block * 10_000, block * 10_000 + n)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny tensors: a thread pool only adds overhead (and contention on a busy machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rejection(seed: int = 0, **kwargs) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 1.0, **kwargs}, seed=seed, verification=Verification.REJECTION
    )


def gumbel(seed: int = 0, **kwargs) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 1.0, **kwargs}, seed=seed, verification=Verification.GUMBEL
    )


def rows(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def chi_square(name: str, counts: list[int], expected_probs) -> float:
    """Goodness of fit of observed counts to a distribution; prints and returns the p-value.

    Cells with zero probability must have zero counts and are left out of the test.
    """
    expected_probs = torch.as_tensor(expected_probs, dtype=torch.float64).flatten()
    counts = torch.tensor(counts)
    assert counts[expected_probs == 0].sum() == 0, (
        f"{name}: draws outside the support: {counts.tolist()}"
    )
    support = expected_probs > 0
    n = int(counts.sum())
    expected_counts = n * expected_probs[support] / expected_probs[support].sum()
    result = stats.chisquare(counts[support].numpy(), expected_counts.numpy())
    print(f"\n{name}: chi-square p = {result.pvalue:.3f} (n = {n}, counts {counts.tolist()})")
    return result.pvalue


def binomial(name: str, successes: int, n: int, prob: float) -> float:
    pvalue = stats.binomtest(successes, n, prob).pvalue
    print(
        f"\n{name}: {successes}/{n} = {successes / n:.4f} vs {prob:.4f}, binomial p = {pvalue:.3f}"
    )
    return pvalue


# ---------------------------------------------------------------------------
# Rejection sampling: one position, hand-made p and q


def test_acceptance_probability_is_p_over_q_and_recovered_is_the_residual():
    # p(1) / q(1) = 0.3 / 0.5 = 0.6; max(0, p - q) = [0.25, 0, 0] -> always token 0.
    p = rows([0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3])
    q = rows([0.25, 0.5, 0.25])
    verdicts = [verify_rejection([1], q, p, rejection(seed), START) for seed in seeds(1)]
    accepted = sum(v.num_accepted for v in verdicts)
    assert binomial("accept d=1, p=[.5,.3,.2], q=[.25,.5,.25]", accepted, TRIALS, 0.6) > 0.01
    assert {v.next_token for v in verdicts if v.num_accepted == 0} == {0}


def test_recovered_token_follows_the_normalised_residual():
    # p(2) / q(2) = 0.2 / 0.7 = 2/7; max(0, p - q) = [0.3, 0.2, 0] -> [0.6, 0.4, 0].
    p = rows([0.4, 0.4, 0.2], [1 / 3, 1 / 3, 1 / 3])
    q = rows([0.1, 0.2, 0.7])
    verdicts = [verify_rejection([2], q, p, rejection(seed), START) for seed in seeds(2)]
    accepted = sum(v.num_accepted for v in verdicts)
    assert binomial("accept d=2, p=[.4,.4,.2], q=[.1,.2,.7]", accepted, TRIALS, 2 / 7) > 0.01
    recovered = [v.next_token for v in verdicts if v.num_accepted == 0]
    counts = [recovered.count(t) for t in range(3)]
    assert chi_square("recovered ~ [0.6, 0.4, 0]", counts, [0.6, 0.4, 0.0]) > 0.01


def test_a_point_mass_draft_is_accepted_with_probability_p_of_its_token():
    # q = 1 on the draft token: accept with p(1) = 0.3; residual = [0.5, 0, 0.2] -> [5/7, 0, 2/7].
    p = rows([0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3])
    verdicts = [verify_rejection([1], None, p, rejection(seed), START) for seed in seeds(3)]
    accepted = sum(v.num_accepted for v in verdicts)
    assert binomial("point-mass draft d=1, p=[.5,.3,.2]", accepted, TRIALS, 0.3) > 0.01
    recovered = [v.next_token for v in verdicts if v.num_accepted == 0]
    counts = [recovered.count(t) for t in range(3)]
    assert chi_square("point-mass recovered ~ [5/7, 0, 2/7]", counts, [5 / 7, 0.0, 2 / 7]) > 0.01


def test_when_p_and_q_agree_the_draft_is_always_accepted():
    p = rows([0.5, 0.3, 0.2], [0.1, 0.1, 0.8])
    for seed in range(50):
        verdict = verify_rejection([2], p[:1], p, rejection(seed), START)
        assert verdict.num_accepted == 1
        assert verdict.next_token == sample(p[1], uniform(seed, Stream.TARGET, START + 1))


def test_an_empty_residual_falls_back_to_p():
    # p has lost mass to rounding (sums to 0.5) and lies below q everywhere.
    p = rows([0.25, 0.25, 0.0], [1.0, 0.0, 0.0])
    q = rows([0.5, 0.5, 0.0])
    rejected = 0
    for seed in range(50):
        verdict = verify_rejection([0], q, p, rejection(seed), START)
        if verdict.num_accepted == 0:
            rejected += 1
            assert verdict.next_token == sample(p[0], uniform(seed, Stream.TARGET, START))
    assert rejected > 0


def test_a_draft_token_the_draft_could_not_have_sampled_is_rejected_as_bad_input():
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_rejection(
            [2], rows([0.5, 0.5, 0.0]), rows([0.2, 0.3, 0.5], [1, 0, 0]), rejection(), START
        )


def test_the_randomness_is_keyed_by_seed_and_position():
    p = rows([0.4, 0.4, 0.2], [1 / 3, 1 / 3, 1 / 3])
    q = rows([0.1, 0.2, 0.7])
    first = [verify_rejection([2], q, p, rejection(seed), START) for seed in range(30)]
    assert first == [verify_rejection([2], q, p, rejection(seed), START) for seed in range(30)]
    assert first != [verify_rejection([2], q, p, rejection(seed), START + 1) for seed in range(30)]


# ---------------------------------------------------------------------------
# The whole speculative loop: committed tokens are distributed as p

# A hand-made Markov "language model" over 3 tokens: row = distribution of the
# next token given the previous one.
TARGET = rows([0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4])
GOOD_DRAFT = rows([0.45, 0.35, 0.2], [0.15, 0.5, 0.35], [0.3, 0.25, 0.45])
BAD_DRAFT = rows([0.05, 0.15, 0.8], [0.8, 0.1, 0.1], [0.1, 0.8, 0.1])


def speculative_decode(params: SamplingParams, k: int, draft_model, num_tokens: int) -> list[int]:
    """Rounds of draft-then-verify until ``num_tokens`` tokens are committed.

    ``draft_model`` is a row table like TARGET (sampled through ``draw``, so
    its q is quantized as it would be on the wire) or an int: a deterministic
    draft that always proposes that token (``draft_probs`` None).
    """
    tokens = [0]
    while len(tokens) <= num_tokens:
        position = len(tokens)
        # 1. draft K tokens
        draft_tokens, draft_probs = [], []
        for t in range(k):
            prev = draft_tokens[-1] if draft_tokens else tokens[-1]
            if isinstance(draft_model, int):
                draft_tokens.append(draft_model)
            else:
                token, q = draw(draft_model[prev].log(), params, position + t, Stream.DRAFT)
                draft_tokens.append(token)
                draft_probs.append(q)
        # 2. the target scores [x_n, d_1 .. d_K] in one pass
        target_logits = TARGET[[tokens[-1], *draft_tokens]].log()
        # 3. verify
        q = torch.stack(draft_probs) if draft_probs else None
        verdict = verify(draft_tokens, q, target_logits, params, position)
        # 4. commit the accepted tokens and the recovered or bonus token
        tokens += [*draft_tokens[: verdict.num_accepted], verdict.next_token]
    return tokens[1 : num_tokens + 1]


def target_joint() -> torch.Tensor:
    """P(x1, x2) of target-only sampling after token 0, flattened to 9 cells."""
    return (TARGET[0][:, None] * TARGET).flatten()


@pytest.mark.parametrize(
    ("block", "k", "draft_model", "name"),
    [
        (4, 1, GOOD_DRAFT, "good q"),
        (5, 1, BAD_DRAFT, "bad q"),
        (6, 2, GOOD_DRAFT, "good q"),
        (7, 2, BAD_DRAFT, "bad q"),
        (8, 2, 2, "point-mass draft"),
    ],
)
def test_speculative_sampling_is_distributed_as_target_only_sampling(block, k, draft_model, name):
    counts = [0] * 9
    for seed in seeds(block, LOOP_TRIALS):
        x1, x2 = speculative_decode(rejection(seed), k, draft_model, num_tokens=2)
        counts[3 * x1 + x2] += 1
    assert chi_square(f"rejection K={k}, {name}: (x1, x2) ~ p", counts, target_joint()) > 0.01


# ---------------------------------------------------------------------------
# Gumbel coupling

GUMBEL_LOGITS = rows(
    [0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.3, 0.6]
).log()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    draft_tokens=st.lists(st.integers(0, 3), min_size=0, max_size=3),
    num_right=st.integers(0, 3),
)
def test_gumbel_commits_a_prefix_of_the_target_only_draws_whatever_the_draft(
    seed, draft_tokens, num_right
):
    k = len(draft_tokens)
    params = gumbel(seed)
    target_only = [gumbel_draw(GUMBEL_LOGITS[t], params, START + t) for t in range(k + 1)]
    # Let some drafts be right, so that acceptance is exercised too.
    num_right = min(num_right, k)
    draft_tokens = target_only[:num_right] + draft_tokens[num_right:]
    verdict = verify_gumbel(draft_tokens, GUMBEL_LOGITS[: k + 1], params, START)
    committed = [*draft_tokens[: verdict.num_accepted], verdict.next_token]
    assert committed == target_only[: verdict.num_accepted + 1]
    # Accepted exactly while the draft matched the target's draws.
    expected_accepted = next((t for t in range(k) if draft_tokens[t] != target_only[t]), k)
    assert verdict.num_accepted == expected_accepted


def test_gumbel_draws_are_distributed_as_p():
    p = [0.1, 0.4, 0.2, 0.3]
    draws = [gumbel_draw(GUMBEL_LOGITS[0], gumbel(seed), START) for seed in seeds(9)]
    assert (
        chi_square("gumbel draw ~ [.1, .4, .2, .3]", [draws.count(t) for t in range(4)], p) > 0.01
    )


def test_gumbel_draws_follow_the_processed_p():
    params = dict(temperature=0.5, top_k=3)
    expected = probabilities(GUMBEL_LOGITS[0], gumbel(**params))  # [0, 16, 4, 9] / 29
    draws = [gumbel_draw(GUMBEL_LOGITS[0], gumbel(seed, **params), START) for seed in seeds(10)]
    counts = [draws.count(t) for t in range(4)]
    assert chi_square("gumbel draw, T=0.5, top-k=3 ~ [0, 16, 4, 9]/29", counts, expected) > 0.01


# ---------------------------------------------------------------------------
# One entry point


TARGET_ROW = torch.tensor([0.3, 1.2, -0.4, 0.9, 0.0])


@pytest.mark.parametrize("make_params", [rejection, gumbel], ids=["rejection", "gumbel"])
def test_no_drafts_is_target_only_decoding(make_params):
    for seed, position in itertools.product(range(20), (0, 7, 1000)):
        params = make_params(seed, top_p=0.95)
        token, _ = draw(TARGET_ROW, params, position, Stream.TARGET)
        verdict = verify([], None, TARGET_ROW[None], params, position)
        assert verdict == Verdict(num_accepted=0, next_token=token)


def test_no_drafts_with_greedy_params_is_the_argmax():
    params = SamplingParams(temperature=0.0, verification=Verification.REJECTION, seed=3)
    assert draw(TARGET_ROW, params, 0, Stream.TARGET) == (1, None)
    assert verify([], None, TARGET_ROW[None], params, 0) == Verdict(num_accepted=0, next_token=1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, verification=Verification.REJECTION),
        SamplingParams(temperature=0.0, verification=Verification.GUMBEL),
        SamplingParams(temperature=0.8, verification=Verification.GREEDY),
    ],
)
def test_greedy_params_dispatch_to_verify_greedy(params, monkeypatch):
    calls = []
    real = verify_module.verify_greedy

    def spy(draft_tokens, target_logits):
        calls.append(list(draft_tokens))
        return real(draft_tokens, target_logits)

    monkeypatch.setattr(verify_module, "verify_greedy", spy)
    logits = torch.zeros(3, 4)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = 5.0
    assert verify([2, 0], None, logits, params, START) == Verdict(num_accepted=1, next_token=3)
    assert calls == [[2, 0]]


def test_rejection_through_verify_processes_the_target_logits():
    # top-k=1 leaves p a point mass on token 1: a draft of 1 is always accepted, 0 always rejected.
    logits = torch.tensor([[0.0, 1.0, -1.0], [2.0, 0.0, 0.0]])
    q = rows([0.5, 0.5, 0.0])
    for seed in range(20):
        params = rejection(seed, top_k=1)
        assert verify([1], q, logits, params, START) == Verdict(1, 0)
        assert verify([0], q, logits, params, START) == Verdict(0, 1)


@pytest.mark.parametrize(
    ("draft_tokens", "draft_probs", "logits_shape", "start", "message"),
    [
        ([1, 2], None, (2, 4), 0, r"\[K \+ 1, vocab\]"),
        ([1, 4], None, (3, 4), 0, r"draft tokens must be in \[0, 4\)"),
        ([1, 2], torch.full((1, 4), 0.25), (3, 4), 0, r"draft_probs must have shape .* = \[2, 4\]"),
        ([1, 2], torch.full((2, 5), 0.2), (3, 4), 0, r"draft_probs must have shape"),
        ([1, 2], None, (3, 4), -1, "start_position"),
    ],
)
def test_malformed_rounds_are_rejected(draft_tokens, draft_probs, logits_shape, start, message):
    with pytest.raises(ValueError, match=message):
        verify(draft_tokens, draft_probs, torch.zeros(logits_shape), rejection(), start)
