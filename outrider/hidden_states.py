"""The target's hidden states on their way to an EAGLE-3 draft head: rows of
the inputs of a few decoder layers, side by side, packed as little-endian
bfloat16 (bfloat16 keeps float32's range, and a residual stream has
outliers float16 would overflow). The coordinator only concatenates them
(it imports no torch); the target packs them and the draft worker unpacks
them (:mod:`outrider.engine.hidden_states`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HiddenStates:
    data: bytes
    """``rows`` × width bfloat16 values, row-major."""
    rows: int

    @property
    def nbytes(self) -> int:
        return len(self.data)


NONE = HiddenStates(b"", 0)


def concat(parts: Sequence[HiddenStates]) -> HiddenStates:
    """Consecutive positions' rows, in one."""
    parts = [p for p in parts if p.rows]
    if len(parts) == 1:
        return parts[0]
    return HiddenStates(b"".join(p.data for p in parts), sum(p.rows for p in parts))
