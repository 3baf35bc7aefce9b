"""Tensor operations of the engine's forward passes that torch does not
offer as such.

* :func:`linear` — ``F.linear``, or for CPU inputs of 1 to 16 rows (a
  decode step, a verify round, a batch of draft steps) ``(W @ x.T).T`` —
  a single row as two and 9 to 15 rows as 16 — where that ran the model's
  linears the faster on this machine (:func:`tune_small_batch_linears`):
  the same results to float rounding. Which is faster depends on the CPU
  and its BLAS build: on some, the matrix–matrix path is slow for so few
  rows and the matrix–vector path reads the weights at a fraction of the
  memory's rate; on others ``F.linear`` is several times the faster
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
"""Timed calls of each path per count of rows, taken in turn (the fastest counts)."""

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
    """For each count of rows from 1 to ``SMALL_BATCH_ROWS``, times
    ``F.linear`` against ``(W @ x.T).T`` through every CPU weight matrix
    among ``weights`` (others, quantized ones among them, are left alone)
    in turn — in a forward pass's order, as it reads them: from memory —
    on this thread, with its torch threads (call it where the forward
    passes run), and makes :func:`linear` take the faster for that count
    from now on. Timed on one weight again and again, a product finds its
    weight in the cache, and a choice made product by product ran the
    forward pass slower than either path throughout, up to twice
    (docs/benchmark.md#small-batch-linears-on-the-cpu). Returns the
    products tuned (each shape at each count) and how many go transposed."""
    matrices = [
        w
        for w in weights
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type == "cpu"
    ]
    shapes = {(*w.shape, w.dtype) for w in matrices}
    tuned = transposed = 0
    with torch.inference_mode():
        for rows in range(1, SMALL_BATCH_ROWS + 1):
            inputs = {
                (in_features, dtype): torch.randn(rows, in_features, dtype=dtype)
                for _, in_features, dtype in shapes
            }
            library, ours = _fastest_in_turn(
                partial(_through, F.linear, inputs, matrices),
                partial(
                    _through, partial(_transposed_linear, bias=None, rows=rows), inputs, matrices
                ),
            )
            for out_features, in_features, dtype in shapes:
                key = (out_features, in_features, rows, dtype)
                _transposed.discard(key)
                if ours < library:
                    _transposed.add(key)
                    transposed += 1
                tuned += 1
    return tuned, transposed


def _through(
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: dict[tuple[int, torch.dtype], torch.Tensor],
    weights: list[torch.Tensor],
) -> None:
    """``product`` of each of ``weights`` in turn, on the input of its width."""
    for weight in weights:
        product(inputs[weight.shape[1], weight.dtype], weight)


def _fastest_in_turn(*fns: Callable[[], object]) -> list[float]:
    """The fastest of :data:`TUNING_REPEATS` calls of each of ``fns``, after
    one untimed, called in turn: a spell of the machine running slow (some
    other process's work) falls on every one of them, not on one alone."""
    for fn in fns:
        fn()
    fastest = [float("inf")] * len(fns)
    for _ in range(TUNING_REPEATS):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            fn()
            fastest[i] = min(fastest[i], time.perf_counter() - started)
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
