"""Logits processing, counter-based randomness and the wire form of q, on
hand-made inputs where the answer is known exactly."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from outrider.sampling import (
    CompactProbs,
    SamplingParams,
    Stream,
    Verification,
    compact,
    draw,
    expand,
    gumbel_draw,
    gumbel_noise,
    probabilities,
    quantize,
    sample,
    uniform,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny tensors: a thread pool only adds overhead (and contention on a busy machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "verification": Verification.REJECTION, **kwargs})


def logits_of(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def assert_probs(actual: torch.Tensor, expected) -> None:
    expected = torch.tensor(expected, dtype=torch.float64)
    assert torch.equal(actual == 0, expected == 0), f"support {actual} != {expected}"
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -0.5, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("top_k", -1, ">= 0"),
        ("top_k", 2.5, ">= 0"),
        ("top_p", 0.0, r"\(0, 1\]"),
        ("top_p", 1.5, r"\(0, 1\]"),
        ("min_p", -0.1, r"\[0, 1\]"),
        ("min_p", 1.1, r"\[0, 1\]"),
        ("seed", -1, r"2\*\*64 - 1"),
        ("seed", 2**64, r"2\*\*64 - 1"),
        ("verification", "beam", "greedy, rejection, gumbel"),
    ],
)
def test_invalid_params_name_the_field_and_the_allowed_range(field, value, allowed):
    with pytest.raises(ValueError, match=rf"{field} must .*{allowed}"):
        SamplingParams(**{field: value})


def test_verification_may_be_given_by_name():
    assert SamplingParams(verification="gumbel").verification is Verification.GUMBEL


@pytest.mark.parametrize(
    ("temperature", "verification", "greedy"),
    [
        (0.0, Verification.REJECTION, True),
        (0.0, Verification.GUMBEL, True),
        (0.7, Verification.GREEDY, True),
        (0.7, Verification.REJECTION, False),
        (0.7, Verification.GUMBEL, False),
    ],
)
def test_temperature_zero_or_greedy_verification_is_greedy(temperature, verification, greedy):
    assert SamplingParams(temperature=temperature, verification=verification).is_greedy is greedy


# ---------------------------------------------------------------------------
# probabilities()


def test_temperature_one_is_the_plain_softmax():
    assert_probs(probabilities(logits_of(1, 2, 4), sampled()), [1 / 7, 2 / 7, 4 / 7])


def test_temperature_divides_the_logits():
    # softmax(log[1, 2, 4] / 2) = [1, sqrt 2, 2] / (3 + sqrt 2)
    total = 3 + math.sqrt(2)
    expected = [1 / total, math.sqrt(2) / total, 2 / total]
    assert_probs(probabilities(logits_of(1, 2, 4), sampled(temperature=2.0)), expected)


def test_temperature_zero_is_a_point_mass_on_the_first_argmax():
    assert_probs(probabilities(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams()), [0, 1, 0, 0])


def test_top_k_keeps_the_k_most_likely_and_renormalises():
    assert_probs(
        probabilities(logits_of(0.1, 0.4, 0.2, 0.3), sampled(top_k=2)), [0, 4 / 7, 0, 3 / 7]
    )


def test_top_k_keeps_every_token_tied_at_the_boundary():
    assert_probs(
        probabilities(torch.tensor([0.0, 1.0, 1.0, -1.0]), sampled(top_k=1)), [0, 0.5, 0.5, 0]
    )


def test_top_k_at_least_the_vocabulary_is_off():
    assert_probs(probabilities(logits_of(0.1, 0.4, 0.5), sampled(top_k=3)), [0.1, 0.4, 0.5])
    assert_probs(probabilities(logits_of(0.1, 0.4, 0.5), sampled(top_k=10)), [0.1, 0.4, 0.5])


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # sorted: 0.4, 0.3, 0.2, 0.1; mass before each: 0, 0.4, 0.7, 0.9
        (0.3, [0, 1, 0, 0]),  # the top token alone already reaches 0.3
        (0.6, [0, 4 / 7, 0, 3 / 7]),  # 0.4 + 0.3 >= 0.6
        (0.75, [0, 4 / 9, 2 / 9, 3 / 9]),  # 0.4 + 0.3 + 0.2 >= 0.75
        (0.95, [0.1, 0.4, 0.2, 0.3]),  # everything
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    assert_probs(probabilities(logits_of(0.1, 0.4, 0.2, 0.3), sampled(top_p=top_p)), expected)


def test_top_p_applies_to_what_top_k_left():
    # After top-k=3 the kept mass is [0.4, 0.3, 0.2] / 0.9 = [0.444, 0.333, 0.222]:
    # 0.444 + 0.333 already reaches 0.75, so token 2 goes too (without top-k it would stay).
    probs = probabilities(logits_of(0.1, 0.4, 0.2, 0.3), sampled(top_k=3, top_p=0.75))
    assert_probs(probs, [0, 4 / 7, 0, 3 / 7])


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    # 0.6 * 0.4 = 0.24: 0.2 and 0.1 go.
    assert_probs(
        probabilities(logits_of(0.1, 0.4, 0.2, 0.3), sampled(min_p=0.6)), [0, 4 / 7, 0, 3 / 7]
    )


def test_min_p_one_keeps_only_the_most_likely():
    assert_probs(probabilities(logits_of(0.1, 0.4, 0.2, 0.3), sampled(min_p=1.0)), [0, 1, 0, 0])


def test_all_filters_together():
    # temperature 0.5 squares the probabilities: [1, 16, 4, 9] / 30;
    # top-k 3 leaves [0, 16, 4, 9] / 29; top-p 0.9 keeps all three (the mass
    # before 4 is 25/29 = 0.86 < 0.9); min-p 0.2 (threshold 3.2/29) keeps 4.
    params = sampled(temperature=0.5, top_k=3, top_p=0.9, min_p=0.2)
    assert_probs(probabilities(logits_of(0.1, 0.4, 0.2, 0.3), params), [0, 16 / 29, 4 / 29, 9 / 29])
    # min-p 0.3 (threshold 4.8) drops it.
    params = sampled(temperature=0.5, top_k=3, top_p=0.9, min_p=0.3)
    assert_probs(probabilities(logits_of(0.1, 0.4, 0.2, 0.3), params), [0, 16 / 25, 0, 9 / 25])


def test_rows_are_processed_independently_and_as_single_rows():
    rows = torch.stack(
        [
            logits_of(0.1, 0.4, 0.2, 0.3),
            logits_of(0.25, 0.25, 0.4, 0.1),
            logits_of(0.7, 0.1, 0.1, 0.1),
        ]
    )
    params = sampled(temperature=0.8, top_k=3, top_p=0.8, min_p=0.1)
    batched = probabilities(rows, params)
    assert batched.dtype == torch.float64 and batched.shape == rows.shape
    for row, expected in zip(rows, batched, strict=True):
        assert torch.equal(probabilities(row, params), expected)


def test_masked_logits_stay_outside_the_support():
    logits = torch.tensor([0.0, -math.inf, 1.0, -math.inf])
    probs = probabilities(logits, sampled(top_p=0.99))
    assert probs[1] == 0 and probs[3] == 0
    assert math.isclose(float(probs.sum()), 1.0)


# ---------------------------------------------------------------------------
# Counter-based randomness

M0, M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
W0, W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B
MASK = 2**64 - 1


def philox4x64_10(counter, key):
    """Reference Philox4x64-10 (Random123), written from the paper."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & MASK, (p0 >> 64) ^ c3 ^ k1, p0 & MASK
    return [c0, c1, c2, c3]


def reference_uniforms(seed, stream, position, count):
    """The construction in outrider.sampling's docstring, independently."""
    words = []
    block = 1
    while len(words) < count:
        words += philox4x64_10([block, position, 0, 0], [seed, int(stream)])
        block += 1
    return [((x >> 12) + 0.5) / 2**52 for x in words[:count]]


@pytest.mark.parametrize(
    ("seed", "stream", "position"),
    [(0, Stream.ACCEPT, 0), (12345, Stream.DRAFT, 17), (2**64 - 1, Stream.TARGET, 2**40)],
)
def test_uniform_follows_the_documented_construction(seed, stream, position):
    assert uniform(seed, stream, position) == reference_uniforms(seed, stream, position, 1)[0]


def test_gumbel_noise_follows_the_documented_construction():
    u = reference_uniforms(99, Stream.GUMBEL, 5, 10)
    expected = torch.tensor([-math.log(-math.log(x)) for x in u], dtype=torch.float64)
    torch.testing.assert_close(gumbel_noise(99, 5, 10), expected, rtol=0, atol=1e-14)


def test_uniform_is_deterministic_and_differs_across_seeds_positions_and_streams():
    assert uniform(7, Stream.ACCEPT, 3) == uniform(7, Stream.ACCEPT, 3)
    values = {
        uniform(seed, stream, position)
        for seed in (0, 1)
        for stream in Stream
        for position in range(3)
    }
    assert len(values) == 2 * len(Stream) * 3


def test_uniforms_across_positions_are_uniform():
    u = [uniform(3, Stream.ACCEPT, position) for position in range(1000)]
    assert all(0 < x < 1 for x in u)
    result = stats.kstest(u, "uniform")
    print(f"\nKS uniform over positions: p = {result.pvalue:.3f}")
    assert result.pvalue > 0.01


def test_gumbel_noise_is_deterministic_and_differs_across_seeds_and_positions():
    a = gumbel_noise(1, 4, 50)
    assert torch.equal(a, gumbel_noise(1, 4, 50))
    assert not torch.equal(a, gumbel_noise(2, 4, 50))
    assert not torch.equal(a, gumbel_noise(1, 5, 50))


def test_gumbel_noise_for_a_larger_vocabulary_extends_it():
    assert torch.equal(gumbel_noise(1, 4, 100)[:30], gumbel_noise(1, 4, 30))


def test_gumbel_noise_is_standard_gumbel():
    g = gumbel_noise(11, 0, 5000).numpy()
    result = stats.kstest(g, "gumbel_r")
    print(f"\nKS standard Gumbel: p = {result.pvalue:.3f}")
    assert result.pvalue > 0.01


@pytest.mark.parametrize(("seed", "position"), [(-1, 0), (2**64, 0), (0, -1)])
def test_out_of_range_seed_or_position_is_rejected(seed, position):
    with pytest.raises(ValueError):
        uniform(seed, Stream.ACCEPT, position)


# ---------------------------------------------------------------------------
# sample()


@pytest.mark.parametrize(
    ("u", "token"),
    [(0.1, 0), (0.2499, 0), (0.25, 2), (0.5, 2), (0.7499, 2), (0.75, 3), (0.9999, 3)],
)
def test_sample_is_the_inverse_cdf_and_skips_tokens_without_mass(u, token):
    # cdf = [0.25, 0.25, 0.75, 1.0]: token 1 has no mass and is never drawn.
    probs = torch.tensor([0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    assert sample(probs, u) == token
    assert sample(probs * 4, u) == token  # need not be normalised


def test_sample_never_returns_a_trailing_token_without_mass():
    probs = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    assert sample(probs, 1 - 2**-53) == 1
    assert sample(torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]), 1 - 2**-53) == 2


@pytest.mark.parametrize("u", [0.0, 1.0, -0.1])
def test_sample_needs_u_inside_the_unit_interval(u):
    with pytest.raises(ValueError, match="u must be in"):
        sample(torch.tensor([0.5, 0.5]), u)


def test_sample_needs_some_mass():
    with pytest.raises(ValueError, match="positive total mass"):
        sample(torch.zeros(3), 0.5)


# ---------------------------------------------------------------------------
# compact() / expand() / quantize()


def sparse_row(vocab: int, support: dict[int, float]) -> torch.Tensor:
    row = torch.zeros(vocab, dtype=torch.float64)
    for token, prob in support.items():
        row[token] = prob
    return row / row.sum()


def test_a_row_with_at_most_a_quarter_of_the_vocabulary_goes_sparse():
    row = sparse_row(16, {1: 0.1, 5: 0.4, 6: 0.2, 15: 0.3})
    c = compact(row)
    assert c.token_ids is not None
    assert np.frombuffer(c.token_ids, dtype="<i4").tolist() == [1, 5, 6, 15]
    assert np.frombuffer(c.probs, dtype="<f2").tolist() == pytest.approx([0.25, 1.0, 0.5, 0.75])
    assert (len(c.token_ids), len(c.probs), c.nbytes) == (16, 8, 24)
    back = expand(c, 16)
    assert torch.equal(back == 0, row == 0)
    torch.testing.assert_close(back, row, rtol=1e-3, atol=0)


def test_a_wider_row_goes_dense_float16():
    row = sparse_row(16, {0: 0.1, 1: 0.1, 5: 0.4, 6: 0.2, 15: 0.2})
    c = compact(row)
    assert c.token_ids is None
    assert (len(c.probs), c.nbytes) == (32, 32)
    torch.testing.assert_close(expand(c, 16), row, rtol=1e-3, atol=0)


def test_a_full_vocabulary_row_round_trips_within_float16_precision():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    row = torch.softmax(logits, -1)
    back = expand(compact(row), 1000)
    assert math.isclose(float(back.sum()), 1.0, rel_tol=1e-12)
    torch.testing.assert_close(back, row, rtol=2e-3, atol=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_quantize_is_idempotent_so_the_wire_carries_exactly_the_sampled_q(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(200, generator=gen, dtype=torch.float64)
    for params in (sampled(), sampled(top_k=20), sampled(top_p=0.5)):
        row = probabilities(logits, params)
        q = quantize(row)
        assert compact(q) == compact(row)
        assert torch.equal(quantize(q), q)
        assert torch.equal(expand(compact(q), 200), q)


@pytest.mark.parametrize(
    ("c", "message"),
    [
        (CompactProbs(None, b"\x00"), "float16"),
        (CompactProbs(None, np.ones(3, "<f2").tobytes()), "4 entries"),
        (
            CompactProbs(np.array([1], "<i4").tobytes(), np.ones(2, "<f2").tobytes()),
            "one int32 per prob",
        ),
        (
            CompactProbs(np.array([1, 4], "<i4").tobytes(), np.ones(2, "<f2").tobytes()),
            r"in \[0, 4\)",
        ),
        (CompactProbs(np.array([1, 1], "<i4").tobytes(), np.ones(2, "<f2").tobytes()), "ascending"),
        (CompactProbs(None, np.array([1, -1, 0, 0], "<f2").tobytes()), "non-negative"),
        (CompactProbs(None, np.array([1, np.inf, 0, 0], "<f2").tobytes()), "finite"),
        (CompactProbs(None, np.zeros(4, "<f2").tobytes()), "all zero"),
    ],
)
def test_malformed_wire_probs_are_rejected(c, message):
    with pytest.raises(ValueError, match=message):
        expand(c, 4)


def test_the_draft_samples_from_the_quantized_q_that_the_target_will_see():
    logits = 2 * torch.randn(300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for seed in range(20):
        params = sampled(seed=seed, top_p=0.9)
        token, q = draw(logits, params, 42, Stream.DRAFT)
        # What the target reconstructs from the wire is bit for bit what was sampled from ...
        on_the_wire = expand(compact(q), 300)
        assert torch.equal(on_the_wire, q)
        assert token == sample(on_the_wire, uniform(seed, Stream.DRAFT, 42))
        assert q[token] > 0
        # ... and that is the rounded q, not the full-precision one.
        assert not torch.equal(q, probabilities(logits, params))


def test_the_target_draws_from_its_full_precision_p():
    logits = logits_of(0.1, 0.4, 0.2, 0.3)
    for seed in range(10):
        params = sampled(seed=seed)
        token, p = draw(logits, params, 3, Stream.TARGET)
        assert torch.equal(p, probabilities(logits, params))
        assert token == sample(p, uniform(seed, Stream.TARGET, 3))


def test_draw_greedy_is_the_argmax_without_probabilities():
    logits = torch.tensor([0.0, 2.0, 1.0])
    assert draw(logits, sampled(temperature=0.0), 0, Stream.DRAFT) == (1, None)
    assert draw(logits, sampled(verification=Verification.GREEDY), 0, Stream.TARGET) == (1, None)


def test_draw_gumbel_is_the_same_for_both_sides():
    logits = logits_of(0.1, 0.4, 0.2, 0.3)
    for seed in range(10):
        params = sampled(seed=seed, verification=Verification.GUMBEL)
        expected = gumbel_draw(logits, params, 8)
        assert draw(logits, params, 8, Stream.DRAFT) == (expected, None)
        assert draw(logits, params, 8, Stream.TARGET) == (expected, None)


def test_draw_is_only_for_the_draft_and_target_streams():
    with pytest.raises(ValueError, match="DRAFT or TARGET"):
        draw(logits_of(0.5, 0.5), sampled(), 0, Stream.ACCEPT)
