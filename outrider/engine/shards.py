"""One rank's share of a checkpoint, read from its safetensors files slice by
slice (``safe_open(...).get_slice``): a rank never holds the whole model,
even while it loads (docs/design.md#tensor-parallelism).

Megatron-LM's split of a Llama layer over ``N`` ranks:

==============================  ==========================================
q, k, v (and their biases)      by heads: rank r keeps heads r·H/N ..
gate, up                        by rows (intermediate features)
o, down                         by columns (their inputs): each rank's
                                product is a partial sum, all-reduced
embedding, LM head              by vocabulary (ceil(V/N) rows a rank, the
                                last padded with zeros)
norms                           whole on every rank
==============================  ==========================================
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` in a tensor-parallel group."""

    rank: int
    size: int

    def part(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` things that ``size`` divides."""
        if n % self.size:
            raise ValueError(f"{n} does not divide into {self.size} ranks")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def padded_part(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``ceil(n / size)`` things; the
        last rank's may reach past ``n`` (it is padded)."""
        per = -(-n // self.size)
        return self.rank * per, (self.rank + 1) * per


def divisibility_problem(config: Any, size: int) -> str | None:
    """Why a model with this (transformers) config cannot be split over
    ``size`` ranks, or None when it can."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    ffn = config.intermediate_size
    if heads % size or kv_heads % size or ffn % size:
        return (
            f"the model's {heads} attention heads, {kv_heads} KV heads and {ffn} MLP features "
            f"must each divide by the tensor-parallel size {size}"
        )
    return None


class CheckpointShard:
    """Slices of the tensors of a safetensors checkpoint directory, in
    ``dtype`` on ``device``, for ``shard``."""

    def __init__(
        self, directory: Path, shard: Shard, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shard, self.dtype, self.device = shard, dtype, device
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [path.name for path in sorted(directory.glob("*.safetensors"))]
        if not files:
            raise ValueError(f"{directory} holds no safetensors files")
        self._files = [safe_open(directory / name, framework="pt") for name in files]
        self._where = {key: f for f in self._files for key in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def close(self) -> None:
        """Unmaps the files (the tensors read are copies: they stay)."""
        self._files.clear()
        self._where.clear()

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy in memory of its own: a slice may be a view of the mapped
        file, which would keep every page of it that loading touched resident."""
        return tensor.to(device=self.device, dtype=self.dtype, copy=True).contiguous()

    def whole(self, name: str) -> torch.Tensor:
        return self._own(self._where[name].get_tensor(name))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (output features of a weight, or of a bias)."""
        return self._own(self._where[name].get_slice(name)[start:stop])

    def columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``[start, stop)`` (input features of a weight)."""
        return self._own(self._where[name].get_slice(name)[:, start:stop])

    def vocabulary_rows(self, name: str) -> tuple[torch.Tensor, int]:
        """This rank's rows of an embedding or LM head (padded with zero rows
        to ``ceil(vocab / size)``), and the vocabulary id of its first row."""
        vocab = self._where[name].get_slice(name).get_shape()[0]
        start, stop = self.shard.padded_part(vocab)
        rows = self.rows(name, min(start, vocab), min(stop, vocab))
        pad = (stop - start) - rows.shape[0]
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        return rows, start
