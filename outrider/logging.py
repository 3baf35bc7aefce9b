"""Structured logging: structlog, JSON lines when stderr is not a terminal,
every line carrying the context bound for the current request
(``request_id``, ``session_id``) through ``structlog.contextvars``."""

from __future__ import annotations

import logging
import sys

import structlog

get_logger = structlog.get_logger
bind_contextvars = structlog.contextvars.bind_contextvars
get_contextvars = structlog.contextvars.get_contextvars


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
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=sys.stderr)
    # transformers' own progress bars and notices would interleave with the
    # structured lines.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
