"""Where a concurrency batch's time goes: while every stream runs, and after.

``outrider bench --concurrency`` times a batch from its first request to
its last stream's end. Where speculation speeds some requests more than
others, once the queue is empty the streams of fast ones end first and the
batch finishes on fewer rows: a tail in which the target steps for fewer
sessions than N. This reads the services' debug log of such a
run (the bench's stderr with ``--log-level debug``) and prints, for each
batch of N > 1 streams: its wall time and tokens/s; the time until the
first stream of the last wave ended (every stream busy) and the tokens/s
committed in it; the tail after it; and the rounds that drafted. Batches
are the timed requests (``--max-new-tokens`` tokens each) in the order
they opened, ``--requests`` at a time::

    outrider bench --concurrency 4 --drafters prompt-lookup --configs \\
        outrider-prompt-lookup-adaptive --limit 8 --max-new-tokens 64 \\
        --ignore-eos --no-hf --no-pipelined --repeat 10 --log-level debug 2> bench.log
    python scripts/batch_tails.py bench.log --requests 8 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from datetime import datetime
from itertools import groupby
from pathlib import Path


def events(path: Path) -> list[dict]:
    """The log's round, first-round and finished-generation events, each with
    its time ``t`` in seconds, in time order."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") in ("round", "first round", "generation finished"):
            stamp = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
            event["t"] = stamp.timestamp()
            found.append(event)
    return sorted(found, key=lambda e: e["t"])


def batches(log: list[dict], requests: int, tokens: int) -> list[dict]:
    """Each batch of ``requests`` timed requests (of ``tokens`` tokens) run
    by more than one stream at once: its times, tokens and drafting rounds."""
    opened: dict[str, float] = {}
    rounds: dict[str, list[dict]] = defaultdict(list)
    for e in log:
        if e["event"] == "first round":
            opened.setdefault(e["request_id"], e["t"])
        elif e["event"] == "round":
            rounds[e["request_id"]].append(e)
    ended = {
        e["request_id"]: e["t"]
        for e in log
        if e["event"] == "generation finished" and e["generated_tokens"] == tokens
    }
    timed = sorted((r for r in ended if r in opened), key=opened.__getitem__)
    found = []
    for i in range(0, len(timed) - requests + 1, requests):
        ids = timed[i : i + requests]
        start, end = min(opened[r] for r in ids), max(ended[r] for r in ids)
        streams = max(sum(opened[r] <= opened[q] < ended[r] for r in ids) for q in ids)
        if streams < 2:
            continue  # a batch at N = 1
        last_wave = ids[len(ids) - streams :] if len(ids) > streams else ids
        full_until = min(ended[r] for r in last_wave)
        committed = sum(
            e["accepted"] + 1 for r in ids for e in rounds[r] if e["t"] <= full_until
        ) + sum(opened[r] <= full_until for r in ids)  # (each first token)
        found.append(
            {
                "streams": streams,
                "wall_s": end - start,
                "tokens_per_s": len(ids) * tokens / (end - start),
                "full_s": full_until - start,
                "full_tokens_per_s": committed / (full_until - start),
                "tail_s": end - full_until,
                "drafting_rounds": sum(e["k"] > 0 for r in ids for e in rounds[r]),
            }
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("log", type=Path, help="the bench's stderr, run with --log-level debug")
    parser.add_argument("--requests", type=int, default=8, help="requests a batch (default: 8)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens a request (default: 64)")
    args = parser.parse_args()
    found = batches(events(args.log), args.requests, args.tokens)
    if not found:
        parser.error("no batch of more than one stream in the log (was it --log-level debug?)")
    print("| N | drafted | wall s | tok/s | all busy s | tok/s all busy | tail s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in found:
        print(
            f"| {b['streams']} | {b['drafting_rounds']} | {b['wall_s']:.2f} "
            f"| {b['tokens_per_s']:.1f} | {b['full_s']:.2f} | {b['full_tokens_per_s']:.1f} "
            f"| {b['tail_s']:.2f} |"
        )

    def kind(b: dict) -> tuple[int, bool]:
        return b["streams"], b["drafting_rounds"] > 0

    for (n, drafted), members in groupby(sorted(found, key=kind), key=kind):
        group = list(members)
        print(
            f"N={n}, {'drafted' if drafted else 'no draft'}: {len(group)} batches, mean tok/s "
            f"{statistics.mean(b['tokens_per_s'] for b in group):.1f}, while all busy "
            f"{statistics.mean(b['full_tokens_per_s'] for b in group):.1f}, "
            f"tail {statistics.mean(b['tail_s'] for b in group):.2f} s"
        )


if __name__ == "__main__":
    main()
