"""Tensor operations of the engine's forward passes that torch does not
offer as such.

* :func:`linear` — ``F.linear``; or, for CPU inputs, whichever of three
  ways to compute it ran the model's linears the fastest on this machine
  at each count of rows (:func:`tune_linears`): ``F.linear`` itself,
  ``(W @ x.T).T`` for 1 to 16 rows (a decode step, a verify round, a batch
  of draft steps) — a single row as two and 9 to 15 rows as 16 — or
  oneDNN's product with the weight packed once in its blocked layout
  (what ``torch.compile`` emits for a CPU linear), the same results to
  float rounding. Which is fastest depends on the CPU and its BLAS build:
  on some, the matrix–matrix path is slow for so few rows and the
  matrix–vector path reads the weights at a fraction of the memory's rate;
  on others ``F.linear`` is several times the faster; on an AMD EPYC the
  BLAS took twice as long for 8 rows as for 2 where the packed product
  took about as long for 16 (docs/benchmark.md#a-steps-cost).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Path = Literal["library", "transposed", "packed"]
"""How :func:`linear` computes a product: ``F.linear``, ``(W @ x.T).T``,
or oneDNN's product on the weight packed in its layout."""

SMALL_BATCH_ROWS = 16
"""Each count of rows from 1 to this one is tuned apart; ``(W @ x.T).T``
is a path for these counts only."""

LARGE_BATCH_ROWS = 64
"""The count of rows timed for every count past :data:`SMALL_BATCH_ROWS`
(a prompt's prefill, a verify of many rows)."""

TUNING_REPEATS = 3
"""Timed calls of each path per count of rows, taken in turn (the fastest counts)."""

_paths: dict[tuple[int, int, int, torch.dtype], Path] = {}
"""``(out features, in features, rows, dtype)`` → the path that computed
such products the fastest here, ``rows`` past :data:`SMALL_BATCH_ROWS`
counted as one more; a product not in it takes ``F.linear``."""
_packs: dict[int, torch.Tensor] = {}
"""``id`` of a weight → the weight packed for oneDNN, while the weight lives."""
_forced: Path | None = None
"""Every product on the CPU by this path where it can take it, whatever was
tuned (:func:`linear_path`); None: as tuned."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, computed on the CPU by the path :func:`tune_linears`
    found the fastest for its shape and count of rows."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features if in_features else 0
    if rows == 0 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    path = _forced or _paths.get(
        (out_features, in_features, min(rows, SMALL_BATCH_ROWS + 1), weight.dtype), "library"
    )
    if path == "transposed" and rows <= SMALL_BATCH_ROWS:
        return _transposed_linear(x, weight, bias, rows)
    if path == "packed" and (packed := _packs.get(id(weight))) is not None:
        return _packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


@contextmanager
def linear_path(path: Path) -> Iterator[None]:
    """Within it, every product on the CPU takes ``path`` where it can
    (``transposed``: 1 to :data:`SMALL_BATCH_ROWS` rows; ``packed``: a
    tuned weight), whatever was tuned: to measure or test one path on any
    machine."""
    global _forced
    before, _forced = _forced, path
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


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` by oneDNN on a weight :func:`_pack` packed."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` packed in oneDNN's blocked layout, for any count of rows;
    None where this torch or this CPU has no oneDNN product for its dtype."""
    if not _packs_dtype(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight)


@cache
def _packs_dtype(dtype: torch.dtype) -> bool:
    """Whether this torch and this CPU compute oneDNN's product on packed
    weights of ``dtype``: one small product, tried once."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        _packed_linear(weight.new_ones(1, 8), packed, None)
    except (AttributeError, RuntimeError):  # (an older torch; bfloat16 on a CPU without it)
        return False
    return True


def tune_linears(weights: Iterable[object]) -> dict[Path, int]:
    """For each count of rows from 1 to ``SMALL_BATCH_ROWS``, and at
    :data:`LARGE_BATCH_ROWS` for every count past it, times ``F.linear``,
    ``(W @ x.T).T`` (up to ``SMALL_BATCH_ROWS``) and oneDNN's product on
    packed weights through every CPU weight matrix among ``weights``
    (others, quantized ones among them, are left alone) in turn — in a
    forward pass's order, as it reads them: from memory — on this thread,
    with its torch threads (call it where the forward passes run), and
    makes :func:`linear` take the fastest for that count from now on. Timed
    on one weight again and again, a product finds its weight in the cache,
    and a choice made product by product ran the forward pass slower than
    either path throughout, up to twice
    (docs/benchmark.md#a-steps-cost). The packed weights
    are kept where that path won somewhere: a second copy of each weight,
    beside the one the other paths read. Returns how many products (each
    shape at each count) go each way."""
    matrices = [
        w
        for w in weights
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type == "cpu"
    ]
    shapes = {(*w.shape, w.dtype) for w in matrices}
    packs = {id(w): packed for w in matrices if (packed := _pack(w)) is not None}
    counts: dict[Path, int] = {"library": 0, "transposed": 0, "packed": 0}
    with torch.inference_mode():
        for rows in [*range(1, SMALL_BATCH_ROWS + 1), LARGE_BATCH_ROWS]:
            inputs = {
                (in_features, dtype): torch.randn(rows, in_features, dtype=dtype)
                for _, in_features, dtype in shapes
            }
            candidates: dict[Path, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
                "library": F.linear
            }
            if rows <= SMALL_BATCH_ROWS:
                candidates["transposed"] = partial(_transposed_linear, bias=None, rows=rows)
            if packs:
                candidates["packed"] = partial(_packed_or_library, packs)
            seconds = _fastest_in_turn(
                *(partial(_through, product, inputs, matrices) for product in candidates.values())
            )
            fastest = list(candidates)[seconds.index(min(seconds))]
            for out_features, in_features, dtype in shapes:
                key = (out_features, in_features, min(rows, SMALL_BATCH_ROWS + 1), dtype)
                _paths[key] = fastest
                counts[fastest] += 1
    if counts["packed"]:
        for w in matrices:
            if id(w) in packs:
                _packs[id(w)] = packs[id(w)]
                weakref.finalize(w, _packs.pop, id(w), None)
    return counts


def _packed_or_library(
    packs: dict[int, torch.Tensor], x: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """The packed product where ``packs`` holds ``weight`` packed, else ``F.linear``."""
    packed = packs.get(id(weight))
    return F.linear(x, weight) if packed is None else _packed_linear(x, packed, None)


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
    (:func:`tune_linears` then chooses their paths).

    Only the class changes: weights are not copied. Subclasses of ``nn.Linear``
    (quantized or otherwise customised layers) are left alone.
    """
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
