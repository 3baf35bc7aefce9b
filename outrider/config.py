"""The services' configuration: one frozen dataclass per service (``outrider
serve ROLE``), built once from flags and ``OUTRIDER_*`` environment
variables, validated once, and passed down. Nothing here reads the
environment at import time. The local commands' (``up``, ``demo``,
``generate``) are :mod:`outrider.command_config`.

Each field is a flag (``outrider.flags``): its name, type, default and help
(the docstring under it) are written here and nowhere else. A service's
``--some-flag`` can also be given as ``OUTRIDER_SOME_FLAG``; the commands'
flags read no variables, but ``outrider up --device`` reads the workers'
``OUTRIDER_DEVICE``. Validation errors name the flag, so the CLI can print
them as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from outrider.device import DTYPES, check_device, check_dtype
from outrider.drafters import MODEL_DRAFTERS
from outrider.security import ClientTls, ServerTls, server_tls

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes torch's int4 kernels take (CPU and CUDA)."""
DEFAULT_INT4_GROUP_SIZE = 32
"""The GGUF 4-bit formats' block: the embedded default model's weights were
4-bit in groups of 32, so requantizing them in the same groups loses little."""
CPU_TOKENS_PER_STEP = 256
CUDA_TOKENS_PER_STEP = 2048
CPU_PREFILL_TOKENS = 4096
LOG_LEVELS = ("debug", "info", "warning", "error")
ROUTINGS = ("prefix", "least-loaded")
DEFAULT_PORTS = {"coordinator": 50051, "target": 50052, "draft": 50053}


def all_cores() -> int:
    return os.cpu_count() or 1


def _device(text: str) -> str:
    return check_device(text.strip().lower())


def _dtype(text: str) -> str:
    return check_dtype(text.strip().lower())


def num_speculative_tokens(text: str | int) -> int | str:
    """A K: a non-negative integer, or "auto" (adaptive)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"K must be a non-negative integer or 'auto', not {text!r}") from None
    if k < 0:
        raise ValueError(f"K must be non-negative, not {k}")
    return k


def positive(value: float, flag: str) -> None:
    if not value > 0:
        raise ValueError(f"{flag} {value}: must be positive")


def at_least(value: int, least: int, flag: str) -> None:
    if value < least:
        raise ValueError(f"{flag} {value}: must be at least {least}")


def port_number(port: int | None, flag: str) -> None:
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"{flag} {port}: not a port number (0 to 65535)")


def existing_file(path: Path | None, flag: str) -> None:
    if path is not None and not path.is_file():
        raise ValueError(f"{flag} {path}: {'not a file' if path.exists() else 'no such file'}")


@dataclass(frozen=True)
class ServiceConfig:
    """What every service has: where it listens, how it shows itself, how it stops."""

    host: str = "127.0.0.1"
    """address to bind (0.0.0.0 or [::] for all interfaces)"""
    port: int = 0
    """port to bind (0: any free port)"""
    ready_file: Path | None = None
    """write the bound port to this file once SERVING"""
    metrics_port: int | None = None
    """serve Prometheus metrics over HTTP at /metrics on --host at this port (0: any free
    port, written to the --ready-file's name with .metrics-port; unset: no metrics)"""
    shutdown_grace_s: float = 10.0
    """on SIGTERM: report NOT_SERVING, refuse new calls with UNAVAILABLE, give calls in
    flight this many seconds to finish, then cancel the rest and exit"""
    log_level: str = field(default="info", metadata={"choices": LOG_LEVELS})
    """least level of the log lines written"""
    tls_cert: Path | None = None
    """serve TLS with this certificate (PEM)"""
    tls_key: Path | None = None
    """private key of --tls-cert (PEM)"""
    tls_client_ca: Path | None = None
    """require client certificates signed by this CA (mutual TLS)"""

    def __post_init__(self) -> None:
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"--shutdown-grace-s {self.shutdown_grace_s}: must be 0 or more")
        port_number(self.port, "--port")
        port_number(self.metrics_port, "--metrics-port")
        if self.metrics_port not in (None, 0) and self.metrics_port == self.port:
            raise ValueError(
                f"--metrics-port {self.metrics_port}: the metrics port must differ from the gRPC "
                "port (--port)"
            )
        server_tls(self.tls_cert, self.tls_key, self.tls_client_ca)  # checks them together

    @property
    def tls(self) -> ServerTls | None:
        """The TLS settings, checked; None for plaintext."""
        return server_tls(self.tls_cert, self.tls_key, self.tls_client_ca)


@dataclass(frozen=True)
class WorkerLimits:
    """How much a worker takes on."""

    max_sessions: int = 64
    """most sessions open at once"""
    max_cached_tokens: int | None = None
    """most tokens cached over all sessions (default: sized from the memory free once the
    model is loaded, outrider.memory)"""
    session_idle_timeout_s: float = 300.0
    """close a session (and free its KV cache) whose stream brings no message for this many
    seconds"""

    def __post_init__(self) -> None:
        at_least(self.max_sessions, 1, "--max-sessions")
        if self.max_cached_tokens is not None:
            at_least(self.max_cached_tokens, 1, "--max-cached-tokens")
        positive(self.session_idle_timeout_s, "--session-idle-timeout-s")


@dataclass(frozen=True)
class EngineConfig:
    """How a worker runs its model (``outrider.engine``)."""

    device: str = field(default="auto", metadata={"parse": _device, "metavar": "DEVICE"})
    """where the model runs: auto (the first CUDA device if there is one, else the CPU), cpu,
    cuda or cuda:N"""
    dtype: str = field(default="auto", metadata={"parse": _dtype, "choices": DTYPES})
    """weights dtype (auto: bfloat16 on CUDA, float32 on the CPU)"""
    threads: int = field(default_factory=all_cores)
    """torch threads for forward passes on the CPU (default: all cores)"""
    max_tokens_per_step: int | None = None
    """tokens one batched forward pass may hold: rounds run whole, prompts are prefilled in
    chunks of what is left (default: 256 on the CPU, 2048 on CUDA)"""
    max_prefill_tokens: int | None = None
    """a prompt with no other session on the worker is prefilled in one forward pass up to
    this many tokens, in chunks beyond (default: 4096 on the CPU; on CUDA
    --max-tokens-per-step)"""
    enforce_eager: bool = False
    """never capture CUDA graphs (every step runs eagerly)"""
    enable_prefix_caching: bool | None = None
    """keep the KV of full blocks of final tokens after their sessions end, shared by
    sessions that open on the same prefix and evicted least recently used when the pool
    needs room (default: on; the fallback runner of non-Llama models never caches)"""
    max_batch_wait: float = 0.25
    """how long a step may wait for the sessions the previous step answered, so they stay in
    one batch, as a share of a forward pass (0: never wait)"""
    tensor_parallel_size: int = 1
    """ranks the model is split over (Megatron-style, torch.distributed): one process per
    rank, on cuda:0 .. cuda:N-1 with NCCL, or on the CPU with gloo (--threads shared among
    them); the model's attention heads and KV heads must divide N"""
    tensor_parallel_timeout_s: float = 60.0
    """how long a rank waits in a collective for the others before it gives up (a lost
    rank then stops the worker)"""

    def __post_init__(self) -> None:
        check_device(self.device)
        at_least(self.tensor_parallel_size, 1, "--tensor-parallel-size")
        positive(self.tensor_parallel_timeout_s, "--tensor-parallel-timeout-s")
        check_dtype(self.dtype)
        at_least(self.threads, 1, "--threads")
        if not 0 <= self.max_batch_wait <= 1:
            raise ValueError(
                f"--max-batch-wait {self.max_batch_wait}: a share of a forward pass, 0 to 1"
            )
        if self.max_tokens_per_step is not None:
            at_least(self.max_tokens_per_step, 1, "--max-tokens-per-step")
        if self.max_prefill_tokens is not None:
            at_least(self.max_prefill_tokens, 1, "--max-prefill-tokens")

    def tokens_per_step(self, device_type: str) -> int:
        if self.max_tokens_per_step is not None:
            return self.max_tokens_per_step
        return CUDA_TOKENS_PER_STEP if device_type == "cuda" else CPU_TOKENS_PER_STEP

    def prefill_tokens(self, device_type: str) -> int:
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return self.tokens_per_step(device_type) if device_type == "cuda" else CPU_PREFILL_TOKENS


@dataclass(frozen=True)
class TargetWorkerConfig:
    """``outrider serve target``."""

    service: ServiceConfig = ServiceConfig(port=DEFAULT_PORTS["target"])
    model: str | None = None
    """target model: embedded name, directory or hub id (default: smollm2-135m-instruct)"""
    engine: EngineConfig = EngineConfig()
    limits: WorkerLimits = WorkerLimits()
    trust_remote_code: bool = False
    """allow model code from the checkpoint"""


@dataclass(frozen=True)
class DraftWorkerConfig:
    """``outrider serve draft``."""

    service: ServiceConfig = ServiceConfig(port=DEFAULT_PORTS["draft"])
    drafter: str | None = field(
        default=None, metadata={"metavar": "{" + ",".join(MODEL_DRAFTERS) + "}"}
    )
    """model (a small model), int4 (the checkpoint in 4 bits), gguf (a GGUF file on
    llama.cpp, on the CPU), early-exit, or eagle (an EAGLE-3 head reading the target's hidden
    states) (default: gguf if --model is a .gguf file, model if it is another model, else
    int4); prompt lookup needs no draft worker: it runs in the coordinator (its
    --prompt-lookup)"""
    model: str | None = None
    """draft model, or the checkpoint the int4 drafter quantizes or the early-exit drafter
    cuts, or the target whose embeddings an EAGLE head reads; for gguf a .gguf file, a
    directory holding one, or an embedded model, whose GGUF its fetch kept (default: the
    default model)"""
    head: str | None = None
    """the EAGLE-3 head's directory (EAGLE's or speculators' layout) for --drafter eagle
    (default: the head shipped for --model, if one is)"""
    engine: EngineConfig = EngineConfig()
    limits: WorkerLimits = WorkerLimits()
    draft_layers: int | None = None
    """layers kept by the early-exit drafter"""
    int4_group_size: int = DEFAULT_INT4_GROUP_SIZE
    """weights sharing a scale and zero in the int4 drafter: 32, 64, 128 or 256"""
    max_draft_tokens: int = 16
    """largest K a round may ask for"""
    trust_remote_code: bool = False
    """allow model code from the checkpoint"""

    def __post_init__(self) -> None:
        if self.drafter == "prompt-lookup":
            raise ValueError(
                "--drafter prompt-lookup: prompt lookup runs in the coordinator, with no draft "
                "worker: start the coordinator with --prompt-lookup instead of --draft"
            )
        if self.drafter is not None and self.drafter not in MODEL_DRAFTERS:
            raise ValueError(f"--drafter {self.drafter}: use one of {', '.join(MODEL_DRAFTERS)}")
        if self.drafter == "early-exit" and not self.draft_layers:
            raise ValueError("--drafter early-exit needs --draft-layers L (L >= 1)")
        if self.drafter != "early-exit" and self.draft_layers is not None:
            raise ValueError("--draft-layers only applies to --drafter early-exit")
        if self.drafter != "eagle" and self.head is not None:
            raise ValueError("--head only applies to --drafter eagle")
        if self.drafter_kind == "gguf":
            if self.engine.device not in ("auto", "cpu"):
                raise ValueError(
                    f"--device {self.engine.device}: the gguf drafter runs on the CPU (llama.cpp); "
                    "drop --device or give --device cpu"
                )
            if self.engine.tensor_parallel_size != 1:
                raise ValueError(
                    "--tensor-parallel-size: the gguf drafter runs on one llama.cpp context; "
                    "give it --threads instead"
                )
        at_least(self.max_draft_tokens, 1, "--max-draft-tokens")
        if self.int4_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"--int4-group-size {self.int4_group_size}: use one of "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}"
            )

    @property
    def drafter_kind(self) -> str:
        """The drafter it runs: the one named, else gguf for a .gguf file, a
        model if another is named, else int4."""
        if self.drafter:
            return self.drafter
        if self.model:
            return "gguf" if self.model.endswith(".gguf") else "model"
        return "int4"


@dataclass(frozen=True)
class StructuredOutputLimits:
    """The largest structured output the coordinator accepts
    (docs/openai-api.md#limits); llguidance's own limits on each step bound
    the rest, in the coordinator's check as in the workers."""

    max_grammar_bytes: int = 512 * 1024
    """largest constraint a request may carry, in bytes of its text as the workers receive it:
    a JSON schema, regular expression, grammar or choice list, or the grammar of calls to the
    tools it requires; at this bound a compile takes up to about half a second on two CPU
    cores"""
    max_choices: int = 10_000
    """most strings a choice constraint (guided_choice) may list"""
    max_tools: int = 1_024
    """most tools a chat request may list"""

    def __post_init__(self) -> None:
        at_least(self.max_grammar_bytes, 1, "--max-grammar-bytes")
        at_least(self.max_choices, 1, "--max-choices")
        at_least(self.max_tools, 0, "--max-tools")


@dataclass(frozen=True)
class Recovery:
    """How the round loop rides out worker loss (``outrider.coordinator.workers.draft_link``,
    ``target_link``)."""

    draft_deadline_s: float = 5.0
    """a draft worker that has not answered a round within this many seconds is skipped: the
    stream goes on at K=0 and the draft session is reopened later"""
    draft_backoff_s: float = 0.5
    """first wait before a lost draft session is reopened (doubling, up to 8 s)"""
    target_attempts: int = 6
    """opens of a target session (with back-off) before a request fails"""
    verify_deadline_factor: float = 10.0
    """a verify counts as lost after this many times its measured cost (or the floor)"""
    verify_deadline_floor_s: float = 2.0
    """a target worker that gives no verdict within max(this, --verify-deadline-factor x the
    measured verify time) counts as lost (frozen or stalled): the session is reopened on
    another replica; opening a session is held to the same rule, from the measured prefill
    cost per token"""
    open_deadline_unmeasured_s: float = 60.0
    """how long opening a target session may take while no prefill has been measured"""

    def __post_init__(self) -> None:
        positive(self.draft_deadline_s, "--draft-deadline-s")
        positive(self.draft_backoff_s, "--draft-backoff-s")
        at_least(self.target_attempts, 1, "--target-attempts")
        positive(self.verify_deadline_factor, "--verify-deadline-factor")
        positive(self.verify_deadline_floor_s, "--verify-deadline-floor-s")
        positive(self.open_deadline_unmeasured_s, "--open-deadline-unmeasured-s")

    def verify_deadline_s(self, expected_s: float) -> float:
        return max(self.verify_deadline_floor_s, self.verify_deadline_factor * expected_s)

    def open_deadline_s(self, expected_s: float | None) -> float:
        if expected_s is None:
            return self.open_deadline_unmeasured_s
        return self.verify_deadline_s(expected_s)


@dataclass(frozen=True)
class CoordinatorConfig:
    """``outrider serve coordinator``."""

    service: ServiceConfig = ServiceConfig(port=DEFAULT_PORTS["coordinator"])
    target: tuple[str, ...] = field(default=(), metadata={"metavar": "ADDRESSES"})
    """target workers, comma-separated (required): HOST:PORT, or
    k8s://SERVICE[.NAMESPACE]:PORT to route to the ready pods of a Kubernetes Service's
    EndpointSlices (PORT: their port name or number; NAMESPACE: default the coordinator's
    own); sessions stay on the pod they opened on"""
    draft: tuple[str, ...] = field(default=(), metadata={"metavar": "ADDRESSES"})
    """draft workers, comma-separated, in the same forms as --target; none: target-only
    decoding (or --prompt-lookup)"""
    prompt_lookup: bool = False
    """draft by prompt lookup here, in the coordinator: the continuation of an earlier
    occurrence of each history's last n-gram, no model and no draft worker (instead of
    --draft)"""
    max_ngram: int = 3
    """longest n-gram --prompt-lookup matches"""
    suffix_decoding: bool = False
    """draft by suffix decoding here, in the coordinator: the continuation that most often
    followed the history's longest earlier match, in its own history or in the outputs of
    earlier requests, no model and no draft worker; with --draft, each round drafts by
    suffix decoding where its drafts pay more than the draft model's, else by the model"""
    suffix_cache_tokens: int = 1 << 20
    """tokens of earlier requests' outputs --suffix-decoding drafts from, the oldest output
    evicted first"""
    suffix_min_token_prob: float = 0.1
    """least estimated chance of a suffix decoding draft up to a token for it to draft that
    token"""
    suffix_max_spec_factor: float = 1.0
    """most tokens a suffix decoding draft takes per token of the history it matched"""
    routing: str = field(default="prefix", metadata={"choices": ROUTINGS})
    """how a new session chooses among a role's replicas: prefix (the one most likely to
    hold its prompt's prefix in its cache, within 1.25 times the mean load) or least-loaded"""
    tokenizer: str | None = None
    """tokenizer: embedded name, directory or hub id (default: the default model's)"""
    num_speculative_tokens: int | str = field(
        default="auto", metadata={"parse": num_speculative_tokens, "metavar": "K"}
    )
    """draft tokens per round (K) for requests that leave it unset; 'auto': choose K per
    round from acceptance and costs, 0 where drafting does not pay"""
    pipeline: bool = False
    """draft the next round while the target verifies this one (requests may override)"""
    max_num_speculative_tokens: int = 16
    """largest K a request may ask for"""
    default_max_new_tokens: int = 256
    """max_new_tokens when a request leaves it unset"""
    worker_wait_s: float = 300.0
    """how long to wait at start for a target (and draft) worker to answer; with k8s://
    addresses, for a ready endpoint"""
    worker_tls_ca: Path | None = None
    """reach the workers over TLS, trusting this CA (PEM)"""
    worker_tls_cert: Path | None = None
    """client certificate to present to workers that require one"""
    worker_tls_key: Path | None = None
    """private key of --worker-tls-cert"""
    auth_tokens_file: Path | None = None
    """require a bearer token from this file (one per line)"""
    http_port: int | None = None
    """serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/models) on --host at this port, with the same TLS and bearer tokens as gRPC (0: any
    free port, written to the --ready-file's name with .http-port; unset: no HTTP API)"""
    recovery: Recovery = Recovery()
    structured_output: StructuredOutputLimits = StructuredOutputLimits()

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError(
                "--target HOST:PORT is required (or OUTRIDER_TARGET): at least one target worker"
            )
        if not 0 <= self.default_num_speculative_tokens <= self.max_num_speculative_tokens:
            raise ValueError(
                f"--num-speculative-tokens {self.num_speculative_tokens}: must lie in "
                f"[0, --max-num-speculative-tokens {self.max_num_speculative_tokens}]"
            )
        at_least(self.default_max_new_tokens, 1, "--default-max-new-tokens")
        if self.prompt_lookup and self.draft:
            raise ValueError(
                "--prompt-lookup drafts in the coordinator: drop --draft, or drop "
                "--prompt-lookup to draft on the draft workers"
            )
        if self.prompt_lookup and self.suffix_decoding:
            raise ValueError("--prompt-lookup and --suffix-decoding: choose one drafter")
        at_least(self.suffix_cache_tokens, 1, "--suffix-cache-tokens")
        if not 0 <= self.suffix_min_token_prob <= 1:
            raise ValueError(
                f"--suffix-min-token-prob {self.suffix_min_token_prob}: a probability, 0 to 1"
            )
        positive(self.suffix_max_spec_factor, "--suffix-max-spec-factor")
        at_least(self.max_ngram, 1, "--max-ngram")
        if self.worker_tls_key is not None and self.worker_tls_cert is None:
            raise ValueError("--worker-tls-key needs --worker-tls-cert")
        if self.worker_tls_cert is not None and self.worker_tls_key is None:
            raise ValueError("--worker-tls-cert needs --worker-tls-key")
        port_number(self.http_port, "--http-port")
        if self.http_port not in (None, 0) and self.http_port in (
            self.service.port,
            self.service.metrics_port,
        ):
            raise ValueError(
                f"--http-port {self.http_port}: the HTTP port must differ from --port and "
                "--metrics-port"
            )

    @property
    def adaptive(self) -> bool:
        """Requests that leave K unset choose it per round (up to the maximum)."""
        return self.num_speculative_tokens == "auto"

    @property
    def default_num_speculative_tokens(self) -> int:
        """K for requests that leave it unset (0 with 'auto': the policy chooses)."""
        k = self.num_speculative_tokens
        return 0 if k == "auto" else int(k)

    @property
    def worker_tls(self) -> ClientTls | None:
        """How to reach TLS workers; None: plaintext."""
        if self.worker_tls_ca is None and self.worker_tls_cert is None:
            return None
        return ClientTls(self.worker_tls_ca, self.worker_tls_cert, self.worker_tls_key)


def http_port_file(ready_file: Path) -> Path:
    """Where a coordinator with ``--ready-file F`` writes its bound HTTP port."""
    return ready_file.with_suffix(".http-port")


__all__ = [
    "CoordinatorConfig",
    "DraftWorkerConfig",
    "EngineConfig",
    "Recovery",
    "ServiceConfig",
    "StructuredOutputLimits",
    "TargetWorkerConfig",
    "WorkerLimits",
]
