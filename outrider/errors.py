"""Domain errors. Each maps to one gRPC status code (``outrider.rpc``), so a
caller can tell a bad request from a full worker from a lost session; none of
them is ever reported as INTERNAL."""

from __future__ import annotations


class OutriderError(Exception):
    """Base class of errors that reach a client as a gRPC status with this message."""


class InvalidArgument(OutriderError):
    """The request itself is wrong; the message says what to change."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The request field at fault, as the API that received the request
        names it; None when the message names it alone, or the whole request."""


class SessionNotFound(OutriderError):
    """The session does not exist (never opened, or already closed)."""


class ResourceExhausted(OutriderError):
    """The worker is full (sessions or cached tokens); retry later or elsewhere."""


class FailedPrecondition(OutriderError):
    """The request is well-formed but does not fit the state it builds on
    (a round on the wrong committed length, a draft whose vocabulary differs
    from the target's)."""


class Unavailable(OutriderError):
    """A worker the request needs cannot be reached."""


class SessionExpired(Unavailable):
    """The worker closed the session itself (its stream was idle too long)
    and freed its cache. The worker is fine; the session is lost, and is
    rebuilt like any lost session, by reopening it on the history."""


class Unauthenticated(OutriderError):
    """The call carries no valid credentials for this service."""
