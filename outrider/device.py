"""Where a worker runs its model: the device and dtype users ask for, resolved.

``--device``: ``auto`` (the first CUDA device when there is one, else the
CPU), ``cpu``, ``cuda`` or ``cuda:N``. ``--dtype``: ``auto`` (bfloat16 on
CUDA, float32 on the CPU — whose bfloat16 matrix products are slower than
its float32 ones here), or a dtype by name.
"""

from __future__ import annotations

import re

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(spec: str) -> str:
    """``spec`` if it names a device this module resolves; else ValueError."""
    if not _DEVICE.fullmatch(spec):
        raise ValueError(f"device {spec!r}: use {DEVICE_CHOICES}")
    return spec


def check_dtype(spec: str) -> str:
    if spec not in DTYPES:
        raise ValueError(f"dtype {spec!r}: use one of {', '.join(DTYPES)}")
    return spec


def resolve_device(spec: str):
    """The ``torch.device`` of a device spec, CUDA devices with their index
    (``cuda:0``); ValueError when it is not there."""
    import torch

    check_device(spec)
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {spec!r}: this machine has no CUDA device "
                f"(torch {torch.__version__}); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 ..)"
            )
        device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
    return device


def resolve_dtype(spec: str, device):
    """The ``torch.dtype`` of a dtype spec on ``device`` (``auto``: bfloat16
    on CUDA, float32 elsewhere)."""
    import torch

    check_dtype(spec)
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, spec)
