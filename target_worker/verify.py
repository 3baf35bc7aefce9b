"""Verification of draft tokens against the target's distributions.

Words, used the same way in the protocol, the statistics and the metrics
(after vLLM's rejection sampler):

* **draft tokens** ``d_1 .. d_K`` — what the drafter proposed;
* **accepted tokens** — the leading draft tokens the target agrees with;
* **recovered token** — the target's own token at the first rejected
  position (also called the correction);
* **bonus token** — the target's token after all K drafts were accepted.

A round therefore always commits ``num_accepted + 1`` tokens.

The target scores ``[x_n, d_1, .., d_K]`` in one forward pass, where ``x_n``
is the last committed token. Row ``t`` of the logits (``t = 0 .. K``) is the
target's distribution ``p_{t+1}`` for the token that follows ``d_1 .. d_t``.

Three ways to verify (docs/design.md#verification), one entry point, :func:`verify`:
greedy (:func:`verify_greedy`), rejection sampling (:func:`verify_rejection`)
and Gumbel coupling (:func:`verify_gumbel`). Logits processing and all
randomness come from :mod:`outrider.sampling`, keyed by absolute position,
so the same seed gives the same tokens whatever the round boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from outrider.sampling import (
    SamplingParams,
    Stream,
    Verification,
    gumbel_draw,
    probabilities,
    sample,
    uniform,
)
from outrider.speculation import Verdict


def verify_greedy(draft_tokens: Sequence[int], target_tokens: Sequence[int]) -> Verdict:
    """Greedy verification.

    Accept ``d_t`` while ``d_t == argmax p_t``; at the first mismatch emit
    ``argmax p_t`` (recovered), or after the last draft ``argmax p_{K+1}``
    (bonus). The committed tokens are exactly what target-only greedy
    decoding would produce.

    ``target_tokens`` are the ``K + 1`` argmaxes ``argmax p_1 .. argmax
    p_{K+1}`` (the engine computes a whole step's at once).
    """
    k = len(draft_tokens)
    if len(target_tokens) != k + 1:
        raise ValueError(f"need K + 1 = {k + 1} target tokens, got {len(target_tokens)}")
    num_accepted = 0
    while num_accepted < k and draft_tokens[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted=num_accepted, next_token=target_tokens[num_accepted])


# ---------------------------------------------------------------------------
# Sampling verification (docs/design.md#verification)


def verify(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    start_position: int,
) -> Verdict:
    """Verify one round's draft tokens under ``params``; pure, no I/O.

    ``target_logits`` is ``[K + 1, vocab]``: row ``t`` is the target's
    distribution for absolute position ``start_position + t``, where
    ``start_position`` is the committed length (the position of ``d_1``).
    ``draft_probs`` is ``[K, vocab]``, the processed ``q`` rows the draft
    sampled from (rejection mode), or ``None`` when the draft is
    deterministic (prompt lookup, a greedy draft): a point mass on each draft
    token, as vLLM treats n-gram drafts.

    With no drafts (K = 0) the verdict's token is exactly
    ``draw(target_logits[0], params, start_position, Stream.TARGET)``:
    speculative decoding then *is* target-only decoding.
    """
    k = len(draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits must have shape [K + 1, vocab] = [{k + 1}, vocab], "
            f"got {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[1]
    if any(not 0 <= d < vocab for d in draft_tokens):
        raise ValueError(f"draft tokens must be in [0, {vocab}), got {list(draft_tokens)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(
            f"draft_probs must have shape [K, vocab] = [{k}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )
    if start_position < 0:
        raise ValueError(f"start_position must be >= 0, got {start_position}")

    if params.is_greedy:
        return verify_greedy(draft_tokens, target_logits.argmax(dim=-1).tolist())
    if params.verification is Verification.GUMBEL:
        return verify_gumbel(draft_tokens, target_logits, params, start_position)
    target_probs = probabilities(target_logits, params)
    return verify_rejection(draft_tokens, draft_probs, target_probs, params, start_position)


def verify_rejection(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    params: SamplingParams,
    start_position: int,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    ``target_probs`` is ``[K + 1, vocab]`` (processed ``p`` rows),
    ``draft_probs`` ``[K, vocab]`` or ``None`` (point masses). The committed
    tokens are distributed exactly as target-only sampling from ``p``.
    """
    k = len(draft_tokens)
    seed = params.seed
    for t, d in enumerate(draft_tokens):
        position = start_position + t
        p = target_probs[t]
        q = point_mass(d, p) if draft_probs is None else draft_probs[t].to(p)
        p_d, q_d = float(p[d]), float(q[d])
        if q_d <= 0:
            raise ValueError(
                f"draft token {d} at position {position} has draft probability 0; "
                "draft_probs must be the distribution the draft sampled from"
            )

        # Accept d_t with probability min(1, p_t(d_t) / q_t(d_t)).
        if uniform(seed, Stream.ACCEPT, position) < p_d / q_d:
            continue

        # Rejected: the recovered token comes from norm(max(0, p_t - q_t)).
        # (If p == q numerically the residual is empty; then fall back to p.)
        residual = (p - q).clamp(min=0)
        if not residual.sum() > 0:
            residual = p
        return Verdict(
            num_accepted=t, next_token=sample(residual, uniform(seed, Stream.TARGET, position))
        )

    # All K accepted: the bonus token comes from p_{K+1}.
    bonus = sample(target_probs[k], uniform(seed, Stream.TARGET, start_position + k))
    return Verdict(num_accepted=k, next_token=bonus)


def verify_gumbel(
    draft_tokens: Sequence[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    start_position: int,
) -> Verdict:
    """Gumbel coupling without communication (Daliri, Musco, Suresh 2024).

    At each position both sides draw ``argmax(log p + g)`` with the same
    noise ``g`` of ``(seed, position)``. The committed tokens are the
    target's own draws, so they depend neither on the draft model nor on K —
    the draft only decides how many come per round.
    """
    k = len(draft_tokens)
    for t, d in enumerate(draft_tokens):
        # The target's draw at this position, with the noise the draft used.
        target_token = gumbel_draw(target_logits[t], params, start_position + t)
        # Accept d_t when it is the target's draw; else the target's draw is the recovered token.
        if target_token != d:
            return Verdict(num_accepted=t, next_token=target_token)

    # All K accepted: the bonus token is the target's draw at the next position.
    return Verdict(
        num_accepted=k, next_token=gumbel_draw(target_logits[k], params, start_position + k)
    )


def point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    """The distribution of a deterministic draft: all mass on ``token``."""
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q
