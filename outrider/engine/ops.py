"""Tensor operations of the engine's forward passes that torch does not
offer as such.

* :func:`linear` — ``F.linear``, except that CPU inputs of 1 to 16 rows
  (a decode step, a verify round, a batch of draft steps) are computed as
  ``(W @ x.T).T``, a single row as two and 9 to 15 rows as 16: the same
  results to float rounding, several times faster on common CPU BLAS
  builds, whose matrix–matrix path is slow for so few rows, whose
  matrix–vector path reads the weights at a fraction of the memory's rate,
  and whose ``W @ x.T`` is fastest for multiples of 8 columns
  (docs/benchmark.md#small-batch-linears-on-the-cpu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 16
"""Linears whose flattened input has 1 to this many rows take the ``W @ x.T`` path."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except that CPU inputs of 1 to ``SMALL_BATCH_ROWS`` rows
    are computed as ``(W @ x.T).T`` (made contiguous); more rows stay on
    ``F.linear``, where the BLAS is fast. A single row (a decode step) goes
    twice, so that the product is a matrix–matrix one: as a matrix–vector
    product the weights are read at about a third of the rate; 9 to 15
    rows go as 16 (:func:`_padded_rows`)."""
    in_features = weight.shape[1]
    rows = x.numel() // in_features if in_features else 0
    if not 1 <= rows <= SMALL_BATCH_ROWS or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    x2d = x.reshape(rows, in_features)
    if (padded := _padded_rows(rows)) != rows:
        x2d = torch.cat([x2d, x2d.new_zeros(padded - rows, in_features)])
    out = torch.mm(weight, x2d.T) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x2d.T)
    out = out[:, :rows]
    # Contiguous, as F.linear's would be: a transposed result carries its
    # layout into q and k, and attention then takes the slow path (copies of
    # every key and value) instead of the fused kernel.
    return out.T.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def _padded_rows(rows: int) -> int:
    """The rows a small-batch product is computed with: a single row as two
    (a matrix–matrix product), and 9 to 15 as 16. The BLAS computes ``W @
    x.T`` fastest for columns in multiples of 8; 9 to 15 took up to twice
    as long as 16, which read the same weights."""
    if rows == 1:
        return 2
    return SMALL_BATCH_ROWS if rows > 8 else rows


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
