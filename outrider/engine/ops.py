"""Tensor operations of the engine's forward passes that torch does not
offer as such.

* :func:`linear` — ``F.linear``, except that CPU inputs of 2 to 16 rows
  (a verify round, a batch of draft steps) are computed as ``(W @ x.T).T``:
  the same results to float rounding, several times faster on common CPU
  BLAS builds, whose matrix–matrix path is slow for so few rows
  (docs/benchmark.md#small-batch-linears-on-the-cpu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 16
"""Linears whose flattened input has 2 to this many rows take the ``W @ x.T`` path."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except that CPU inputs of 2 to ``SMALL_BATCH_ROWS`` rows
    are computed as ``(W @ x.T).T`` (made contiguous). A single row (a decode
    step) is a matrix-vector product either way and stays on ``F.linear``,
    which is a few microseconds cheaper there; so do more rows, where the
    BLAS is fast."""
    in_features = weight.shape[1]
    rows = x.numel() // in_features if in_features else 0
    if not 2 <= rows <= SMALL_BATCH_ROWS or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    x2d = x.reshape(rows, in_features)
    out = torch.mm(weight, x2d.T) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x2d.T)
    # Contiguous, as F.linear's would be: a transposed result carries its
    # layout into q and k, and attention then takes the slow path (copies of
    # every key and value) instead of the fused kernel.
    return out.T.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear` (same parameters)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


def use_small_batch_linears(model: nn.Module) -> None:
    """Make every plain ``nn.Linear`` in ``model`` a :class:`SmallBatchLinear`, in place.

    Only the class changes: weights are not copied. Subclasses of ``nn.Linear``
    (quantized or otherwise customised layers) are left alone.
    """
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
