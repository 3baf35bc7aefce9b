"""A runner for a loaded model: the paged Llama-family runner when the model
takes it, else the unbatched fallback; its KV pool sized once from the
memory budget (:mod:`outrider.memory`)."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from outrider.config import EngineConfig, WorkerLimits
from outrider.device import resolve_device, resolve_dtype
from outrider.engine import llama
from outrider.engine.kv_cache import BlockPool
from outrider.engine.runner import FallbackRunner, PagedRunner
from outrider.engine.shards import divisibility_problem
from outrider.logging import get_logger
from outrider.memory import worker_cache_budget
from outrider.prefix import BLOCK_SIZE

log = get_logger(__name__)


def build_runner(
    model: nn.Module,
    *,
    limits: WorkerLimits,
    engine: EngineConfig,
    max_context: int,
    int4_group_size: int | None = None,
    checkpoint: str | None = None,
    num_layers: int | None = None,
    trust_remote_code: bool = False,
) -> PagedRunner | FallbackRunner:
    """The runner of a worker with these ``limits`` and ``engine`` settings, for
    sessions of at most ``max_context`` tokens; ``int4_group_size``: its
    weights in 4 bits (the Llama-family forward only). With
    ``engine.tensor_parallel_size`` N > 1, ``model`` is the architecture of
    ``checkpoint`` (cut to ``num_layers``) on the meta device, and N ranks
    load their shards of it (:mod:`outrider.engine.parallel`)."""
    if engine.tensor_parallel_size > 1:
        return _tensor_parallel_runner(
            model,
            limits=limits,
            engine=engine,
            max_context=max_context,
            int4_group_size=int4_group_size,
            checkpoint=checkpoint,
            num_layers=num_layers,
            trust_remote_code=trust_remote_code,
        )
    if (reason := llama.unsupported(model)) is not None:
        if int4_group_size is not None:
            raise ValueError(
                "the int4 drafter runs the Llama-family forward only, "
                f"and this model cannot: {reason}"
            )
        log.warning("model runs on the unbatched fallback runner", reason=reason)
        return FallbackRunner(model, BlockPool(_cache_tokens(model, limits, max_context), 1))
    # Quantizing frees memory, so it comes before the budget.
    forward = _llama_forward(model, int4_group_size)
    pool = _paged_pool(_cache_tokens(model, limits, max_context), engine)
    return PagedRunner(
        forward, pool, cuda_graphs=not engine.enforce_eager and forward.device.type == "cuda"
    )


def _tensor_parallel_runner(
    model: nn.Module,
    *,
    limits: WorkerLimits,
    engine: EngineConfig,
    max_context: int,
    int4_group_size: int | None,
    checkpoint: str | None,
    num_layers: int | None,
    trust_remote_code: bool,
) -> PagedRunner:
    """Rank 0's runner over ``engine.tensor_parallel_size`` ranks, each of
    which loads its shard of ``checkpoint``; eager (no CUDA graphs)."""
    size = engine.tensor_parallel_size
    if (problem := tensor_parallel_problem(model.config, size, int4_group_size)) is not None:
        raise ValueError(problem)
    if checkpoint is None:
        raise ValueError("a tensor-parallel runner reads its shards from a checkpoint")
    from outrider.engine import parallel

    device = resolve_device(engine.device)
    ranks = parallel.start(
        checkpoint,
        model,
        size=size,
        device=device,
        dtype=resolve_dtype(engine.dtype, device),
        num_layers=num_layers,
        timeout_s=engine.tensor_parallel_timeout_s,
        threads=max(1, engine.threads // size),
        trust_remote_code=trust_remote_code,
    )
    try:
        pool = _paged_pool(
            _cache_tokens(model, limits, max_context, tensor_parallel=(size, device)), engine
        )
        return PagedRunner(ranks, pool)
    except BaseException:
        ranks.close()
        raise


def _llama_forward(model: nn.Module, int4_group_size: int | None) -> llama.LlamaForward:
    """The Llama-family forward of ``model``, its weights quantized with
    ``int4_group_size`` (a progress bar only on a terminal)."""
    started = time.perf_counter()
    forward = llama.LlamaForward(
        model, int4_group_size=int4_group_size, progress=sys.stderr.isatty()
    )
    if int4_group_size is not None:
        log.info(
            "weights quantized",
            layers="int4",
            group_size=int4_group_size,
            lm_head="int8",
            seconds=round(time.perf_counter() - started, 2),
        )
    return forward


def _cache_tokens(
    model: nn.Module,
    limits: WorkerLimits,
    max_context: int,
    *,
    tensor_parallel: tuple[int, torch.device] | None = None,
) -> int:
    """How many tokens the KV pool holds (:func:`outrider.memory.worker_cache_budget`)."""
    return worker_cache_budget(
        model,
        max_sessions=limits.max_sessions,
        max_context=max_context,
        max_cached_tokens=limits.max_cached_tokens,
        tensor_parallel=tensor_parallel,
    )


def _paged_pool(tokens: int, engine: EngineConfig) -> BlockPool:
    """A pool of blocks for ``tokens`` tokens (one at least), a prefix
    cache unless the engine says none."""
    caching = engine.enable_prefix_caching is not False
    return BlockPool(max(1, tokens // BLOCK_SIZE), BLOCK_SIZE, caching=caching)


def tensor_parallel_problem(config, size: int, int4_group_size: int | None = None) -> str | None:
    """Why a model with this (transformers) config cannot run over ``size``
    tensor-parallel ranks, or None when it can."""
    if int4_group_size is not None:
        return "the int4 drafter does not run tensor-parallel: give it --tensor-parallel-size 1"
    if config.model_type not in llama.ARCHITECTURES:
        return (
            f"tensor parallelism runs the Llama-family forward only "
            f"({', '.join(sorted(llama.ARCHITECTURES))}), not {config.model_type!r}"
        )
    return divisibility_problem(config, size)
