"""A runner for a loaded model: the paged Llama-family runner when the model
takes it, else the unbatched fallback; its KV pool sized once from the
memory budget (:mod:`outrider.memory`)."""

from __future__ import annotations

from torch import nn

from outrider.engine import llama
from outrider.engine.kv_cache import BlockPool
from outrider.engine.runner import FallbackRunner, PagedRunner
from outrider.logging import get_logger
from outrider.memory import worker_cache_budget

log = get_logger(__name__)

BLOCK_SIZE = 16
"""Tokens per block (vLLM's default)."""


def build_runner(
    model: nn.Module, *, max_sessions: int, max_context: int, max_cached_tokens: int | None, cuda_graphs: bool
) -> PagedRunner | FallbackRunner:
    """``cuda_graphs``: capture CUDA graphs at warm-up (on a CUDA device)."""
    budget = worker_cache_budget(
        model, max_sessions=max_sessions, max_context=max_context, max_cached_tokens=max_cached_tokens
    )
    if (reason := llama.unsupported(model)) is not None:
        log.warning("model runs on the unbatched fallback runner", reason=reason)
        return FallbackRunner(model, BlockPool(budget, 1))
    forward = llama.LlamaForward(model)
    pool = BlockPool(max(1, budget // BLOCK_SIZE), BLOCK_SIZE)
    return PagedRunner(forward, pool, cuda_graphs=cuda_graphs and forward.device.type == "cuda")
