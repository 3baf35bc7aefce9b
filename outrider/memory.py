"""How many tokens a worker may keep in its sessions' KV caches.

``--max-cached-tokens`` wins when it is given. Otherwise the budget is sized
once, after the model is loaded, from the memory that is still free
(:func:`cache_budget` is the rule)::

    kv_bytes_per_token = layers × kv heads × head dim × 2 (K and V) × dtype size
    max_cached_tokens  = (available − margin) × fraction ÷ kv_bytes_per_token,
                         capped at max_sessions × max_context
                         (and on the CPU at 4 GiB ÷ kv_bytes_per_token)

* available — ``torch.cuda.mem_get_info``'s free bytes for a model on a GPU,
  ``MemAvailable`` of ``/proc/meminfo`` on the CPU;
* fraction — 0.9 on a GPU, which the worker has to itself (vLLM's default
  ``gpu_memory_utilization``); 0.4 on the CPU, whose memory the draft worker,
  the target worker and the coordinator often share;
* margin — 1 GiB for a forward pass's activations and allocator slack;
* the cap — no more can ever be cached, so reserving more says nothing; on
  the CPU also 4 GiB (vLLM's default CPU KV cache space), which holds a few
  full-length sessions of a small model. A CPU pool is mapped, not touched
  (:meth:`outrider.engine.llama.LlamaForward.allocate_cache`), so it becomes
  resident only as sessions fill it.

A llama.cpp context (the ``gguf`` drafter) clears its whole cache when it is
made, so all of it is resident from the start: its default is the same rule
capped at 512 MiB (:func:`gguf_cache_tokens`; 22,755 tokens of the default
model, shared by all its sessions).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from outrider.logging import get_logger

log = get_logger(__name__)

GPU_FRACTION = 0.9
CPU_FRACTION = 0.4
MARGIN_BYTES = 1 << 30
CPU_MAX_BYTES = 4 << 30
GGUF_MAX_BYTES = 512 << 20
MIB = 1 << 20


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token takes in a worker's KV cache of this model: a key and
    a value vector per KV head, per layer."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * kv_heads * head_dim * 2 * dtype.itemsize


def available_bytes(device: torch.device, meminfo: Path = Path("/proc/meminfo")) -> int:
    """Memory free for KV caches on ``device`` now (the model already loaded)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise OSError(f"{meminfo} has no MemAvailable line: set --max-cached-tokens")


@dataclass(frozen=True)
class CacheBudget:
    """A sized budget and the figures it came from (they are logged)."""

    max_cached_tokens: int
    kv_bytes_per_token: int
    available_bytes: int
    fraction: float
    margin_bytes: int
    cap_tokens: int


def cache_budget(
    *,
    kv_bytes_per_token: int,
    available_bytes: int,
    on_gpu: bool,
    max_sessions: int,
    max_context: int,
) -> CacheBudget:
    """The rule of this module's docstring. Raises ValueError when the free
    memory cannot hold even one token."""
    fraction = GPU_FRACTION if on_gpu else CPU_FRACTION
    usable = max(0, available_bytes - MARGIN_BYTES) * fraction
    if not on_gpu:
        usable = min(usable, CPU_MAX_BYTES)
    cap = max_sessions * max_context
    tokens = min(int(usable // kv_bytes_per_token), cap)
    if tokens < 1:
        raise ValueError(
            f"no memory left for KV caches: {available_bytes / MIB:.0f} MiB free, "
            f"{MARGIN_BYTES / MIB:.0f} MiB kept as margin; free memory or set --max-cached-tokens"
        )
    return CacheBudget(tokens, kv_bytes_per_token, available_bytes, fraction, MARGIN_BYTES, cap)


def worker_cache_budget(
    model: torch.nn.Module,
    *,
    max_sessions: int,
    max_context: int,
    max_cached_tokens: int | None,
    tensor_parallel: tuple[int, torch.device] | None = None,
) -> int:
    """The worker's budget: ``max_cached_tokens`` when given, else sized from
    the memory free now on the model's device. Logs the figures either way.

    ``tensor_parallel`` — ``(N, device of rank 0)`` — sizes it for one rank,
    which holds ``1/N`` of every token's keys and values (on the CPU, the
    ranks share the machine's memory, so the free memory is shared too)."""
    parameter = next(model.parameters())
    per_token = kv_bytes_per_token(model.config, parameter.dtype)
    device = parameter.device
    if tensor_parallel is not None:
        size, device = tensor_parallel
        per_token //= size
        if device.type == "cpu":
            per_token *= size
    if max_cached_tokens is not None:
        log.info(
            "kv cache budget from --max-cached-tokens",
            max_cached_tokens=max_cached_tokens,
            kv_bytes_per_token=per_token,
            kv_mib=round(max_cached_tokens * per_token / MIB, 1),
        )
        return max_cached_tokens
    budget = cache_budget(
        kv_bytes_per_token=per_token,
        available_bytes=available_bytes(device),
        on_gpu=device.type == "cuda",
        max_sessions=max_sessions,
        max_context=max_context,
    )
    log.info(
        "kv cache budget sized from free memory",
        max_cached_tokens=budget.max_cached_tokens,
        rule="min((available - margin) * fraction [at most 4 GiB on the CPU] / kv_bytes_per_token, "
        "max_sessions * max_context)",
        available_mib=round(budget.available_bytes / MIB, 1),
        margin_mib=round(budget.margin_bytes / MIB, 1),
        fraction=budget.fraction,
        kv_bytes_per_token=per_token,
        cap_tokens=budget.cap_tokens,
        kv_mib=round(budget.max_cached_tokens * per_token / MIB, 1),
    )
    if budget.max_cached_tokens < max_context:
        log.warning(
            "the kv cache budget is smaller than one full-length sequence",
            max_cached_tokens=budget.max_cached_tokens,
            max_context=max_context,
        )
    return budget.max_cached_tokens


def gguf_cache_tokens(
    kv_bytes_per_token: int, *, max_sessions: int, max_context: int, max_cached_tokens: int | None
) -> int:
    """The cells of a llama.cpp context: ``max_cached_tokens`` when given,
    else the CPU rule of this module capped at ``GGUF_MAX_BYTES`` (the
    context's cache is resident from the start)."""
    if max_cached_tokens is not None:
        return max_cached_tokens
    budget = cache_budget(
        kv_bytes_per_token=kv_bytes_per_token,
        available_bytes=available_bytes(torch.device("cpu")),
        on_gpu=False,
        max_sessions=max_sessions,
        max_context=max_context,
    )
    tokens = min(budget.max_cached_tokens, GGUF_MAX_BYTES // kv_bytes_per_token)
    log.info(
        "kv cache budget sized from free memory",
        max_cached_tokens=tokens,
        rule="min((available - margin) * fraction, 512 MiB) / kv_bytes_per_token, at most "
        "max_sessions * max_context",
        available_mib=round(budget.available_bytes / MIB, 1),
        kv_bytes_per_token=kv_bytes_per_token,
        kv_mib=round(tokens * kv_bytes_per_token / MIB, 1),
    )
    return max(1, tokens)


def return_freed_memory() -> None:
    """Hands back to the system the memory that loading freed (the
    checkpoint's tensors, replaced by the forward's own copies or 4-bit
    ones): glibc keeps freed heap pages for reuse otherwise."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator manages this itself
