"""Outrider through its services: one coordinator per drafter, asked by the SDK."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial

from outrider.bench.configs import Config, OutriderVariant
from outrider.bench.measurements import Measurement, measurement_from_stats
from outrider.bench.prompts import Prompt


class OutriderEndpoint:
    """One coordinator, asked through the SDK's blocking client."""

    def __init__(
        self, address: str, *, ignore_eos: bool = False, json_schema: str | None = None
    ) -> None:
        from outrider.client import Client, StructuredOutput

        self.client = Client(address)
        self.ignore_eos = ignore_eos
        self.structured_output = (
            None if json_schema is None else StructuredOutput("json_schema", json_schema)
        )

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int,
        *,
        k: int | None,
        adaptive: bool = False,
        pipeline: bool = False,
        temperature: float = 0.0,
    ) -> Measurement:
        """One request: K fixed (0: target only), or adaptive K (``k=None, adaptive=True``);
        pipelined rounds or not (sent either way, never left to the server's default); greedy,
        or sampled at ``temperature`` with the prompt's seed."""
        started = time.perf_counter()
        result = self.client.generate(
            messages=[{"role": "user", "content": prompt.text}],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=prompt.seed,
            num_speculative_tokens=k,
            adaptive=adaptive,
            pipeline=pipeline,
            ignore_eos=self.ignore_eos,
            structured_output=self.structured_output,
        )
        wall_s = time.perf_counter() - started
        return measurement_from_stats(result.token_ids, result.stats, wall_s)

    def close(self) -> None:
        self.client.close()


def outrider_configs(
    endpoints: Mapping[str | None, OutriderEndpoint], variants: Sequence[OutriderVariant]
) -> list[Config]:
    """The variants (:func:`outrider.bench.configs.outrider_variants`), each
    asking its coordinator's endpoint."""
    return [
        Config(
            v.name,
            "outrider",
            partial(
                endpoints[v.coordinator].generate,
                k=v.k,
                adaptive=v.adaptive,
                pipeline=v.pipeline,
                temperature=v.temperature,
            ),
            v.drafter,
            v.k,
            v.adaptive,
            v.pipeline,
            v.temperature,
        )
        for v in variants
    ]
