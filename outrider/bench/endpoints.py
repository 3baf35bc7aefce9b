"""Outrider through its services: one coordinator per drafter, asked by the SDK."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from outrider.bench.configs import TARGET_ONLY, Config
from outrider.bench.measurements import Measurement, measurement_from_stats
from outrider.bench.prompts import Prompt


class OutriderEndpoint:
    """One coordinator, asked through the SDK's blocking client."""

    def __init__(self, address: str) -> None:
        from outrider.client import Client

        self.client = Client(address)

    def generate(self, prompt: Prompt, max_new_tokens: int, *, k: int | None, adaptive: bool = False) -> Measurement:
        """One request: K fixed (0: target only), or adaptive K (``k=None, adaptive=True``)."""
        started = time.perf_counter()
        result = self.client.generate(
            messages=[{"role": "user", "content": prompt.text}],
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            num_speculative_tokens=k,
            adaptive=adaptive,
        )
        wall_s = time.perf_counter() - started
        return measurement_from_stats(result.token_ids, result.stats, wall_s)

    def close(self) -> None:
        self.client.close()


def outrider_configs(
    endpoints: Mapping[str, OutriderEndpoint], ks: Sequence[int], *, adaptive: bool
) -> list[Config]:
    """``outrider-k0`` on the first coordinator, then each drafter's fixed K and adaptive K."""
    first = next(iter(endpoints.values()))
    configs = [Config(TARGET_ONLY, "outrider", lambda p, n: first.generate(p, n, k=0), k=0)]
    for label, endpoint in endpoints.items():
        if label is None:
            continue
        for k in ks:
            configs.append(
                Config(
                    f"outrider-{label}-k{k}", "outrider",
                    lambda p, n, e=endpoint, k=k: e.generate(p, n, k=k), label, k,
                )  # fmt: skip
            )
        if adaptive:
            configs.append(
                Config(
                    f"outrider-{label}-adaptive", "outrider",
                    lambda p, n, e=endpoint: e.generate(p, n, k=None, adaptive=True), label, adaptive=True,
                )  # fmt: skip
            )
    return configs
