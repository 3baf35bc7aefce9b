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

from outrider.device import check_device, check_dtype
from outrider.security import ClientTls, ServerTls

DRAFTERS = ("model", "int4", "prompt-lookup", "early-exit")
"""model: a small model of its own; int4: the target's checkpoint in 4 bits
(``outrider.quantize``); prompt-lookup: n-grams of the history, no model;
early-exit: the target's first L layers."""
DEFAULT_DRAFTERS = {"cpu": "int4", "cuda": "prompt-lookup"}
"""The drafter a draft worker runs when none is named (nor a draft model),
by device type, from measurements (README, "The default drafter"). On the
CPU the target's step is bound by reading its weights, so its 4-bit copy
costs ~0.4 of a step and agrees on ~93% of drafts. On CUDA the default
model's step is bound by kernel launches, not bytes (3.6 ms a graphed step
on an H100, GPU.md), so a 4-bit copy would cost about a target step, and
prompt lookup costs nothing (the int4 drafter was not measured on a GPU)."""
INT4_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes torch's int4 kernels take (CPU and CUDA)."""
DEFAULT_INT4_GROUP_SIZE = 32
"""The GGUF 4-bit formats' block: the embedded default model's weights were
4-bit in groups of 32, so requantizing them in the same groups loses little."""
CPU_TOKENS_PER_STEP = 256
CUDA_TOKENS_PER_STEP = 2048


def default_drafter(device: str, *, draft_model: str | None = None) -> str:
    """``model`` when a draft model is named, else the default for ``device``'s type (``auto``: as resolved)."""
    if draft_model:
        return "model"
    from outrider.device import resolve_device

    return DEFAULT_DRAFTERS.get(resolve_device(device).type, "prompt-lookup")


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
            raise ValueError(
                f"session_idle_timeout_s must be positive, got {self.session_idle_timeout_s}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """How a worker runs its model (``outrider.engine``)."""

    device: str = "auto"
    """auto, cpu, cuda or cuda:N (``outrider.device``)."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on the CPU) or a dtype by name."""
    threads: int = 1
    """Torch threads of the engine (CPU forward passes)."""
    max_tokens_per_step: int | None = None
    """Tokens one forward pass may hold (vLLM's ``max_num_batched_tokens``):
    rounds run whole, prefills in chunks of what they leave. None: 256 on
    the CPU, where a 256-token chunk costs a few round steps, 2048 on CUDA."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (vLLM's ``--enforce-eager``)."""
    max_batch_wait: float = 0.25
    """How long a step may wait for the sessions the previous one answered,
    as a share of a forward pass, so they stay in one batch (0: never wait;
    ``outrider.engine.core._Returns``)."""

    def __post_init__(self) -> None:
        check_device(self.device)
        check_dtype(self.dtype)
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if not 0 <= self.max_batch_wait <= 1:
            raise ValueError(
                f"max_batch_wait is a share of a forward pass, from 0 to 1; got {self.max_batch_wait}"
            )
        if self.max_tokens_per_step is not None and self.max_tokens_per_step < 1:
            raise ValueError(
                f"max_tokens_per_step must be at least 1, got {self.max_tokens_per_step}"
            )

    def tokens_per_step(self, device_type: str) -> int:
        if self.max_tokens_per_step is not None:
            return self.max_tokens_per_step
        return CUDA_TOKENS_PER_STEP if device_type == "cuda" else CPU_TOKENS_PER_STEP


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
                raise ValueError(
                    f"metrics port {self.metrics_port} is not a port number (0 to 65535)"
                )
            if self.metrics_port != 0 and self.metrics_port == self.port:
                raise ValueError(f"the metrics port must differ from the gRPC port ({self.port})")


@dataclass(frozen=True)
class TargetWorkerConfig:
    address: ServiceAddress
    model: str | None = None
    engine: EngineConfig = EngineConfig()
    limits: WorkerLimits = WorkerLimits()
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DraftWorkerConfig:
    address: ServiceAddress
    drafter: str = "prompt-lookup"
    model: str | None = None
    """Draft model (drafter "model"), checkpoint to quantize ("int4") or to cut ("early-exit"); None: the default model."""
    engine: EngineConfig = EngineConfig()
    draft_layers: int | None = None
    int4_group_size: int = DEFAULT_INT4_GROUP_SIZE
    """Weights sharing a scale and zero in the int4 drafter."""
    max_draft_tokens: int = 16
    max_ngram: int = 3
    limits: WorkerLimits = WorkerLimits()
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter {self.drafter!r}: use one of {', '.join(DRAFTERS)}")
        if self.drafter == "early-exit" and not self.draft_layers:
            raise ValueError("the early-exit drafter needs --draft-layers L (L >= 1)")
        if self.drafter != "early-exit" and self.draft_layers is not None:
            raise ValueError("--draft-layers only applies to --drafter early-exit")
        if self.max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be at least 1")
        if self.int4_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"--int4-group-size {self.int4_group_size}: use one of {', '.join(map(str, INT4_GROUP_SIZES))}"
            )


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
    pipeline: bool = False
    """Requests that leave pipeline unset draft the next round while the target verifies this one."""
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
    verify_deadline_floor_s: float = 2.0
    """A verify with no verdict within max(this, 10 × its measured cost)
    reopens the session on another target replica."""

    def __post_init__(self) -> None:
        if not self.draft_deadline_s > 0:
            raise ValueError(f"draft_deadline_s must be positive, got {self.draft_deadline_s}")
        if not self.verify_deadline_floor_s > 0:
            raise ValueError(
                f"verify_deadline_floor_s must be positive, got {self.verify_deadline_floor_s}"
            )
        if not self.target:
            raise ValueError("the coordinator needs at least one target worker address (--target)")
        if not 0 <= self.num_speculative_tokens <= self.max_num_speculative_tokens:
            raise ValueError("need 0 <= num_speculative_tokens <= max_num_speculative_tokens")
        if self.default_max_new_tokens < 1:
            raise ValueError("default_max_new_tokens must be at least 1")
