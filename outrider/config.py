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
    max_cached_tokens: int = 262_144

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_cached_tokens < 1:
            raise ValueError("max_sessions and max_cached_tokens must be positive")


@dataclass(frozen=True)
class ServiceAddress:
    host: str = "127.0.0.1"
    port: int = 0
    ready_file: Path | None = None
    """Where to write the bound port once the service is SERVING."""
    tls: ServerTls | None = None
    """None: plaintext."""


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

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("the coordinator needs at least one target worker address (--target)")
        if not 0 <= self.num_speculative_tokens <= self.max_num_speculative_tokens:
            raise ValueError("need 0 <= num_speculative_tokens <= max_num_speculative_tokens")
        if self.default_max_new_tokens < 1:
            raise ValueError("default_max_new_tokens must be at least 1")
