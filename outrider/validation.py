"""Checks on token ids shared by the workers and the coordinator."""

from __future__ import annotations

from collections.abc import Sequence

from outrider.errors import InvalidArgument


def check_token_ids(ids: Sequence[int], vocab_size: int | None, *, what: str) -> None:
    """Raises InvalidArgument naming ``what`` if an id lies outside ``[0, vocab_size)``."""
    if vocab_size is None:
        return
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                f"{what}[{i}] = {token} is outside the vocabulary: ids must lie in [0, {vocab_size})"
            )


def check_context(length: int, max_context: int, *, what: str) -> None:
    if length > max_context:
        raise InvalidArgument(
            f"{what} has {length} tokens but the model's context holds {max_context}; "
            "shorten it or lower max_new_tokens"
        )
