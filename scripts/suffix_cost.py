"""What suffix decoding costs the coordinator per round, by how many tokens
the shared cache of outputs holds: a round's update (its committed tokens
indexed, in the session's own history and the shared outputs) and its
lookup (both drafts, the better kept), p50 and p99 in microseconds, and the
cache's memory.

The cache is filled with outputs drawn as text is: tokens from a Zipf law
over a 49,152-token vocabulary, and one output in four reusing a stretch
of an earlier one (as answers that quote code or passages do), so that
common 3-grams have their full :data:`outrider.drafters.suffix.SAMPLES`
occurrences and lookups walk them.

    python scripts/suffix_cost.py [--sizes 1000,10000,1000000]
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from outrider.drafters.suffix import SuffixDecoding  # noqa: E402

VOCAB = 49152
OUTPUT_TOKENS = 256
ROUNDS = 2000


def zipf_tokens(rng: random.Random, n: int) -> list[int]:
    weights = [1 / (rank + 1) for rank in range(2048)]
    common = rng.choices(range(2048), weights=weights, k=n)
    return [t if rng.random() < 0.9 else rng.randrange(VOCAB) for t in common]


def filled(tokens: int, rng: random.Random) -> SuffixDecoding:
    drafter = SuffixDecoding(max_cached_tokens=tokens)
    outputs: list[list[int]] = []
    while drafter.cache.tokens < tokens - OUTPUT_TOKENS:
        text = zipf_tokens(rng, OUTPUT_TOKENS)
        if outputs and rng.random() < 0.25:
            earlier = rng.choice(outputs)
            start = rng.randrange(OUTPUT_TOKENS // 2)
            text[start : start + 96] = earlier[start : start + 96]
        outputs.append(text)
        output = drafter.cache.new_output()
        drafter.cache.extend(output, text)
    return drafter


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{p50 * 1e6:7.1f} / {p99 * 1e6:7.1f}"


def measure(tokens: int) -> str:
    rng = random.Random(tokens)
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    drafter = filled(tokens, rng)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    held = drafter.cache.tokens
    session = drafter.index(200)
    history = zipf_tokens(rng, 200)
    session.match(history, 8)
    updates, lookups = [], []
    for _ in range(ROUNDS):
        history.extend(zipf_tokens(rng, rng.randint(1, 5)))  # a round's committed tokens
        started = time.perf_counter()
        session._grown(history)
        indexed = time.perf_counter()
        session.match(history, 8)  # (its own update finds nothing new)
        done = time.perf_counter()
        updates.append(indexed - started)
        lookups.append(done - indexed)
    return (
        f"| {held:,} | {percentiles(updates)} | {percentiles(lookups)} "
        f"| {grown / 1024:,.0f} MiB (peak growth) |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,1000000")
    args = parser.parse_args()
    print("| tokens in the cache | update p50 / p99 (µs) | lookup p50 / p99 (µs) | memory |")
    print("|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        print(measure(size), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
