"""Checks on request fields shared by the workers and the coordinator."""

from __future__ import annotations

from collections.abc import Sequence

from outrider.errors import InvalidArgument


def check_token_ids(ids: Sequence[int], vocab_size: int, *, what: str) -> None:
    """Raises InvalidArgument naming ``what`` if an id lies outside ``[0, vocab_size)``."""
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                f"{what}[{i}] = {token} is outside the vocabulary: "
                f"ids must lie in [0, {vocab_size})"
            )


def check_context(length: int, max_context: int, *, what: str) -> None:
    if length > max_context:
        raise InvalidArgument(
            f"{what} has {length} tokens but the model's context holds {max_context}; "
            "shorten it or lower max_new_tokens"
        )


MAX_REQUEST_ID_CHARS = 128


def check_request_id(request_id: str, *, what: str = "request_id") -> None:
    """Request ids travel in gRPC metadata (``x-request-id``) and in every log
    line, so they are short printable ASCII."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"{what} has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed"
        )
    for i, char in enumerate(request_id):
        if not " " <= char <= "~":
            raise InvalidArgument(
                f"{what}[{i}] = {char!r}: a request id must be printable ASCII (space to '~')"
            )
