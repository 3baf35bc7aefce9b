"""How suffix decoding's shared cache warms up over a run: the agentic
prompt set sent in order, one request at a time, through `outrider up
--drafter suffix` on the default model, and after each coding session (4
turns) the coordinator's counters read — the share of lookups whose draft
came from earlier outputs (hits), the cache's tokens, and the session's
tokens per round.

    python scripts/suffix_warmup.py [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from outrider.bench.prompts import PROMPT_SETS, load_prompts  # noqa: E402

TURNS = 4


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:  # 127.0.0.1 only
        lines = response.read().decode().splitlines()
    return {
        name: float(value)
        for name, value in (
            line.split()[:2] for line in lines if line.startswith("outrider_suffix")
        )
    }


async def run(address: str, metrics_url: str, max_new_tokens: int) -> None:
    from outrider.client import AsyncClient

    prompts = load_prompts(PROMPT_SETS["agentic"])
    print("| session | lookups | from earlier outputs | cache tokens | tokens a round |")
    print("|---:|---:|---:|---:|---:|")
    before = {"outrider_suffix_cache_lookups_total": 0.0, "outrider_suffix_cache_hits_total": 0.0}
    async with AsyncClient(address, timeout=600) as client:
        for session in range(len(prompts) // TURNS):
            generated = rounds = 0
            for prompt in prompts[session * TURNS : (session + 1) * TURNS]:
                result = await client.generate(
                    messages=[{"role": "user", "content": prompt.text}],
                    max_new_tokens=max_new_tokens,
                )
                generated += result.stats.generated_tokens
                rounds += result.stats.rounds
            now = counters(metrics_url)
            lookups = (
                now["outrider_suffix_cache_lookups_total"]
                - before["outrider_suffix_cache_lookups_total"]
            )
            hits = (
                now["outrider_suffix_cache_hits_total"] - before["outrider_suffix_cache_hits_total"]
            )
            before = now
            print(
                f"| {session + 1} | {lookups:.0f} | {hits / max(lookups, 1):.0%} "
                f"| {now['outrider_suffix_cache_tokens']:.0f} | {generated / rounds:.2f} |",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    from outrider.stack import start_stack

    with start_stack(
        target_args=["--log-level", "warning", "--no-enable-prefix-caching"],
        coordinator_args=["--log-level", "warning", "--suffix-decoding"],
        with_draft=False,
        metrics_port=0,
    ) as stack:
        coordinator = stack.coordinator
        asyncio.run(run(coordinator.address, coordinator.metrics_url or "", args.max_new_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
