"""CUDA graphs of uniform steps, captured at warm-up (vLLM's CUDA graph
runner in small).

A small model's step on a GPU is Python and kernel launches, not GPU time
(docs/benchmark.md#a-steps-cost). A graph replays
a whole forward pass with one launch. Graphs need fixed shapes, so steps are
bucketed: a step of at most ``B`` rows, each feeding at most ``T`` tokens
and reading at most ``W`` blocks of cache, replays the graph of the smallest
bucket ``(B, T, W)`` that holds it. Its rows and tokens are padded: pad
tokens sit at position 0 and write to the null block, pad rows read only the
null block, and their logits are never read. Widths stop at what the
pool holds, and no bucket's rows × width exceeds it (its gathered keys and
values would). Steps that fit no bucket (prefill chunks, many rows at long
contexts) run eagerly.

Every graph reads the same static input buffers and writes the same static
logits buffer, and all share one memory pool, captured largest first, so
their memory is that of the largest one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm import tqdm

from outrider.engine.kv_cache import NULL_BLOCK
from outrider.engine.llama import AttentionGroup, ForwardBatch, LlamaForward
from outrider.logging import get_logger

log = get_logger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
TOKEN_BUCKETS = (1, 2, 3, 5, 9, 17)
"""Tokens per row: a decode step, a draft's sync, and K + 1 for K = 2, 4, 8, 16."""
MIN_CONTEXT_BUCKET = 256
"""The smallest context bucket, in tokens; the others double up to the model's context."""


def buckets(values: Sequence[int], limit: int) -> tuple[int, ...]:
    """``values`` up to ``limit``, and ``limit`` itself when it falls between them."""
    kept = tuple(v for v in values if v < limit)
    return (*kept, limit)


class CudaGraphs:
    def __init__(self, forward: LlamaForward, cache: torch.Tensor) -> None:
        self.forward = forward
        self.cache = cache
        self.block_size = cache.shape[3]
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.rows: tuple[int, ...] = ()
        self.tokens: tuple[int, ...] = ()
        self.widths: tuple[int, ...] = ()

    def capture(self, *, max_rows: int, max_tokens_per_row: int, progress: bool = False) -> None:
        """Captures every bucket up to ``max_rows`` rows and ``max_tokens_per_row`` tokens a row."""
        pool_blocks = self.cache.shape[2] - 1  # (block 0 is the null block)
        max_blocks = min(-(-self.forward.max_positions // self.block_size), pool_blocks)
        self.rows = buckets(ROW_BUCKETS, max_rows)
        self.tokens = buckets(TOKEN_BUCKETS, max_tokens_per_row)
        widths, width = [], -(-MIN_CONTEXT_BUCKET // self.block_size)
        while width < max_blocks:
            widths.append(width)
            width *= 2
        self.widths = (*widths, max_blocks)
        device, rows, tokens = self.forward.device, self.rows[-1], self.tokens[-1]
        self.input_ids = torch.zeros(rows * tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.input_ids)
        self.slots = torch.zeros_like(self.input_ids)
        self.block_table = torch.full(
            (rows, self.widths[-1]), NULL_BLOCK, dtype=torch.long, device=device
        )
        self.logits = torch.zeros(
            rows * tokens, self.forward.vocab_size, dtype=self.forward.dtype, device=device
        )
        self.pool = torch.cuda.graph_pool_handle()

        keys = sorted(  # no bucket reads more blocks than the pool holds
            (
                (b, t, w)
                for b in self.rows
                for t in self.tokens
                for w in self.widths
                if b * w <= pool_blocks
            ),
            key=lambda key: key[0] * key[1] * key[2],
            reverse=True,
        )
        started = time.perf_counter()
        for key in tqdm(keys, desc="capture CUDA graphs", unit="graph", disable=not progress):
            self.graphs[key] = self._capture(*key)
        torch.cuda.synchronize(device)
        log.info(
            "captured CUDA graphs",
            graphs=len(keys),
            rows=self.rows,
            tokens_per_row=self.tokens,
            context_blocks=self.widths,
            seconds=round(time.perf_counter() - started, 2),
            pool_mib=round(torch.cuda.memory_reserved(device) / (1 << 20)),
        )

    def _capture(self, rows: int, tokens: int, width: int) -> torch.cuda.CUDAGraph:
        n = rows * tokens
        batch = ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            slots=self.slots[:n],
            groups=[AttentionGroup(0, rows, tokens, self.block_table[:rows, :width])],
        )

        def run() -> None:
            self.logits[:n].copy_(self.forward.forward(batch, self.cache))

        # The static buffers hold zeros: the warm-up writes only the null block.
        stream = torch.cuda.Stream(self.forward.device)
        stream.wait_stream(torch.cuda.current_stream(self.forward.device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(self.forward.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        return graph

    def bucket(self, rows: Sequence) -> tuple[int, int, int] | None:
        """The smallest captured bucket that holds these rows, or None."""
        if not self.graphs:
            return None
        tokens = max(len(row.tokens) for row in rows)
        blocks = max(row.kv.pool.blocks_for(len(row.kv) + len(row.tokens)) for row in rows)
        b = next((b for b in self.rows if b >= len(rows)), None)
        t = next((t for t in self.tokens if t >= tokens), None)
        w = next((w for w in self.widths if w >= blocks), None)
        key = (b, t, w)
        return key if key in self.graphs else None

    def run(
        self, key: tuple[int, int, int], rows: Sequence
    ) -> tuple[torch.Tensor, list[tuple[int, int] | None]]:
        """Replays bucket ``key`` on ``rows``: their wanted logits, gathered,
        and where each row's are among them."""
        b, t, w = key
        n = b * t
        ids, positions, slots = [0] * n, [0] * n, [NULL_BLOCK * self.block_size] * n
        table = [[NULL_BLOCK] * w for _ in range(b)]
        logits_at: list[int] = []
        wanted: list[tuple[int, int] | None] = []
        for r, row in enumerate(rows):
            cached, blocks, base = len(row.kv), row.kv.blocks, r * t
            for offset, token in enumerate(row.tokens):
                position = cached + offset
                ids[base + offset] = token
                positions[base + offset] = position
                slots[base + offset] = (
                    blocks[position // self.block_size] * self.block_size
                    + position % self.block_size
                )
            needed = row.kv.pool.blocks_for(cached + len(row.tokens))
            table[r][:needed] = blocks[:needed]
            if row.num_logits:
                wanted.append((len(logits_at), row.num_logits))
                end = base + len(row.tokens)
                logits_at.extend(range(end - row.num_logits, end))
            else:
                wanted.append(None)
        packed = torch.tensor([*ids, *positions, *slots, *logits_at], dtype=torch.long)
        self.input_ids[:n].copy_(packed[:n], non_blocking=True)
        self.positions[:n].copy_(packed[n : 2 * n], non_blocking=True)
        self.slots[:n].copy_(packed[2 * n : 3 * n], non_blocking=True)
        self.block_table[:b, :w].copy_(torch.tensor(table, dtype=torch.long), non_blocking=True)
        self.graphs[key].replay()
        index = packed[3 * n :].to(self.logits.device, non_blocking=True)
        return self.logits.index_select(0, index), wanted
