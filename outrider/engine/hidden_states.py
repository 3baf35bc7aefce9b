"""The target's hidden states as tensors, and as they travel
(:class:`outrider.hidden_states.HiddenStates`): little-endian bfloat16."""

from __future__ import annotations

import torch

from outrider.errors import InvalidArgument
from outrider.hidden_states import HiddenStates


def pack(rows: torch.Tensor) -> HiddenStates:
    """``rows`` ``[n, width]`` (any float dtype, any device) packed."""
    data = rows.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return HiddenStates(data.view(torch.int16).numpy().tobytes(), int(rows.shape[0]))


def unpack(states: HiddenStates, width: int) -> torch.Tensor:
    """The ``[rows, width]`` bfloat16 tensor ``states`` holds."""
    if states.rows == 0:
        return torch.empty(0, width, dtype=torch.bfloat16)
    if len(states.data) != 2 * width * states.rows:
        raise InvalidArgument(
            f"hidden_states: {len(states.data)} bytes for {states.rows} rows; a row is "
            f"{width} bfloat16 values ({2 * width} bytes) for this draft head"
        )
    flat = torch.frombuffer(bytearray(states.data), dtype=torch.int16)
    return flat.view(torch.bfloat16).view(states.rows, width)
