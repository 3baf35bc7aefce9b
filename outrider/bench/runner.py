"""The interleaved run: for each prompt, every configuration in turn."""

from __future__ import annotations

from collections.abc import Sequence

from outrider.bench.configs import Config
from outrider.bench.measurements import Measurement
from outrider.bench.prompts import Prompt


def interleaved_order(configs: Sequence[Config], prompt_index: int) -> list[Config]:
    """Every configuration once, the starting one rotated by the prompt's index."""
    shift = prompt_index % len(configs) if configs else 0
    return [*configs[shift:], *configs[:shift]]


def run_interleaved(
    configs: Sequence[Config],
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    *,
    progress: bool = True,
) -> dict[str, list[Measurement]]:
    """For each prompt, every configuration in turn; the results by configuration, in prompt order."""
    from tqdm import tqdm

    results: dict[str, list[Measurement | None]] = {c.name: [None] * len(prompts) for c in configs}
    with tqdm(total=len(prompts) * len(configs), desc="bench", unit="run", disable=not progress) as bar:
        for i, prompt in enumerate(prompts):
            for config in interleaved_order(configs, i):
                bar.set_postfix_str(f"{prompt.id} {config.name}")
                results[config.name][i] = _run_one(config, prompt, max_new_tokens)
                bar.update()
    return results  # type: ignore[return-value]


def warm_up(configs: Sequence[Config], prompt: Prompt, max_new_tokens: int, *, progress: bool = True) -> dict[str, Measurement]:
    """One untimed request per configuration (first-call costs, connections)."""
    from tqdm import tqdm

    return {
        config.name: _run_one(config, prompt, max_new_tokens)
        for config in tqdm(configs, desc="warm-up", unit="config", disable=not progress, leave=False)
    }


def _run_one(config: Config, prompt: Prompt, max_new_tokens: int) -> Measurement:
    """``config.run``; a failure names the configuration and the prompt."""
    try:
        return config.run(prompt, max_new_tokens)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        code = getattr(exc, "code", None)
        detail = f"{code().name}: {exc.details()}" if callable(code) and hasattr(exc, "details") else str(exc)
        raise RuntimeError(f"{config.name} failed on {prompt.id}: {detail}") from exc
