"""Hand-made numbers for the bench's unit tests: a measurement of one
request, the SDK's statistics as the bench reads them, and the report's
rounding."""

from types import SimpleNamespace

import pytest

from outrider.bench.measurements import Measurement


def m(
    tokens: int,
    wall: float,
    rounds: int,
    drafted: int = 0,
    accepted: int = 0,
    per_position=(),
    **fields,
) -> Measurement:
    return Measurement(
        token_ids=tuple(range(tokens)), prompt_tokens=10, wall_s=wall, rounds=rounds,
        draft_tokens=drafted, accepted_tokens=accepted, accepted_per_position=tuple(per_position),
        **fields,
    )  # fmt: skip


def stats(**fields):
    """The SDK's GenerationStats, as far as the bench reads it."""
    base = dict(
        prompt_tokens=12, rounds=5, draft_tokens=16, accepted_tokens=9,
        accepted_per_position=[4, 3, 2], draft_time_s=0.01, verify_time_s=0.5,
        overhead_time_s=0.005, overhead_s_p50=0.0008, adaptive=False, num_drafts=4,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **fields})


def approx4(value: float):
    """The report rounds to 4 decimals."""
    return pytest.approx(value, abs=1e-4)
