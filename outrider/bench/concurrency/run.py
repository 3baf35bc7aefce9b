"""The concurrency run: every configuration at every concurrency,
interleaved, after one warm-up each, and a short untimed batch of each at
every concurrency before its timed ones (``repeat`` of them, reported by
their median)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from outrider.bench.concurrency.streams import Batch, LoadConfig, batch_requests, median_batch
from outrider.bench.prompts import Prompt
from outrider.bench.runner import failure_detail, interleaved_order, without_ignored_options

WARM_UP_TOKENS = 4
"""Tokens of each request of a warm-up batch: the prefills and a drafting round."""


def run_concurrency(
    configs: Sequence[LoadConfig],
    prompts: Sequence[Prompt],
    levels: Sequence[int],
    max_new_tokens: int,
    *,
    repeat: int = 1,
    once: Sequence[int] = (),
    progress: bool = True,
) -> tuple[list[LoadConfig], dict[str, dict[int, Batch]], dict[str, str]]:
    """For each concurrency N, every configuration in turn (the order rotated
    from N to N), ``repeat`` times (rotated or reversed each time): each
    configuration's batch at N is the median of its ``repeat``, so that a few
    seconds of a slower machine weigh on no one configuration's figure. The
    levels of ``once`` run one batch each: N = 1 where it runs only as the
    reference for the outputs.

    Before the timed batches of an N, each configuration runs the same
    requests for a few tokens, untimed: the first batch of a shape pays
    costs the others would not (on a GPU, its first eager steps:
    docs/benchmark.md#a-steps-cost), which would favour whichever configuration
    does not run first.

    Returns the configurations that ran, their batches by name and N, and the
    errors of those that may fail and did (left out from then on).
    """
    from tqdm import tqdm

    not_run: dict[str, str] = {}
    warm: dict[str, Batch] = {}
    for config in tqdm(configs, desc="warm-up", unit="config", disable=not progress, leave=False):
        batch = _run_batch(config, prompts[:1], 1, min(max_new_tokens, 16), not_run)
        if batch is not None:
            warm[config.name] = batch
    configs = [c for c in configs if c.name in warm]
    configs = without_ignored_options(configs, {c.name: warm[c.name].streams[0] for c in configs})

    runs: dict[str, dict[int, list[Batch]]] = {c.name: {} for c in configs}
    repeats = {n: 1 if n in once else repeat for n in levels}
    total = len(configs) * sum(repeats[n] * len(batch_requests(prompts, n)) for n in levels)
    with tqdm(total=total, desc="bench", unit="request", disable=not progress) as bar:
        for i, n in enumerate(levels):
            requests = batch_requests(prompts, n)
            for config in configs:
                if config.name not in not_run:
                    bar.set_postfix_str(f"warm-up {config.name} N={n}")
                    _run_batch(config, requests, n, min(max_new_tokens, WARM_UP_TOKENS), not_run)
            for r in range(repeats[n]):
                for config in interleaved_order(configs, i * repeat + r):
                    if config.name in not_run:
                        bar.update(len(requests))
                        continue
                    bar.set_postfix_str(f"{config.name} N={n}")
                    batch = _run_batch(config, requests, n, max_new_tokens, not_run, bar.update)
                    if batch is not None:
                        runs[config.name].setdefault(n, []).append(replace(batch, index=r))
    ran = [c for c in configs if c.name not in not_run]
    batches = {c.name: {n: median_batch(b) for n, b in runs[c.name].items()} for c in ran}
    return ran, batches, not_run


def _run_batch(
    config, requests, concurrency, max_new_tokens, not_run, done=lambda n: None
) -> Batch | None:
    """``config.run``; a failure names the configuration and N, and stops the run unless the
    configuration may fail: then it lands in ``not_run`` and None comes back."""
    try:
        return config.run(requests, concurrency, max_new_tokens, done)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        if not config.may_fail:
            raise RuntimeError(
                f"{config.name} failed at concurrency {concurrency}: {failure_detail(exc)}"
            ) from exc
        not_run[config.name] = f"{type(exc).__name__}: {failure_detail(exc)}"
        return None
