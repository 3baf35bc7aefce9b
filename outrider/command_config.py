"""The local commands' configuration: ``outrider up`` and ``outrider demo``
(the three services on this machine, :class:`StackConfig`, and the drafter
they run when none is named) and ``outrider generate``. Their flags read no
``OUTRIDER_*`` variable, except ``--device`` (the workers' own); each field
is a flag as in :mod:`outrider.config`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from outrider.config import (
    DEFAULT_PORTS,
    LOG_LEVELS,
    CoordinatorConfig,
    EngineConfig,
    at_least,
    existing_file,
    num_speculative_tokens,
    port_number,
)
from outrider.device import check_device, check_dtype
from outrider.drafters import COORDINATOR_DRAFTERS, DRAFTERS
from outrider.sampling_params import UINT64_MAX, Verification

DEFAULT_DRAFTERS = {"cpu": "gguf", "cuda": "prompt-lookup"}
"""The drafter ``outrider up`` runs when none is named (nor a draft model),
by device type (docs/benchmark.md#the-drafters): on the CPU a step
reads weights, so the target's own 4-bit GGUF on llama.cpp is cheap and
agrees (where llama.cpp is not installed, or the target has no GGUF:
``FALLBACK_CPU_DRAFTER``); on CUDA the default model's step is
launch-bound, so a 4-bit copy costs about a target step."""
FALLBACK_CPU_DRAFTER = "int4"
"""The CPU default where the gguf drafter cannot run: the target's
checkpoint in 4 bits, on torch."""
DEMO_PROMPT = "Explain in a few sentences why the sky is blue."


def default_drafter(
    device: str, *, draft_model: str | None = None, target_model: str | None = None
) -> str:
    """``gguf`` for a ``.gguf`` draft model, ``model`` for another, else the
    default for ``device``'s type (``auto``: as resolved) — on the CPU the
    gguf drafter where llama.cpp is installed and ``target_model`` has a GGUF."""
    if draft_model:
        return "gguf" if draft_model.endswith(".gguf") else "model"
    from outrider.device import resolve_device

    drafter = DEFAULT_DRAFTERS.get(resolve_device(device).type, "prompt-lookup")
    if drafter == "gguf" and not _gguf_runs(target_model):
        return FALLBACK_CPU_DRAFTER
    return drafter


def _gguf_runs(target_model: str | None) -> bool:
    """Whether llama.cpp is installed and the target names a GGUF (or is an
    embedded model not yet fetched, whose fetch keeps one)."""
    import importlib.util

    from outrider import gguf_files, model_specs

    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        gguf_files.gguf_path(target_model)
    except model_specs.ModelNotFetchedError:
        return True
    except gguf_files.NotAGguf:
        return False
    return True


@dataclass(frozen=True)
class StackConfig:
    """The three services ``outrider up`` and ``outrider demo`` start on this
    machine (``outrider.stack``), each option passed on to the flags of the
    services' ``outrider serve``."""

    target_model: str | None = None
    """target model: embedded name, directory or hub id (default: smollm2-135m-instruct)"""
    draft_model: str | None = None
    """draft model sharing the target's tokenizer (implies --drafter model, or --drafter gguf for
    a .gguf file)"""
    drafter: str | None = field(default=None, metadata={"choices": tuple(DRAFTERS)})
    """drafter kind: model, int4 (the target in 4 bits), gguf (the target's GGUF on llama.cpp,
    on the CPU), prompt-lookup, suffix, early-exit or eagle (an EAGLE-3 head) (default: gguf
    on the CPU, or int4 where llama.cpp is not installed; prompt-lookup on CUDA)"""
    draft_layers: int | None = None
    """layers kept by the early-exit drafter"""
    head: str | None = None
    """the EAGLE-3 head's directory for --drafter eagle (default: the one shipped for the
    target)"""
    device: str = field(
        default=EngineConfig.device,
        metadata={"parse": check_device, "metavar": "DEVICE", "env": True},
    )
    """where both workers run their models: auto, cpu, cuda or cuda:N"""
    dtype: str = field(default=EngineConfig.dtype, metadata={"parse": check_dtype})
    """dtype of the target (auto: bfloat16 on CUDA, float32 on the CPU)"""
    draft_dtype: str = field(default=EngineConfig.dtype, metadata={"parse": check_dtype})
    """dtype of the draft model (auto: as the target's default)"""
    k: int | str = field(
        default=CoordinatorConfig.num_speculative_tokens,
        metadata={"parse": num_speculative_tokens, "metavar": "K"},
    )
    """default draft tokens per round, or 'auto' (adaptive K: 0 wherever drafting does not pay)"""
    pipeline: bool = False
    """draft the next round while the target verifies this one (requests may override)"""
    suffix_decoding: bool = False
    """also draft by suffix decoding in the coordinator, beside a drafter that runs a model:
    each round drafts by whichever pays (--drafter suffix drafts by it alone)"""
    threads: int | None = None
    """torch threads per worker (default: all cores)"""
    enable_prefix_caching: bool | None = None
    """both workers keep the KV of prefixes their sessions computed, shared by later
    sessions (default: on)"""
    target_tp: int = field(default=1, metadata={"metavar": "N"})
    """tensor-parallel size of the target worker: its model split over N ranks (GPUs, or
    processes on the CPU)"""
    draft_tp: int = field(default=1, metadata={"metavar": "N"})
    """tensor-parallel size of the draft worker: its model split over N ranks (GPUs, or
    processes on the CPU)"""
    log_level: str = field(default="warning", metadata={"choices": LOG_LEVELS})
    """log level of the three services"""

    def __post_init__(self) -> None:
        if self.drafter == "early-exit" and not self.draft_layers:
            raise ValueError("--drafter early-exit needs --draft-layers L")
        if self.suffix_decoding and self.drafter in COORDINATOR_DRAFTERS:
            raise ValueError(
                f"--suffix-decoding goes beside a drafter that runs a model, not "
                f"--drafter {self.drafter} (--drafter suffix drafts by suffix decoding alone)"
            )
        at_least(self.target_tp, 1, "--target-tp")
        at_least(self.draft_tp, 1, "--draft-tp")


@dataclass(frozen=True)
class UpConfig:
    """``outrider up``: the stack, serving until Ctrl-C."""

    stack: StackConfig = StackConfig()
    port: int = DEFAULT_PORTS["coordinator"]
    """coordinator port (0: any free port)"""
    http_port: int | None = None
    """serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) on this
    port too (0: any free port), printed at start (default: gRPC only)"""
    metrics_port: int | None = None
    """serve the coordinator's Prometheus metrics at /metrics on this port (0: any free port)
    and each worker's on a free port, all printed at start (default: no metrics)"""

    def __post_init__(self) -> None:
        port_number(self.port, "--port")
        port_number(self.http_port, "--http-port")
        port_number(self.metrics_port, "--metrics-port")


@dataclass(frozen=True)
class DemoConfig:
    """``outrider demo``: the stack, one chat answer streamed and its statistics, then stop."""

    stack: StackConfig = StackConfig()
    prompt: str = DEMO_PROMPT
    """the chat message to send"""
    max_new_tokens: int = 96
    """most tokens to generate"""

    def __post_init__(self) -> None:
        at_least(self.max_new_tokens, 0, "--max-new-tokens")


@dataclass(frozen=True)
class GenerateConfig:
    """``outrider generate``: one request to a coordinator (``outrider.client``)."""

    prompt: str = field(metadata={"positional": True})
    """the prompt text (a user message with --chat)"""
    address: str = f"127.0.0.1:{DEFAULT_PORTS['coordinator']}"
    """coordinator HOST:PORT"""
    chat: bool = False
    """send the prompt as a user chat message (the target's chat template)"""
    max_new_tokens: int | None = None
    """most tokens to generate (default: the server's)"""
    k: int | str | None = field(
        default=None, metadata={"parse": num_speculative_tokens, "metavar": "K"}
    )
    """draft tokens per round (0: target only; 'auto': adaptive; default: the server's)"""
    pipeline: bool | None = None
    """draft the next round while the target verifies this one, or not (default: the
    server's)"""
    stop: tuple[str, ...] = field(default=(), metadata={"repeatable": True})
    """stop string (repeatable)"""
    temperature: float = 0.0
    """sampling temperature (0: greedy)"""
    top_k: int = 0
    """keep the k most likely tokens (0: off)"""
    top_p: float | None = None
    """nucleus sampling mass in (0, 1] (default: off)"""
    min_p: float = 0.0
    """drop tokens below min-p times the top probability"""
    seed: int | None = None
    """seed of the random draws (default: a fresh one, reported in the stats)"""
    verification: str | None = field(
        default=None, metadata={"choices": tuple(v.value for v in Verification)}
    )
    """how drafts are verified when sampling (default: rejection)"""
    json: bool = False
    """print one JSON object with text, token ids, finish reason and stats"""
    timeout: float | None = field(default=None, metadata={"metavar": "SECONDS"})
    """deadline in seconds"""
    tls_ca: Path | None = None
    """connect over TLS, trusting this CA (PEM)"""
    token_file: Path | None = None
    """send the bearer token in this file"""

    def __post_init__(self) -> None:
        # What the request's unsigned fields cannot hold, and files that are
        # not there; the server validates the rest.
        if self.max_new_tokens is not None:
            at_least(self.max_new_tokens, 0, "--max-new-tokens")
        at_least(self.top_k, 0, "--top-k")
        if self.seed is not None and not 0 <= self.seed <= UINT64_MAX:
            raise ValueError(f"--seed {self.seed}: must lie in [0, 2^64)")
        existing_file(self.tls_ca, "--tls-ca")
        existing_file(self.token_file, "--token-file")
