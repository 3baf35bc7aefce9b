"""Logs never carry unbounded client content: every field is cut to a
bounded length, saying how long it was; a traceback keeps its tail."""

from __future__ import annotations

import json
import logging

from outrider.logging import (
    MAX_FIELD_CHARS,
    MAX_TRACEBACK_CHARS,
    BoundedRecords,
    bound_fields,
)


def test_a_long_field_is_cut_and_says_its_length():
    grammar = "start: " + " | ".join(f'"c{i}"' for i in range(3_000))
    event = bound_fields(None, "error", {"event": "refused", "error": grammar, "n": 3})
    assert len(event["error"]) < MAX_FIELD_CHARS + 40
    assert event["error"].startswith(grammar[:100])
    assert event["error"].endswith(f"[cut: {len(grammar):,} chars]")
    assert event["n"] == 3 and event["event"] == "refused"


def test_a_long_structured_field_is_cut_as_its_repr():
    event = bound_fields(None, "debug", {"tokens": list(range(10_000)), "short": [1, 2]})
    assert isinstance(event["tokens"], str) and "[cut:" in event["tokens"]
    assert event["short"] == [1, 2]


def test_a_traceback_keeps_its_tail():
    trace = "Traceback\n" + "  frame\n" * 5_000 + "GrammarError: the cause"
    event = bound_fields(None, "error", {"exception": trace})
    assert len(event["exception"]) <= MAX_TRACEBACK_CHARS + 40
    assert event["exception"].endswith("GrammarError: the cause")


def test_standard_library_records_are_bounded(caplog):
    logger = logging.getLogger("outrider.test.bounds")
    record = logger.makeRecord(
        logger.name, logging.WARNING, __file__, 1, "%s", ("x" * 50_000,), None
    )
    BoundedRecords().filter(record)
    assert len(record.getMessage()) < MAX_FIELD_CHARS + 40
    assert json.dumps(record.getMessage()).count("x") == MAX_FIELD_CHARS
