"""Measures how long a frozen draft worker stalls a stream.

The three services run as processes (``outrider.stack``, as ``outrider up``
runs them: the default target and its default drafter, or the models given);
the draft worker is frozen with SIGSTOP either before the request (frozen for
the stream's whole life) or once its first chunk has arrived (its session
open, then frozen for the rest of the stream), and one stream of N tokens is
read to its end. Reported per case: the waits for a chunk longer than
``--stall-s`` (from the request, then from chunk to chunk), their sum, and
the stream's total time.

    .venv/bin/python scripts/measure_frozen_draft.py --max-new-tokens 500
    .venv/bin/python scripts/measure_frozen_draft.py --max-new-tokens 2000 --freeze before
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from outrider.client import Client
from outrider.stack import start_stack

PROMPT = "Write a long story about a fox who learns to sail."


def stream_times(address: str, max_new_tokens: int, after_first=None) -> tuple[list[float], int]:
    """Chunk arrival times (from the request, monotonic) and tokens streamed."""
    times, tokens = [time.monotonic()], 0
    with Client(address, timeout=900) as client:
        for chunk in client.stream(
            messages=[{"role": "user", "content": PROMPT}],
            max_new_tokens=max_new_tokens,
            ignore_eos=True,
        ):
            times.append(time.monotonic())
            tokens += len(chunk.token_ids)
            if after_first is not None and len(times) == 2:
                after_first()
    return times, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--draft-deadline-s", type=float, default=5.0)
    parser.add_argument("--stall-s", type=float, default=1.0, help="a longer wait is a stall")
    parser.add_argument("--target-model", help="default: the default model")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument(
        "--freeze", choices=["before", "after", "both"], default="both",
        help="freeze the draft before the request, after the first chunk, or each in turn",
    )  # fmt: skip
    args = parser.parse_args()

    worker = ["--log-level", "error", "--threads", str(args.threads)]
    model = ["--model", args.target_model] if args.target_model else []
    coordinator = ["--log-level", "error", "--draft-deadline-s", str(args.draft_deadline_s)]
    if args.target_model:
        coordinator += ["--tokenizer", args.target_model]
    cases = {"before": "frozen before the request", "after": "frozen after the first chunk"}
    for case in [cases[args.freeze]] if args.freeze != "both" else cases.values():
        with start_stack(
            target_args=[*worker, *model],
            draft_args=[*worker, *model],
            coordinator_args=coordinator,
        ) as stack:
            (draft,) = [s for s in stack.services if s.name == "draft"]
            address = stack.coordinator.address
            stream_times(address, 8)  # warm-up, with the draft running

            def freeze(pid: int = draft.process.pid) -> None:
                os.kill(pid, signal.SIGSTOP)

            try:
                if case == "frozen before the request":
                    freeze()
                    times, tokens = stream_times(address, args.max_new_tokens)
                else:
                    times, tokens = stream_times(address, args.max_new_tokens, after_first=freeze)
            finally:
                os.kill(draft.process.pid, signal.SIGCONT)
        waits = [b - a for a, b in zip(times, times[1:], strict=False)]
        stalls = [round(w, 2) for w in waits if w > args.stall_s]
        print(
            f"{case}: {tokens} tokens in {times[-1] - times[0]:.1f} s; stalls over "
            f"{args.stall_s:g} s: {stalls} (sum {sum(stalls):.1f} s; draft deadline "
            f"{args.draft_deadline_s:g} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
