"""Configuration: one frozen dataclass per service, built once in the CLI
from flags and ``OUTRIDER_*`` environment variables, validated once, and
passed down. Nothing here reads the environment at import time.

Every flag ``--some-flag`` of ``outrider serve ROLE`` can also be given as
``OUTRIDER_SOME_FLAG``; a flag on the command line wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from outrider.security import ClientTls, ServerTls

DRAFTERS = ("model", "prompt-lookup", "early-exit")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def default_threads() -> int:
    """Torch threads per worker: every core. The draft and the target take
    turns (a round drafts, then verifies), so two workers on one machine do
    not compete for cores."""
    return os.cpu_count() or 1


@dataclass(frozen=True)
class WorkerLimits:
    max_sessions: int = 64
    max_cached_tokens: int | None = None
    """None: sized from the memory free once the model is loaded (``outrider.memory``)."""
    session_idle_timeout_s: float = 300.0
    """A session whose stream brings no message for this long is closed and its KV freed."""

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {self.max_sessions}")
        if self.max_cached_tokens is not None and self.max_cached_tokens < 1:
            raise ValueError(f"max_cached_tokens must be at least 1, got {self.max_cached_tokens}")
        if not self.session_idle_timeout_s > 0:
            raise ValueError(f"session_idle_timeout_s must be positive, got {self.session_idle_timeout_s}")


@dataclass(frozen=True)
class ServiceAddress:
    host: str = "127.0.0.1"
    port: int = 0
    ready_file: Path | None = None
    """Where to write the bound port once the service is SERVING."""
    tls: ServerTls | None = None
    """None: plaintext."""
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP at ``/metrics`` on ``host`` at this
    port (0: any free one); None: no metrics."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM: how long calls in flight may take to finish (new ones are
    refused) before the rest are cancelled and the service exits."""

    def __post_init__(self) -> None:
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be 0 or more, got {self.shutdown_grace_s}")
        if self.metrics_port is not None:
            if not 0 <= self.metrics_port <= 65535:
                raise ValueError(f"metrics port {self.metrics_port} is not a port number (0 to 65535)")
            if self.metrics_port != 0 and self.metrics_port == self.port:
                raise ValueError(f"the metrics port must differ from the gRPC port ({self.port})")


@dataclass(frozen=True)
class TargetWorkerConfig:
    address: ServiceAddress
    model: str | None = None
    dtype: str = "float32"
    threads: int = 1
    limits: WorkerLimits = WorkerLimits()
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class DraftWorkerConfig:
    address: ServiceAddress
    drafter: str = "prompt-lookup"
    model: str | None = None
    """Draft model (drafter "model") or checkpoint to cut (drafter "early-exit"); None: the default model."""
    dtype: str = "float32"
    draft_layers: int | None = None
    max_draft_tokens: int = 16
    max_ngram: int = 3
    threads: int = 1
    limits: WorkerLimits = WorkerLimits()
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter {self.drafter!r}: use one of {', '.join(DRAFTERS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.drafter == "early-exit" and not self.draft_layers:
            raise ValueError("the early-exit drafter needs --draft-layers L (L >= 1)")
        if self.drafter != "early-exit" and self.draft_layers is not None:
            raise ValueError("--draft-layers only applies to --drafter early-exit")
        if self.max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be at least 1")


@dataclass(frozen=True)
class CoordinatorConfig:
    address: ServiceAddress
    target: tuple[str, ...]
    draft: tuple[str, ...] = ()
    tokenizer: str | None = None
    """Tokenizer (model id or directory); None: the default model's."""
    num_speculative_tokens: int = 4
    adaptive: bool = False
    """Requests that leave K unset choose it per round (up to the maximum)."""
    max_num_speculative_tokens: int = 16
    default_max_new_tokens: int = 256
    worker_wait_s: float = 300.0
    """How long to wait for a target worker at start-up."""
    worker_tls: ClientTls | None = None
    """How to reach TLS workers; None: plaintext."""
    auth_tokens: frozenset[str] = frozenset()
    """Bearer tokens clients must present; empty: no authentication."""
    draft_deadline_s: float = 5.0
    """A draft answer later than this drops the round to K = 0 (the stream goes on)."""

    def __post_init__(self) -> None:
        if not self.draft_deadline_s > 0:
            raise ValueError(f"draft_deadline_s must be positive, got {self.draft_deadline_s}")
        if not self.target:
            raise ValueError("the coordinator needs at least one target worker address (--target)")
        if not 0 <= self.num_speculative_tokens <= self.max_num_speculative_tokens:
            raise ValueError("need 0 <= num_speculative_tokens <= max_num_speculative_tokens")
        if self.default_max_new_tokens < 1:
            raise ValueError("default_max_new_tokens must be at least 1")
