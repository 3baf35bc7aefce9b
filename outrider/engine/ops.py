"""Tensor operations of the engine's forward passes that torch does not
offer as such.

* :func:`linear` — ``F.linear``, or for CPU inputs of 1 to 16 rows (a
  decode step, a verify round, a batch of draft steps) ``(W @ x.T).T`` —
  a single row as two and 9 to 15 rows as 16 — where that was the faster
  on this machine (:func:`tune_small_batch_linears`): the same results to
  float rounding. Which is faster depends on the CPU and its BLAS build:
  on some, the matrix–matrix path is slow for so few rows and the
  matrix–vector path reads the weights at a fraction of the memory's
  rate; on others ``F.linear`` is several times the faster
  (docs/benchmark.md#small-batch-linears-on-the-cpu).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 16
"""Linears whose flattened input has 1 to this many rows may take the ``W @ x.T`` path."""

TUNING_REPEATS = 3
"""Timed calls of each path per shape and count of rows (the fastest counts)."""

_transposed: set[tuple[int, int, int, torch.dtype]] = set()
"""``(out features, in features, rows, dtype)`` of the products this
process computes as ``W @ x.T``: those where it beat ``F.linear`` here."""
_forced: bool | None = None
"""Every small batch transposed (True) or not (False), whatever was tuned
(:func:`small_batch_path`); None: as tuned."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except for CPU inputs of 1 to ``SMALL_BATCH_ROWS`` rows
    that :func:`tune_small_batch_linears` found faster as ``(W @ x.T).T``."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features if in_features else 0
    if 1 <= rows <= SMALL_BATCH_ROWS and x.device.type == "cpu":
        key = (out_features, in_features, rows, weight.dtype)
        if key in _transposed if _forced is None else _forced:
            return _transposed_linear(x, weight, bias, rows)
    return F.linear(x, weight, bias)


@contextmanager
def small_batch_path(transposed: bool) -> Iterator[None]:
    """Within it, every small batch on the CPU is computed as ``(W @ x.T).T``
    (``transposed``) or by ``F.linear``, whatever was tuned: to measure or
    test one path on any machine."""
    global _forced
    before, _forced = _forced, transposed
    try:
        yield
    finally:
        _forced = before


def _transposed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """``F.linear`` of ``rows`` rows as ``(W @ x.T).T``: a single row goes
    twice, so that the product is a matrix–matrix one, and 9 to 15 rows as
    16 (:func:`_padded_rows`)."""
    in_features = weight.shape[1]
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
    """The rows a transposed product is computed with: a single row as two
    (a matrix–matrix product), and 9 to 15 as 16. A BLAS that computes
    ``W @ x.T`` fast computes it fastest for columns in multiples of 8."""
    if rows == 1:
        return 2
    return SMALL_BATCH_ROWS if rows > 8 else rows


def tune_small_batch_linears(weights: Iterable[object]) -> tuple[int, int]:
    """For each shape of the CPU weight matrices among ``weights`` (others,
    quantized ones among them, are left alone) and each count of rows from
    1 to ``SMALL_BATCH_ROWS``, times ``F.linear`` against ``(W @ x.T).T``
    on this thread — with its torch threads: call it where the forward
    passes run — and makes :func:`linear` take the faster from now on.
    Returns the products tuned and how many of them go transposed."""
    tuned = transposed = 0
    seen: set[tuple[int, int, int, torch.dtype]] = set()
    with torch.inference_mode():
        for weight in weights:
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            if weight.device.type != "cpu":
                continue
            out_features, in_features = weight.shape
            for rows in range(1, SMALL_BATCH_ROWS + 1):
                key = (out_features, in_features, rows, weight.dtype)
                if key in seen:
                    continue
                seen.add(key)
                x = torch.randn(rows, in_features, dtype=weight.dtype)
                library = _fastest_s(partial(F.linear, x, weight))
                ours = _fastest_s(partial(_transposed_linear, x, weight, None, rows))
                _transposed.discard(key)
                if ours < library:
                    _transposed.add(key)
                    transposed += 1
                tuned += 1
    return tuned, transposed


def _fastest_s(fn: Callable[[], object]) -> float:
    """The fastest of :data:`TUNING_REPEATS` calls of ``fn``, after one untimed."""
    fn()
    fastest = float("inf")
    for _ in range(TUNING_REPEATS):
        started = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - started)
    return fastest


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear` (same parameters)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


def use_small_batch_linears(model: nn.Module) -> None:
    """Make every plain ``nn.Linear`` in ``model`` a :class:`SmallBatchLinear`, in place
    (:func:`tune_small_batch_linears` then chooses their paths).

    Only the class changes: weights are not copied. Subclasses of ``nn.Linear``
    (quantized or otherwise customised layers) are left alone.
    """
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
