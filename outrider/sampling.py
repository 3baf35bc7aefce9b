"""Sampling: the one place where logits become probabilities and where
randomness comes from.

Both workers use this module, so the draft's ``q`` and the target's ``p`` are
processed the same way (docs/design.md#verification: temperature, top-k, top-p and min-p are
applied to both *before* the acceptance test), and both draw their random
numbers from the same counter-based generator.

**Randomness.** Nothing here touches a global RNG. Every random number is a
pure function of ``(seed, stream, position)``, where ``position`` is the
absolute token position in the sequence: the numbers at a position do not
depend on where rounds begin or on how many were drawn before, and only the
numbers that are used are drawn. So a seeded request reproduces on any
machine (with rejection sampling, given the same drafter and K; with Gumbel
coupling, whatever the drafter and K). The construction, so that another
implementation can reproduce it bit for bit:

* generator: Philox4x64-10 (Salmon et al. 2011, "Parallel random numbers: as
  easy as 1, 2, 3"), as ``numpy.random.Philox`` implements it;
* key (two 64-bit words): ``(seed, stream)``;
* counter (four 64-bit words, the first least significant):
  ``(0, position, 0, 0)``. numpy increments the counter *before* each block,
  so the blocks used are ``Philox(key, (1, position, 0, 0))``,
  ``Philox(key, (2, position, 0, 0))``, ...; their four output words are
  used in order (word ``i`` of the stream is word ``i % 4`` of block
  ``i // 4 + 1``). Positions never share blocks (a position could use
  almost ``2**66`` words).
* a 64-bit word ``x`` becomes a uniform ``u = ((x >> 12) + 0.5) / 2**52``,
  which lies strictly inside (0, 1) and is exact in float64.

:func:`uniform` uses word 0 of its stream; :func:`gumbel_noise` uses words
``0 .. V-1`` of the GUMBEL stream, word ``i`` for token ``i`` (so noise for a
larger vocabulary extends, and never changes, noise for a smaller one).
"""

from __future__ import annotations

import enum
import math

import numpy as np
import torch

from outrider.sampling_params import UINT64_MAX, SamplingParams, Verification
from outrider.speculation import CompactProbs, TokenLogprobs

__all__ = [
    "CompactProbs",
    "SamplingParams",
    "Stream",
    "Verification",
    "compact",
    "constrain",
    "draw",
    "expand",
    "gumbel_draw",
    "gumbel_noise",
    "hold_back",
    "probabilities",
    "quantize",
    "sample",
    "token_logprobs",
    "uniform",
]


# ---------------------------------------------------------------------------
# Logits processing


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed distribution over the vocabulary, float64, same device.

    Applied identically to the draft's logits (giving ``q``) and the target's
    (giving ``p``). In order: temperature, top-k, top-p, min-p, renormalise.
    Tokens outside the support get exactly 0. Works on ``[V]`` and ``[N, V]``
    (any leading dimensions). Ties at a top-k or top-p boundary are all kept,
    so the result never depends on how a sort orders equal values.
    Temperature 0 gives a point mass on the argmax (the first, on ties).
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have shape [..., vocab] with vocab > 0, got {tuple(logits.shape)}"
        )
    x = logits.detach().to(torch.float64)
    if params.temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).to(torch.float64)
    neg_inf = -math.inf

    # 1. temperature
    x = x / params.temperature

    # 2. top-k: keep the logits at least as large as the k-th largest.
    if 0 < params.top_k < x.shape[-1]:
        kth_largest = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth_largest, neg_inf)

    # 3. top-p: keep the smallest prefix of the sorted distribution whose mass
    #    reaches top_p, i.e. every token whose mass *before* it is < top_p
    #    (so the top token always stays).
    if params.top_p < 1:
        probs = torch.softmax(x, dim=-1)
        sorted_probs = probs.sort(dim=-1, descending=True).values
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        num_kept = (mass_before < params.top_p).sum(dim=-1, keepdim=True).clamp(min=1)
        smallest_kept = sorted_probs.gather(-1, num_kept - 1)
        x = x.masked_fill(probs < smallest_kept, neg_inf)

    # 4. min-p: drop tokens less likely than min_p times the most likely.
    if params.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), neg_inf)

    # 5. renormalise over what is left.
    return torch.softmax(x, dim=-1)


# ---------------------------------------------------------------------------
# Counter-based randomness (construction in the module docstring)


class Stream(enum.IntEnum):
    """Independent random streams; the value is the second key word."""

    DRAFT = 1
    """The draft's own draws ``d_t ~ q_t``."""
    ACCEPT = 2
    """The acceptance test's coin at each position."""
    TARGET = 3
    """The target's draws: recovered and bonus tokens, target-only decoding."""
    GUMBEL = 4
    """The Gumbel noise both sides share in gumbel verification."""


def constrain(logits: torch.Tensor, bitmasks: np.ndarray) -> torch.Tensor:
    """``logits`` ``[T, V]`` with the tokens each row's bitmask
    (``outrider.grammar``: ``[T, ceil(V / 32)]`` int32) forbids set to
    -inf: what sampling, verification and log-probabilities then read."""
    bits = np.unpackbits(bitmasks.view(np.uint8), axis=-1, bitorder="little")
    allowed = torch.from_numpy(bits[:, : logits.shape[-1]].view(np.bool_))
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def hold_back(logits: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
    """``logits`` ``[T, V]`` of the positions from ``position`` with
    ``params.stop_token_ids`` at -inf in the rows of the request's first
    ``min_tokens`` generated tokens (vLLM's min_tokens) — except in a row
    that would then allow nothing (a finished structured output allows only
    end-of-sequence tokens)."""
    rows = params.start + params.min_tokens - position
    if rows <= 0 or not params.stop_token_ids:
        return logits
    held = logits.clone()
    ids = torch.tensor(sorted(params.stop_token_ids), device=logits.device)
    held[:rows, ids] = float("-inf")
    empty = torch.isneginf(held[:rows]).all(dim=-1)
    held[:rows][empty] = logits[:rows][empty]
    return held


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], num_top: int
) -> tuple[TokenLogprobs, ...]:
    """The log-probabilities of ``tokens``, row ``t`` of ``logits`` ``[T, V]``
    giving token ``t``'s position, with the ``num_top`` most likely tokens of
    each row: the log-softmax of ``logits`` before temperature and the
    filters, in float32 (vLLM's ``raw_logprobs``), so they do not depend on
    how the request samples."""
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist()
    if num_top == 0:
        return tuple(TokenLogprobs(lp) for lp in chosen)
    top = rows.topk(num_top, dim=-1)
    ids, values = top.indices.tolist(), top.values.tolist()
    return tuple(
        TokenLogprobs(lp, tuple(zip(i, v, strict=True)))
        for lp, i, v in zip(chosen, ids, values, strict=True)
    )


def _words(seed: int, stream: Stream, position: int, count: int) -> np.ndarray:
    """Words ``0 .. count-1`` of the stream ``(seed, stream)`` at ``position``."""
    if not 0 <= seed <= UINT64_MAX:
        raise ValueError(f"seed must be in [0, 2**64 - 1], got {seed}")
    if not 0 <= position <= UINT64_MAX:
        raise ValueError(f"position must be in [0, 2**64 - 1], got {position}")
    key = np.array([seed, int(stream)], dtype=np.uint64)
    counter = np.array([0, position, 0, 0], dtype=np.uint64)
    return np.random.Philox(key=key, counter=counter).random_raw(count)


def _to_uniform(words: np.ndarray) -> np.ndarray:
    # ((x >> 12) + 0.5) / 2**52: 52 random bits, centred, strictly inside (0, 1).
    return ((words >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52


def uniform(seed: int, stream: Stream, position: int) -> float:
    """A U(0, 1) number for ``(seed, stream, position)``; never 0 nor 1."""
    return float(_to_uniform(_words(seed, stream, position, 1))[0])


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` standard Gumbel noise ``-log(-log u)`` for ``position``.

    Both workers derive the same noise, so they can couple their draws
    without communicating. The uniforms are bit-identical everywhere; the
    float64 ``log`` may differ in the last ulp between math libraries, which
    could only matter for an argmax tie within ~1e-16.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    u = _to_uniform(_words(seed, Stream.GUMBEL, position, vocab_size))
    return torch.from_numpy(-np.log(-np.log(u)))


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from ``probs`` (``[V]``, need not sum to 1) with ``u``.

    Returns the first token whose cumulative mass exceeds ``u`` times the
    total; a token with zero mass is never returned. Computed on the CPU in
    float64 so the same ``probs`` and ``u`` give the same token everywhere.
    """
    if probs.dim() != 1:
        raise ValueError(f"probs must have shape [vocab], got {tuple(probs.shape)}")
    if not 0 < u < 1:
        raise ValueError(f"u must be in (0, 1), got {u}")
    cdf = np.cumsum(probs.detach().to("cpu", torch.float64).numpy())
    total = cdf[-1]
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"probs must have a finite, positive total mass, got {total}")
    token = int(np.searchsorted(cdf, u * total, side="right"))
    # u * total may round up to total: stay on the last token with mass.
    last_with_mass = int(np.searchsorted(cdf, total, side="left"))
    return min(token, last_with_mass)


def gumbel_draw(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The Gumbel-max draw ``argmax(log p + g)``, ``g`` = noise of ``(seed, position)``.

    ``p = probabilities(logits)``; tokens outside its support have
    ``log p = -inf`` and are never drawn.
    """
    log_probs = probabilities(logits, params).log()
    noise = gumbel_noise(params.seed, position, log_probs.shape[-1]).to(log_probs.device)
    return int((log_probs + noise).argmax())


def draw(
    logits: torch.Tensor, params: SamplingParams, position: int, stream: Stream
) -> tuple[int, torch.Tensor | None]:
    """How one side picks its token at absolute ``position`` from ``logits`` ``[V]``.

    ``stream`` is DRAFT for the draft and TARGET for target-only decoding.

    * greedy: the argmax; no probabilities.
    * rejection: a draw from the processed distribution with
      ``uniform(seed, stream, position)``; returns that distribution too.
      The draft's ``q`` travels to the target in float16 (:func:`compact`),
      and the acceptance test is exact only if the target sees the very
      ``q`` the draft sampled from. So the draft samples from the rounded
      ``q = quantize(...)`` and returns it: both sides use identical numbers.
      The target's ``p`` never leaves the target and keeps full precision.
    * gumbel: :func:`gumbel_draw` (the same noise whatever the stream);
      no probabilities.
    """
    if stream not in (Stream.DRAFT, Stream.TARGET):
        raise ValueError(f"draw is for the DRAFT or TARGET stream, got {stream!r}")
    if logits.dim() != 1:
        raise ValueError(f"logits must have shape [vocab], got {tuple(logits.shape)}")
    if params.is_greedy:
        return int(logits.argmax()), None
    if params.verification is Verification.GUMBEL:
        return gumbel_draw(logits, params, position), None
    probs = probabilities(logits, params)
    if stream is Stream.DRAFT:
        probs = quantize(probs)
    return sample(probs, uniform(params.seed, stream, position)), probs


# ---------------------------------------------------------------------------
# Wire form of q (rejection mode)


_F16 = np.dtype("<f2")
_I32 = np.dtype("<i4")


def compact(probs_row: torch.Tensor) -> CompactProbs:
    """The wire form of one probability row ``[V]``.

    Sparse (support ids + values, 6 bytes a token) when at most ``V / 4``
    tokens have mass after float16 rounding, as top-k/top-p make it;
    dense float16 (2 bytes a token) otherwise.
    """
    if probs_row.dim() != 1:
        raise ValueError(f"probs_row must have shape [vocab], got {tuple(probs_row.shape)}")
    row = probs_row.detach().to("cpu", torch.float64).numpy()
    largest = row.max()
    if not (math.isfinite(largest) and largest > 0) or row.min() < 0:
        raise ValueError("probs_row must be finite, non-negative and not all zero")
    scaled = (row / largest).astype(_F16)
    support = np.flatnonzero(scaled)
    if len(support) <= len(row) // 4:
        return CompactProbs(
            token_ids=support.astype(_I32).tobytes(), probs=scaled[support].tobytes()
        )
    return CompactProbs(token_ids=None, probs=scaled.tobytes())


def expand(c: CompactProbs, vocab_size: int) -> torch.Tensor:
    """Back to a ``[vocab_size]`` float64 row (CPU), renormalised.

    Bit-identical on every machine: float16 values are multiples of 2**-24
    no larger than 1, so their float64 sum is exact in any order (for any
    vocabulary below 2**29), and each division is correctly rounded.
    """
    if len(c.probs) % _F16.itemsize:
        raise ValueError(f"probs must be float16 values, got {len(c.probs)} bytes")
    values = np.frombuffer(c.probs, dtype=_F16).astype(np.float64)
    if c.token_ids is None:
        if len(values) != vocab_size:
            raise ValueError(f"dense probs must have {vocab_size} entries, got {len(values)}")
        row = values
    else:
        if len(c.token_ids) != _I32.itemsize * len(values):
            raise ValueError(
                f"token_ids must hold one int32 per prob ({len(values)}), "
                f"got {len(c.token_ids)} bytes"
            )
        ids = np.frombuffer(c.token_ids, dtype=_I32)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(
                f"token_ids must be in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]"
            )
        if (np.diff(ids) <= 0).any():
            raise ValueError("token_ids must be strictly ascending (no repeats)")
        row = np.zeros(vocab_size, dtype=np.float64)
        row[ids] = values
    if not np.isfinite(row).all() or (row < 0).any():
        raise ValueError("probs must be finite and non-negative")
    total = row.sum()
    if total <= 0:
        raise ValueError("probs must not be all zero")
    return torch.from_numpy(row / total)


def quantize(probs_row: torch.Tensor) -> torch.Tensor:
    """``expand(compact(row))``: the row exactly as the other side will see it.

    Idempotent: ``quantize(quantize(row))`` equals ``quantize(row)`` and
    ``compact(quantize(row))`` gives the same bytes as ``compact(row)``.
    """
    return expand(compact(probs_row), probs_row.shape[-1])
