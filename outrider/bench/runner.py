"""The interleaved run: for each prompt, every configuration in turn."""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from outrider.bench.configs import BASELINE, TARGET_ONLY, Config
from outrider.bench.measurements import Measurement, median_measurement
from outrider.bench.prompts import Prompt


class _Named(Protocol):
    @property
    def name(self) -> str: ...


C = TypeVar("C", bound=_Named)
"""A configuration: a :class:`Config` or a concurrency run's ``LoadConfig``."""


def interleaved_order(configs: Sequence[C], index: int) -> list[C]:
    """Every configuration once, for the ``index``-th turn: the starting one
    rotated every other turn, and the order reversed on the turns between —
    so that no configuration always runs at the same place in a turn, nor
    always after the same one (what a batch leaves behind, in the caches
    or a worker's memory, falls on the next)."""
    shift = (index // 2) % len(configs) if configs else 0
    order = [*configs[shift:], *configs[:shift]]
    return order[::-1] if index % 2 else order


def run_interleaved(
    configs: Sequence[Config],
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    *,
    repeat: int = 1,
    progress: bool = True,
) -> dict[str, list[Measurement]]:
    """For each prompt, every configuration in turn, ``repeat`` times (the
    order rotated or reversed each time: :func:`interleaved_order`); the
    results by configuration, in prompt order, each the median of its
    ``repeat`` requests."""
    from tqdm import tqdm

    results: dict[str, list[Measurement]] = {c.name: [] for c in configs}
    with tqdm(
        total=repeat * len(prompts) * len(configs), desc="bench", unit="run", disable=not progress
    ) as bar:
        for i, prompt in enumerate(prompts):
            runs: dict[str, list[Measurement]] = {c.name: [] for c in configs}
            for r in range(repeat):
                for config in interleaved_order(configs, i * repeat + r):
                    bar.set_postfix_str(f"{prompt.id} {config.name}")
                    runs[config.name].append(_run_one(config, prompt, max_new_tokens))
                    bar.update()
            for name, measurements in runs.items():
                results[name].append(median_measurement(measurements))
    return results


def warm_up(
    configs: Sequence[Config], prompt: Prompt, max_new_tokens: int, *, progress: bool = True
) -> dict[str, Measurement]:
    """One untimed request per configuration (first-call costs, connections)."""
    from tqdm import tqdm

    return {
        config.name: _run_one(config, prompt, max_new_tokens)
        for config in tqdm(
            configs, desc="warm-up", unit="config", disable=not progress, leave=False
        )
    }


def _run_one(config: Config, prompt: Prompt, max_new_tokens: int) -> Measurement:
    """``config.run``; a failure names the configuration and the prompt."""
    try:
        return config.run(prompt, max_new_tokens)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise RuntimeError(f"{config.name} failed on {prompt.id}: {failure_detail(exc)}") from exc


def failure_detail(exc: BaseException) -> str:
    """A gRPC error as ``CODE: details``, anything else as its message."""
    code = getattr(exc, "code", None)
    return (
        f"{code().name}: {exc.details()}"
        if callable(code) and hasattr(exc, "details")
        else str(exc)
    )


IGNORED_BECAUSE = {"adaptive": "K was fixed", "pipeline": "the rounds were not pipelined"}
"""The options a configuration may ask for and a coordinator may ignore, and
what its statistics then say."""


def selected(configs: Sequence[C], globs: Sequence[str]) -> list[C]:
    """The configurations whose names match one of ``globs`` (shell-style, as
    ``--configs`` gives them), and the references whatever they say:
    ``hf-generate`` and ``outrider-k0``, against which the others' outputs
    and ratios are taken. No globs: all of them. A glob that matches no
    configuration is an error that lists those there are."""
    if not globs:
        return list(configs)
    names = [c.name for c in configs]
    for glob in globs:
        if not any(fnmatch.fnmatchcase(name, glob) for name in names):
            raise ValueError(
                f"--configs {glob!r} matches no configuration of this run; "
                f"it has {', '.join(names)}"
            )
    return [
        c
        for c in configs
        if c.name in (BASELINE, TARGET_ONLY) or any(fnmatch.fnmatchcase(c.name, g) for g in globs)
    ]


def without_ignored_options(configs: Sequence[C], warm: Mapping[str, Any]) -> list[C]:
    """The configurations, less those that asked for adaptive K or pipelined
    rounds and whose warm-up (``warm[name]``: a Measurement or a Stream) says
    the coordinator ignored it (with a warning)."""
    kept = list(configs)
    for option, because in IGNORED_BECAUSE.items():
        ignored = [c.name for c in kept if getattr(c, option) and not getattr(warm[c.name], option)]
        if ignored:
            print(
                f"WARNING: the coordinator ignored `{option}` (its stats say {because}); "
                f"left out: {', '.join(ignored)}",
                file=sys.stderr,
            )
        kept = [c for c in kept if c.name not in ignored]
    return kept
