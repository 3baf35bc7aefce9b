"""scripts/batch_tails.py: a batch's time while every stream runs, and its tail."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "batch_tails.py"


def at(seconds: float) -> str:
    return f"2026-01-01T00:00:{seconds:06.3f}Z"


def request(rid: str, opened: float, ended: float, rounds: list[tuple[float, int, int]]) -> list:
    """A request's log lines: its first round, its rounds (time, k, accepted), its end."""
    lines = [{"event": "first round", "request_id": rid, "timestamp": at(opened)}]
    lines += [
        {"event": "round", "request_id": rid, "k": k, "accepted": a, "timestamp": at(t)}
        for t, k, a in rounds
    ]
    lines.append(
        {"event": "generation finished", "request_id": rid, "generated_tokens": 4,
         "timestamp": at(ended)}
    )  # fmt: skip
    return lines


def test_a_batch_whose_streams_end_apart_has_a_tail(tmp_path):
    # Two streams, two requests each, 4 tokens a request. Stream 0 drafts and
    # ends at 4 s; stream 1 ends at 8.5 s: busy together for 4 s, a tail of 4.5.
    lines = [
        *request("a", 0.0, 2.0, [(1.0, 2, 2)]),  # 1 + 3 tokens
        *request("b", 0.0, 4.0, [(1.0, 0, 0), (2.0, 0, 0), (3.0, 0, 0)]),
        *request("c", 2.0, 4.0, [(3.0, 2, 2)]),
        *request("d", 4.5, 8.5, [(5.0, 0, 0), (6.0, 0, 0), (7.0, 0, 0)]),
        # (a warm-up request of fewer tokens is not a batch's)
        {"event": "generation finished", "request_id": "w", "generated_tokens": 1,
         "timestamp": at(9.0)},
    ]  # fmt: skip
    log = tmp_path / "bench.log"
    log.write_text("Starting ...\n" + "\n".join(json.dumps(line) for line in lines) + "\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(log), "--requests", "4", "--tokens", "4"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    row = out.splitlines()[2].split("|")[1:-1]
    # Until 4 s, a, b and c, each its first token and three more: 12 tokens.
    assert [cell.strip() for cell in row] == ["2", "2", "8.50", "1.9", "4.00", "3.0", "4.50"]
    assert "N=2, drafted: 1 batches" in out
