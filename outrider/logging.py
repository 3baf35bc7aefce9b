"""Structured logging: structlog, JSON lines when stderr is not a terminal,
every line carrying the context bound for the current request
(``request_id``, ``session_id``) through ``structlog.contextvars``.

No line carries unbounded client content: a field longer than
:data:`MAX_FIELD_CHARS` (a prompt, a grammar, a schema, an error quoting
one) is cut there, saying how long it was, and a traceback keeps its last
:data:`MAX_TRACEBACK_CHARS`; the standard library's records likewise."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

MAX_FIELD_CHARS = 1_000
MAX_TRACEBACK_CHARS = 8_000
"""A traceback's tail (its last frames and the exception) is what says what failed."""

get_logger = structlog.get_logger
bind_contextvars = structlog.contextvars.bind_contextvars
get_contextvars = structlog.contextvars.get_contextvars


def bounded(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """``text``, cut to ``limit`` characters, saying how many it had."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [cut: {len(text):,} chars]"


def bound_fields(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: each string field bounded (:func:`bounded`)."""
    for key, value in event.items():
        if key == "exception" and isinstance(value, str) and len(value) > MAX_TRACEBACK_CHARS:
            event[key] = f"[cut: {len(value):,} chars] …{value[-MAX_TRACEBACK_CHARS:]}"
        elif key != "exception" and isinstance(value, str):
            event[key] = bounded(value)
        elif not isinstance(value, int | float | bool | type(None)):
            text = repr(value)  # (a list of a prompt's tokens, say)
            if len(text) > MAX_FIELD_CHARS:
                event[key] = bounded(text)
    return event


class BoundedRecords(logging.Filter):
    """The standard library's records, bounded as structlog's fields are."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > MAX_FIELD_CHARS:
            record.msg, record.args = bounded(message), None
        return True


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Configures structlog and the stdlib root logger once, at process start."""
    if json is None:
        json = not sys.stderr.isatty()
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            bound_fields,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(BoundedRecords())
    # transformers' own progress bars and notices would interleave with the
    # structured lines.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
