"""Hugging Face at concurrency N, in the bench process: ``generate`` on left-padded batches
(``hf-generate``) and transformers' continuous batching (``hf-generate-batch``)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from outrider.bench.concurrency.streams import (
    Batch,
    LoadConfig,
    Stream,
    closed_loop_send_times,
    stream_from_arrivals,
)
from outrider.bench.configs import BASELINE
from outrider.bench.hf import HuggingFace
from outrider.bench.prompts import Prompt

CONTINUOUS = "hf-generate-batch"


def hf_load_configs(hf: HuggingFace) -> list[LoadConfig]:
    return [
        LoadConfig(BASELINE, "hf", partial(padded_batches, hf), k=0),
        LoadConfig(CONTINUOUS, "hf", partial(continuous_batching, hf), k=0, may_fail=True),
    ]


class _StepClock:
    """A ``generate`` streamer that keeps only when each step's tokens reach
    the host (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def padded_batches(
    hf: HuggingFace,
    requests: Sequence[Prompt],
    concurrency: int,
    max_new_tokens: int,
    done: Callable[[int], None],
) -> Batch:
    """``generate`` on batches of N requests, left-padded with an attention
    mask, one batch after the other.

    Every row of a batch is sent when its ``generate()`` call starts; its first
    token (TTFT ≈ the batch's prefill) and each later one arrive when the step
    that made it reaches the host. At N = 1 nothing is padded.
    """
    import torch

    pad = _pad_token_id(hf)
    streams: list[Stream] = []
    wall_s = 0.0
    for first in range(0, len(requests), concurrency):
        rows = [hf.prompt_ids(p) for p in requests[first : first + concurrency]]
        width = max(map(len, rows))
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=hf.device)
        attention_mask = torch.tensor(
            [[0] * (width - len(r)) + [1] * len(r) for r in rows], device=hf.device
        )
        clock = _StepClock()
        started = time.perf_counter()
        with torch.inference_mode():
            out = hf.model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                streamer=clock,
                **hf.stop_kwargs,
            )
        wall_s += time.perf_counter() - started
        streams += [
            _one_token_a_step(hf.cut_at_eos(row), started, clock.times[1:])
            for row in out[:, width:].tolist()
        ]
        done(len(rows))
    return Batch(concurrency, tuple(streams), wall_s)


def continuous_batching(
    hf: HuggingFace,
    requests: Sequence[Prompt],
    concurrency: int,
    max_new_tokens: int,
    done: Callable[[int], None],
) -> Batch:
    """``model.generate_batch`` on all the requests at once, at most N of them in a forward pass.

    Its cache is sized for N requests (pages of 32 tokens, no prefix sharing)
    and its step budget is the Outrider workers' default (256 tokens on the
    CPU, 2048 on CUDA). Each token's time comes from ``record_timestamps``; a
    request counts as sent when N closed-loop streams would have sent it
    (:func:`closed_loop_send_times`). The wall time runs from the requests'
    creation to the last token: the manager's start-up and warm-up (CUDA
    graph capture) stay out.
    """
    rows = [hf.prompt_ids(p) for p in requests]
    batching, generation = _continuous_configs(hf, rows, concurrency, max_new_tokens)
    with _kept_log() as errors:
        outputs = hf.model.generate_batch(
            inputs=rows,
            generation_config=generation,
            continuous_batching_config=batching,
            record_timestamps=True,
        )
    results = _finished(list(outputs.values()), len(rows), errors)  # in the order of the inputs
    done(len(rows))
    ends = [r.timestamps[-1] for r in results]
    sent = closed_loop_send_times([r.created_time for r in results], ends, concurrency)
    streams = [
        _one_token_a_step(hf.cut_at_eos(list(r.generated_tokens)), s, r.timestamps)
        for r, s in zip(results, sent, strict=True)
    ]
    return Batch(concurrency, tuple(streams), max(ends) - min(r.created_time for r in results))


def _continuous_configs(
    hf: HuggingFace, rows: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int
) -> tuple[Any, Any]:
    """transformers' continuous batching and generation configs for ``rows``
    at concurrency N (see :func:`continuous_batching`)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    pages = math.ceil((max(map(len, rows)) + max_new_tokens) / 32) + 1
    # transformers 5.17 names the cache unit block_size; later releases, page_size.
    unit: dict[str, Any] = (
        {"page_size": 32}
        if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        else {"block_size": 32}
    )
    batching = ContinuousBatchingConfig(
        **unit,
        num_blocks=concurrency * pages,
        max_batch_tokens=2048 if hf.device.type == "cuda" else 256,
        max_requests_per_batch=concurrency,
        allow_block_sharing=False,
    )
    generation = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=-1 if hf.ignore_eos else sorted(hf.eos_token_ids),  # -1: none
        pad_token_id=_pad_token_id(hf),
    )
    return batching, generation


def _finished(results: list[Any], requests: int, errors: Sequence[str]) -> list[Any]:
    """``results``, where every one of the ``requests`` came back with its
    tokens; else a RuntimeError with the first failure, or the error logged."""
    failed = [r.error for r in results if r.error is not None]
    if len(results) != requests or failed or any(not r.timestamps for r in results):
        logged = next(
            (m for m in errors if m.startswith("Error during")), errors[-1] if errors else None
        )
        raise RuntimeError(failed[0] if failed else logged or "a request came back without tokens")
    return results


def _one_token_a_step(token_ids: list[int], sent_s: float, step_times: Sequence[float]) -> Stream:
    """A row whose tokens arrived one a step: a chunk a token, a round a token."""
    arrivals = [(t, 1) for t in step_times[: len(token_ids)]]
    return stream_from_arrivals(token_ids, sent_s, arrivals, rounds=len(token_ids))


def _pad_token_id(hf: HuggingFace) -> int:
    """The tokenizer's pad token, else the model's, else an end-of-sequence
    token (masked out either way)."""
    for candidate in (
        hf.tokenizer.pad_token_id,
        hf.model.generation_config.pad_token_id,
        *sorted(hf.eos_token_ids),
    ):
        if isinstance(candidate, int):
            return candidate
    return 0


@contextmanager
def _kept_log():
    """The error messages of transformers' continuous batching, kept instead
    of printed: it logs a failure (and, on a CPU without psutil, a harmless
    one on every call) rather than raising it."""
    logger = logging.getLogger("ContinuousBatchingLogger")
    kept = _Kept()
    saved, logger.handlers = logger.handlers, [kept]
    try:
        yield kept.messages
    finally:
        logger.handlers = saved


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
