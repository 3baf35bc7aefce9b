"""Model runners: the only code that runs a forward pass.

A runner turns one step's rows (:class:`~outrider.engine.scheduler.Row`)
into tensors, runs them, writes their keys and values into the sessions'
caches, and returns each row's wanted logits. Which tokens to feed and what
to make of the logits is the jobs' business (the workers' sessions).

* :class:`PagedRunner` — the Llama family (:mod:`outrider.engine.llama`):
  every row of the step in ONE forward pass over the paged cache, and on
  CUDA, uniform steps replayed from captured CUDA graphs
  (:mod:`outrider.engine.cuda_graphs`).
* :class:`FallbackRunner` — any other causal LM transformers loads: the
  model's own forward, one row at a time, each session with its own
  ``DynamicCache``. Slower, and its caches grow by concatenation, but every
  model that loads works.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Protocol

import torch
from torch import nn
from transformers import DynamicCache

from outrider.engine import ops
from outrider.engine.cuda_graphs import CudaGraphs
from outrider.engine.kv_cache import NULL_BLOCK, BlockPool, KVCache
from outrider.engine.llama import AttentionGroup, ForwardBatch, LlamaForward
from outrider.engine.scheduler import Row
from outrider.logging import get_logger

log = get_logger(__name__)


class RunnerLost(RuntimeError):
    """The runner can run no more steps (a tensor-parallel rank is gone):
    the engine stops, and the worker with it."""


@dataclass
class Logits:
    """A row's wanted next-token logits, ``[num_logits, vocab]`` on the
    model's device, and their argmaxes (computed for the whole step at once,
    so greedy decoding costs one device sync a step, not one a row)."""

    values: torch.Tensor
    argmax: list[int]
    hidden: torch.Tensor | None = None
    """An EAGLE head's: its output before the final norm at the same
    positions, ``[num_logits, H]`` — the feature its next position reads."""


class Forward(Protocol):
    """What a runner needs of a forward: a :class:`LlamaForward`, or rank 0
    of a tensor-parallel one (:class:`outrider.engine.parallel.TensorParallelForward`)."""

    vocab_size: int
    device: torch.device

    def allocate_cache(self, num_blocks: int, block_size: int) -> torch.Tensor: ...

    def forward(self, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor: ...

    def forward_with(
        self, batch: ForwardBatch, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits, and a target's hidden states at ``batch.feature_indices``
        or an EAGLE head's output before its final norm at the logits' tokens."""
        ...

    def linear_weights(self) -> list[Any]: ...


class PagedRunner:
    """Rows of a step as one forward pass of a Llama-family model over a
    paged KV cache of ``pool``'s blocks, allocated here once (CUDA graphs:
    of a single-device forward only)."""

    def __init__(self, forward: Forward, pool: BlockPool, *, cuda_graphs: bool = False) -> None:
        self.forward = forward
        self.pool = pool
        self.vocab_size = forward.vocab_size
        self.device = forward.device
        self.cache = forward.allocate_cache(pool.num_blocks, pool.block_size)
        self.graphs = (
            CudaGraphs(forward, self.cache)
            if cuda_graphs and isinstance(forward, LlamaForward)
            else None
        )
        self.graphed = False
        """Whether the last step replayed a CUDA graph (for the engine's step log)."""
        self.pad_groups = self.device.type == "cuda"
        """Group rows by the power of two at or above their token count
        (see :meth:`_flat_batch`)."""

    def new_kv(self) -> KVCache:
        return KVCache(self.pool)

    def close(self) -> None:
        """Stops what the forward started (a tensor-parallel worker's other ranks)."""
        if (close := getattr(self.forward, "close", None)) is not None:
            close()

    @property
    def graphed_tokens_per_row(self) -> int:
        """The most tokens a row may feed in a step replayed from a CUDA graph (0: none is)."""
        return self.graphs.tokens[-1] if self.graphs is not None and self.graphs.tokens else 0

    def warm_up(self, *, max_rows: int, max_tokens_per_row: int, progress: bool = False) -> None:
        """On the CPU, chooses how its linears run small batches
        (:func:`tune_linears`); on CUDA, captures the graphs of every bucket
        up to these sizes."""
        tune_linears(self.forward.linear_weights())
        if self.graphs is not None:
            self.graphs.capture(
                max_rows=max_rows, max_tokens_per_row=max_tokens_per_row, progress=progress
            )

    def execute(self, rows: Sequence[Row]) -> list[Logits | None]:
        plain = all(row.hidden is None and row.features is None for row in rows)
        bucket = self.graphs.bucket(rows) if self.graphs is not None and plain else None
        self.graphed = bucket is not None
        if self.graphs is not None and bucket is not None:
            logits, wanted = self.graphs.run(bucket, rows)
            return self._appended(rows, _split(logits, wanted))
        flat = self._flat_batch(rows)
        batch = flat.to_device(self.device)
        logits, extra = self.forward.forward_with(batch, self.cache)
        if batch.hidden is not None:
            return self._appended(rows, _split(logits, flat.wanted, hidden=extra))
        if extra is not None:
            flat.hand_out_features(rows, extra)
        return self._appended(rows, _split(logits, flat.wanted))

    @staticmethod
    def _appended(rows: Sequence[Row], outputs: list[Logits | None]) -> list[Logits | None]:
        for row in rows:
            row.kv.appended(row.tokens)
        return outputs

    def _flat_batch(self, rows: Sequence[Row]) -> _FlatBatch:
        """The rows flattened into one sequence, grouped for attention; and
        where each row's wanted logits (and hidden states) land in the output.

        Each group's rows feed the same number of tokens: on the CPU rows
        are grouped by their exact count (a padded token costs real
        compute); on CUDA by its next power of two, the shorter rows padded
        (pad tokens at position 0 write to the null block), because there a
        group costs kernel launches in every layer and a padded token next
        to nothing — prompts of 64 lengths are a few groups, not 64."""
        flat = _FlatBatch(self.pool, len(rows))
        for members in self._attention_groups(rows):
            flat.add_group(rows, members)
        return flat

    def _attention_groups(self, rows: Sequence[Row]) -> list[list[int]]:
        """The indices of ``rows`` in groups that attend together, each
        group's rows in order of their token count (its last row the
        longest)."""
        tokens_class = _power_of_two if self.pad_groups else len

        def group_of(i: int) -> tuple[int, int]:
            # Rows also read their cache padded to the group's longest context,
            # so a long one is grouped with others of about its length: a step's
            # gathered keys and values stay near what its rows hold.
            blocks = self.pool.blocks_for(len(rows[i].kv) + len(rows[i].tokens))
            return tokens_class(
                rows[i].tokens
            ), 0 if blocks <= SHARED_WIDTH_BLOCKS else _power_of_two_at_least(blocks)

        order = sorted(range(len(rows)), key=lambda i: (group_of(i), len(rows[i].tokens)))
        return [list(group) for _, group in groupby(order, key=group_of)]


class _FlatBatch:
    """A step's rows flattened on the host, group after group: their token
    ids, positions and cache slots, where the wanted logits are, each
    group's block table — then copied to the device at once."""

    def __init__(self, pool: BlockPool, num_rows: int) -> None:
        self.pool = pool
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.logits_at: list[int] = []
        self.wanted: list[tuple[int, int] | None] = [None] * num_rows
        """Per row, where its logits start among the wanted ones and how many."""
        self.tables: list[tuple[int, int, int, list[list[int]], tuple[int, int] | None]] = []
        """Per group: (start, rows, tokens per row, block table, span)."""
        self.hidden: list[torch.Tensor] = []
        """An EAGLE head's features, row by row, padding included."""
        self.feature_rows: list[tuple[int, int, int, tuple[int, ...]]] = []
        """Rows whose hidden states a target sends: (row, first token, tokens, layers)."""

    def add_group(self, rows: Sequence[Row], members: Sequence[int]) -> None:
        """Appends the group of ``rows`` at ``members``, each row padded to
        the tokens of the group's longest (its last), and its block table,
        every row's padded to the group's widest."""
        group = [rows[i] for i in members]
        t = len(group[-1].tokens)
        start = len(self.ids)
        width = max(self.pool.blocks_for(len(row.kv) + len(row.tokens)) for row in group)
        table = []
        for i, row in zip(members, group, strict=True):
            self._add_row(i, row, t)
            needed = self.pool.blocks_for(len(row.kv) + len(row.tokens))
            table.append(row.kv.blocks[:needed] + [NULL_BLOCK] * (width - needed))
        self.tables.append((start, len(group), t, table, _span(group)))

    def _add_row(self, i: int, row: Row, t: int) -> None:
        """Appends row ``i``'s tokens at their positions and slots, notes
        where its wanted logits are, and pads it to ``t`` tokens."""
        block_size = self.pool.block_size
        cached, blocks = len(row.kv), row.kv.blocks
        if row.features is not None:
            self.feature_rows.append((i, len(self.ids), len(row.tokens), row.feature_layers))
        if row.hidden is not None:
            self.hidden.append(row.hidden)
            if pad := t - len(row.tokens):
                self.hidden.append(row.hidden.new_zeros(pad, row.hidden.shape[1]))
        for offset, token in enumerate(row.tokens):
            position = cached + offset
            self.ids.append(token)
            self.positions.append(position)
            self.slots.append(blocks[position // block_size] * block_size + position % block_size)
        if row.num_logits:
            self.wanted[i] = (len(self.logits_at), row.num_logits)
            self.logits_at.extend(range(len(self.ids) - row.num_logits, len(self.ids)))
        pad = t - len(row.tokens)
        self.ids.extend([0] * pad)
        self.positions.extend([0] * pad)
        self.slots.extend([NULL_BLOCK * block_size] * pad)

    def to_device(self, device: torch.device) -> ForwardBatch:
        """The batch on ``device``, all its numbers in one copy."""
        n, num_logits = len(self.ids), len(self.logits_at)
        flat = [*self.ids, *self.positions, *self.slots, *self.logits_at]
        for *_, table, _ in self.tables:
            for blocks in table:
                flat.extend(blocks)
        packed = torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
        groups, offset = [], 3 * n + num_logits
        for start, count, t, table, span in self.tables:
            width = len(table[0])
            block_table = packed[offset : offset + count * width].view(count, width)
            groups.append(AttentionGroup(start, count, t, block_table, span))
            offset += count * width
        feature_layers = tuple(sorted({la for *_, layers in self.feature_rows for la in layers}))
        return ForwardBatch(
            input_ids=packed[:n],
            positions=packed[n : 2 * n],
            slots=packed[2 * n : 3 * n],
            groups=groups,
            logits_indices=packed[3 * n : 3 * n + num_logits],
            hidden=torch.cat(self.hidden).to(device, non_blocking=True) if self.hidden else None,
            feature_indices=torch.tensor(
                [
                    j
                    for _, start, count, _ in self.feature_rows
                    for j in range(start, start + count)
                ],
                dtype=torch.long,
            ).to(device)
            if self.feature_rows
            else None,
            feature_layers=feature_layers,
        )

    def hand_out_features(self, rows: Sequence[Row], features: torch.Tensor) -> None:
        """Appends to each row's ``features`` its tokens' hidden states at its
        layers (``features`` holds the step's layers, side by side)."""
        layers = sorted({la for *_, mine in self.feature_rows for la in mine})
        width = features.shape[1] // len(layers)
        at = 0
        for i, _, count, wanted in self.feature_rows:
            part = features[at : at + count]
            if list(wanted) != layers:
                part = torch.cat(
                    [
                        part[:, layers.index(la) * width : (layers.index(la) + 1) * width]
                        for la in wanted
                    ],
                    dim=1,
                )
            sink = rows[i].features
            assert sink is not None  # a feature row
            sink.append(part)
            at += count


def _span(members: Sequence[Row]) -> tuple[int, int] | None:
    """``AttentionGroup.span`` of a group: its one row's first block and
    length when the blocks it reads follow each other in the pool, else None."""
    if len(members) != 1:
        return None
    (row,) = members
    length = len(row.kv) + len(row.tokens)
    if not row.kv.in_order(row.kv.pool.blocks_for(length)):
        return None
    return row.kv.blocks[0], length


SHARED_WIDTH_BLOCKS = 64
"""Rows whose context fits this many blocks (1,024 tokens) share a group
whatever their lengths; longer ones group by the power of two of theirs."""


def _power_of_two(tokens: Sequence[int]) -> int:
    """The power of two at or above ``len(tokens)``."""
    return _power_of_two_at_least(len(tokens))


def _power_of_two_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


class DynamicKVCache(KVCache):
    """A session cache of the fallback runner: transformers' ``DynamicCache``
    beside the block bookkeeping (blocks of one token)."""

    def __init__(self, pool: BlockPool, cache: DynamicCache) -> None:
        super().__init__(pool)
        self.cache = cache

    def crop(self, length: int) -> None:
        drop = len(self) - length
        super().crop(length)
        if drop:
            self.cache.crop(-drop)


class FallbackRunner:
    """Rows one at a time through the model's own forward (any causal LM)."""

    def __init__(self, model: nn.Module, pool: BlockPool) -> None:
        if pool.block_size != 1:
            raise ValueError("the fallback runner accounts its caches in blocks of one token")
        config: Any = model.config  # read by name, as in outrider.engine.llama
        self.model, self.config = model, config
        self.pool = pool
        self.vocab_size: int = config.vocab_size
        self.device = next(model.parameters()).device

    def new_kv(self) -> DynamicKVCache:
        return DynamicKVCache(self.pool, DynamicCache(config=self.config))

    def warm_up(self, **_) -> None:
        """Chooses how its linears run small batches (:func:`tune_linears`)."""
        tune_linears(m.weight for m in self.model.modules() if isinstance(m, ops.SmallBatchLinear))

    def execute(self, rows: Sequence[Row]) -> list[Logits | None]:
        outputs: list[Logits | None] = []
        for row in rows:
            assert isinstance(row.kv, DynamicKVCache)  # made by new_kv
            out = self.model(
                input_ids=torch.tensor([row.tokens], device=self.device),
                past_key_values=row.kv.cache,
                use_cache=True,
                logits_to_keep=max(row.num_logits, 1),
            )
            row.kv.appended(row.tokens)
            logits = out.logits[0, -row.num_logits :] if row.num_logits else None
            outputs.append(
                None if logits is None else Logits(logits, logits.argmax(dim=-1).tolist())
            )
        return outputs


def tune_linears(weights: Iterable[object]) -> None:
    """:func:`outrider.engine.ops.tune_linears` of ``weights``, logged — to
    be called on the engine's thread, which runs with the engine's torch
    threads."""
    started = time.perf_counter()
    paths = ops.tune_linears(weights)
    if any(paths.values()):
        log.info(
            "linears tuned",
            products=sum(paths.values()),
            **paths,
            seconds=round(time.perf_counter() - started, 2),
        )


def _split(
    logits: torch.Tensor,
    wanted: Sequence[tuple[int, int] | None],
    hidden: torch.Tensor | None = None,
) -> list[Logits | None]:
    argmax = logits.argmax(dim=-1).tolist() if logits.shape[0] else []
    return [
        None
        if w is None
        else Logits(
            logits[w[0] : w[0] + w[1]],
            argmax[w[0] : w[0] + w[1]],
            None if hidden is None else hidden[w[0] : w[0] + w[1]],
        )
        for w in wanted
    ]
