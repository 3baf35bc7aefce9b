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
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

import torch


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one round's draft tokens."""

    num_accepted: int
    """How many leading draft tokens were accepted (0 .. K)."""
    next_token: int
    """The recovered token when ``num_accepted < K``, else the bonus token."""

    @property
    def num_committed(self) -> int:
        return self.num_accepted + 1


def verify_greedy(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """Greedy verification.

    Accept ``d_t`` while ``d_t == argmax p_t``; at the first mismatch emit
    ``argmax p_t`` (recovered), or after the last draft ``argmax p_{K+1}``
    (bonus). The committed tokens are exactly what target-only greedy
    decoding would produce.

    ``target_logits`` has shape ``[K + 1, vocab]``.
    """
    k = len(draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits must have shape [K + 1, vocab] = [{k + 1}, vocab], "
            f"got {tuple(target_logits.shape)}"
        )
    target_tokens = target_logits.argmax(dim=-1).tolist()
    num_accepted = 0
    while num_accepted < k and draft_tokens[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    return Verdict(num_accepted=num_accepted, next_token=target_tokens[num_accepted])
