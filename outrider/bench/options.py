"""The options of ``outrider bench``: one frozen dataclass, whose fields are
its flags (``outrider.flags``: each field's name, type, default and the
docstring under it make the flag and its help).

Importing this module imports none of the benchmark's runs, so that building
the CLI's parser stays light. A bad value is a ValueError naming its flag,
raised as the options are built (``outrider bench`` prints it and exits 1).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outrider.bench.configs import parse_config_globs, parse_drafter, parse_k_list
from outrider.bench.prompts import DEFAULT_PROMPT_SET, PROMPT_SETS, prompt_file
from outrider.device import DTYPES, check_device

TARGET_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The dtypes of the target the bench compares (in the target worker and for Hugging Face)."""


def parse_concurrency_list(raw: str) -> list[int]:
    """``64,8,32`` → [8, 32, 64]: the levels listed, sorted (the run adds
    N = 1, the reference for outputs and speedup, where it is not among
    them)."""
    try:
        levels = {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        raise ValueError(
            f"--concurrency {raw!r}: give comma-separated integers, e.g. 1,8,32,64"
        ) from None
    if not levels or any(n < 1 for n in levels):
        raise ValueError(
            f"--concurrency {raw!r}: give one or more numbers of streams, each at least 1"
        )
    return sorted(levels)


def _as_tuple(parse: Callable[[str], list[int]]) -> Callable[[str], tuple[int, ...]]:
    """``parse``, its list as a tuple (a frozen field's)."""
    return lambda raw: tuple(parse(raw))


@dataclass(frozen=True)
class BenchOptions:
    """benchmark Outrider against Hugging Face generate and assisted generation, in one run

    Runs a prompt set through every configuration in one run, interleaved (for each prompt, every
    configuration in turn): plain Hugging Face generate (hf-generate, the baseline), Outrider
    target-only (outrider-k0), Outrider with each drafter and K and with adaptive K, each
    synchronous and pipelined (prompt lookup: synchronous only), and Hugging Face assisted
    generation on the same models. Greedy decoding; outputs are checked to be identical. Reports
    tokens/s, speedup (tokens/s ÷ hf-generate's), acceptance rate, mean acceptance length,
    accepted per position, the per-round time split and the analytic bound E·t_target/T
    (docs/design.md#cost-model), per configuration and per prompt category. Starts its own
    services (one target worker, and a coordinator per drafter, with a draft worker for each
    drafter but prompt lookup, which drafts in the coordinator). With --concurrency it measures
    throughput and latency with N streams at once instead.
    """

    prompts: tuple[str, ...] = field(
        default=(DEFAULT_PROMPT_SET,), metadata={"repeatable": True, "metavar": "SET|FILE"}
    )
    """a shipped prompt set (mt-bench: the 80 MT-Bench questions; humaneval: the 164 HumanEval
    prompts; long-context: 8 prompts of ~1k and ~3k tokens built from those; describe: 20
    requests for a JSON description, whose schema is outrider/bench/data/describe/
    describe.schema.json; agentic: 8 coding sessions of 4 turns over HumanEval, each turn
    resending the last answer's code with a change) or a JSONL file,
    rows with `turns` (the first is used) or `prompt`, and optionally `category` (else the file
    stem); each is sent as one user chat message; repeatable"""
    limit: int | None = None
    """prompts per file, spread evenly over the file (default: all)"""
    max_new_tokens: int = 64
    """tokens to generate per prompt"""
    k: tuple[int, ...] = field(
        default=(4,), metadata={"parse": _as_tuple(parse_k_list), "late": True, "metavar": "LIST"}
    )
    """fixed K values, comma-separated; K=0 always runs"""
    drafters: tuple[str, ...] = field(
        default=("prompt-lookup", "int4"), metadata={"metavar": "LIST"}
    )
    """drafters, comma-separated: prompt-lookup, suffix (suffix decoding; no HF peer), int4 (the
    target with 4-bit weights), gguf (the GGUF the target came from, on llama.cpp on the CPU;
    no HF peer) or gguf:FILE (another GGUF file), bf16 (the target itself in bfloat16),
    early-exit-L (the target's first L layers; no HF peer), eagle (the EAGLE-3 head shipped
    for the target; no HF peer), or suffix+D (suffix decoding beside model drafter D, e.g.
    suffix+int4: each round drafts by whichever pays; no HF peer)"""
    no_hf: bool = False
    """skip the Hugging Face configurations (speedup is then vs outrider-k0)"""
    no_llama_cpp: bool = False
    """skip llama.cpp's own configurations (llama.cpp: the GGUF the target came from, run by
    llama.cpp; llama.cpp-prompt-lookup: with its prompt-lookup speculation), which run where
    llama-cpp-python is installed and the target has a GGUF, one request at a time; their
    tokens/s stands beside Hugging Face's, their outputs are not compared (another engine's
    numerics)"""
    no_adaptive: bool = False
    """skip the adaptive-K configurations"""
    no_pipelined: bool = False
    """skip the pipelined configurations (outrider-<drafter>-k<K>-pipelined,
    outrider-<drafter>-adaptive-pipelined: the draft drafts the next round while the target
    verifies this one); the others always run synchronous"""
    no_sampled: bool = False
    """skip the sampled twins: outrider-k0-t1 and outrider-<drafter>-adaptive-t1, at temperature
    1 with rejection sampling (OpenAI's default) and a seed per prompt, their outputs unchecked
    (the same distribution as target-only, other draws)"""
    target_model: str | None = None
    """target model: embedded name, directory or hub id (default: smollm2-135m-instruct)"""
    dtype: str = field(default="float32", metadata={"choices": TARGET_DTYPES})
    """dtype of the target, in the target worker and for Hugging Face"""
    device: str = field(default="auto", metadata={"parse": check_device, "metavar": "DEVICE"})
    """where both workers and the Hugging Face configurations run: auto (the first CUDA device if
    there is one, else the CPU), cpu, cuda or cuda:N"""
    json_schema: Path | None = field(default=None, metadata={"metavar": "FILE"})
    """constrain every Outrider request's output to the JSON schema in FILE (structured
    output; one request at a time only); Hugging Face's configurations then do not run (they
    take no constraint), and the outputs are checked against outrider-k0's"""
    ignore_eos: bool = False
    """fixed-length runs: every request generates exactly --max-new-tokens, past end-of-sequence
    tokens (Outrider's ignore_eos; Hugging Face with no end-of-sequence token, which does the same
    without masking it, so the outputs stay comparable)"""
    concurrency: tuple[int, ...] | None = field(
        default=None,
        metadata={"parse": _as_tuple(parse_concurrency_list), "late": True, "metavar": "LIST"},
    )
    """throughput mode: for each N in the comma-separated list (e.g. 1,8,32,64; 1 always runs, as
    the reference for outputs and speedup: one batch, unless listed, then --repeat like the
    others), N streams at once, max(N, prompts) requests, taken in order from one queue, each
    stream sending its next as soon as its previous has ended. Reports per configuration and N
    total tokens/s, speedup over N=1, TTFT and inter-token latency p50/p99 (per chunk: Outrider
    streams a chunk per round; and per token). Peers: hf-generate on left-padded batches of N and
    transformers' continuous batching (hf-generate-batch); no assisted generation (it takes one
    sequence at a time)"""
    configs: tuple[str, ...] | None = field(
        default=None, metadata={"parse": parse_config_globs, "late": True, "metavar": "GLOBS"}
    )
    """run only the configurations whose names match one of these comma-separated shell-style
    globs (e.g. 'outrider-*-adaptive'), and the references hf-generate (unless --no-hf) and
    outrider-k0 (default: all); with --concurrency 8 --repeat R, a check of one configuration
    against outrider-k0 in pairs of batches, the order alternating (ABBA)"""
    repeat: int = field(default=1, metadata={"metavar": "R"})
    """run every configuration R times on each prompt (with --concurrency: R batches at each N),
    the order rotated or reversed each time, and report the median: of each prompt, the request of
    median wall time; with --concurrency, the batch of median tokens/s, and the median ratio to
    outrider-k0's batch of the same rotation. Every output is checked; ratios between
    configurations then hold against the machine's drift"""
    coordinators: int = 1
    """with --concurrency: N coordinator replicas per drafter, sharing the same workers, the
    streams spread round-robin over them (to see how many a load needs when one coordinator's CPU
    is the limit)"""
    threads: int | None = None
    """torch threads of this process and of each worker (default: all cores)"""
    draft_threads: int | None = None
    """threads of each draft worker (default, and 0: --threads); with --threads it splits the
    cores between the target and the draft, as on machines of their own"""
    target_tp: int = 1
    """tensor-parallel size of the target worker: its model split over N ranks (GPUs, or
    processes on the CPU)"""
    draft_tp: int = 1
    """tensor-parallel size of the draft worker: its model split over N ranks (GPUs, or processes
    on the CPU); prompt lookup runs no model"""
    json: Path | None = None
    """write the report as JSON (one object with a `configs` list; with --concurrency each has a
    `runs` list, one per N)"""
    plot: Path | None = field(default=None, metadata={"metavar": "FILE.png"})
    """plot speedup and acceptance by configuration and category; with --concurrency, tokens/s,
    TTFT and inter-token latency against N (needs matplotlib: outrider[bench])"""
    no_progress: bool = False
    """no progress bars"""
    log_level: str = field(default="warning", metadata={"metavar": "LEVEL"})
    """log level of the services"""

    def __post_init__(self) -> None:
        for path in self.prompt_files:
            if not path.is_file():
                shipped = ", ".join(PROMPT_SETS)
                raise ValueError(f"--prompts {path}: no such file (the shipped sets are {shipped})")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be at least 1")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if self.coordinators < 1:
            raise ValueError("--coordinators must be at least 1")
        if self.coordinators > 1 and not self.concurrency:
            raise ValueError(
                "--coordinators needs --concurrency (one request at a time needs one coordinator)"
            )
        if self.repeat < 1:
            raise ValueError("--repeat must be at least 1")
        for drafter in self.drafters:
            parse_drafter(drafter, target_model=None)
        if self.json_schema is not None:
            if not self.json_schema.is_file():
                raise ValueError(f"--json-schema {self.json_schema}: no such file")
            if self.concurrency:
                raise ValueError(
                    "--json-schema runs one request at a time: leave out --concurrency"
                )

    @property
    def prompt_files(self) -> tuple[Path, ...]:
        """The files of ``--prompts``, shipped sets by their names."""
        return tuple(prompt_file(p) for p in self.prompts)

    @property
    def hf(self) -> bool:
        return not self.no_hf and self.json_schema is None

    @property
    def llama_cpp(self) -> bool:
        return not self.no_llama_cpp and self.json_schema is None and not self.concurrency

    @property
    def adaptive(self) -> bool:
        return not self.no_adaptive

    @property
    def sampled(self) -> bool:
        """Adaptive K and target-only also run sampled (``-t1``)."""
        return self.adaptive and not self.no_sampled

    @property
    def pipelined(self) -> bool:
        """Each Outrider drafter configuration also runs with pipelined rounds (``-pipelined``)."""
        return not self.no_pipelined

    @property
    def progress(self) -> bool:
        return not self.no_progress

    @property
    def torch_threads(self) -> int:
        """``--threads``, or all cores."""
        return self.threads or os.cpu_count() or 1

    @property
    def levels(self) -> tuple[int, ...]:
        """The concurrency levels that run: those listed, and 1, the
        reference for outputs and speedup."""
        return tuple(sorted({1, *self.concurrency})) if self.concurrency else ()

    @property
    def reference_once(self) -> bool:
        """N = 1 runs once, whatever ``repeat``: it was not listed, and runs
        only as the reference."""
        return self.concurrency is not None and 1 not in self.concurrency


@dataclass(frozen=True)
class PoolOptions:
    """pool several runs' `--json` reports: adaptive K against fixed K, with 90% intervals

    On a shared machine one configuration's batches differ by up to a fifth from rotation to
    rotation, so one run decides a few percent either way. This pools the batches of several runs
    of `outrider bench --concurrency ... --json FILE` (each run's rotations in turn) and prints,
    for each drafter and concurrency, the adaptive configuration's mean tok/s over outrider-k0's
    and over the best fixed K's (K = 0 included, the best by its pooled mean), each with a 90%
    interval from a bootstrap over the rotations, resampled together for every configuration, as
    they ran.
    """

    reports: tuple[Path, ...] = field(default=(), metadata={"nargs": "+", "metavar": "FILE"})
    """`outrider bench --concurrency ... --json` reports"""
    resamples: int = 10_000
    """bootstrap resamples"""
    seed: int = 0
    """the bootstrap's seed"""


@dataclass(frozen=True)
class Shape:
    """A step's shape: ``rows`` sessions, each feeding ``tokens``."""

    rows: int
    tokens: int

    def __str__(self) -> str:
        return f"{self.rows}x{self.tokens}"


def parse_shapes(raw: str) -> tuple[Shape, ...]:
    """``1x1,8x5`` → the shapes, in the order given."""
    try:
        shapes = tuple(
            Shape(*(int(n) for n in part.strip().split("x", 1)))
            for part in raw.split(",")
            if part.strip()
        )
    except (TypeError, ValueError):
        shapes = ()
    if not shapes or any(s.rows < 1 or s.tokens < 1 for s in shapes):
        raise ValueError(f"{raw!r}: give ROWSxTOKENS, comma-separated, e.g. 1x1,8x5")
    return shapes


def parse_config_override(raw: str) -> tuple[str, Any]:
    """``hidden_size=2048`` → ("hidden_size", 2048): a model config's key and its JSON value."""
    key, equals, value = raw.partition("=")
    try:
        if key and equals:
            return key, json.loads(value)
    except ValueError:
        pass
    raise ValueError(f"{raw!r}: give KEY=VALUE, the value in JSON, e.g. hidden_size=2048")


@dataclass(frozen=True)
class StepsOptions:
    """what one forward step costs: transformers' eager step against the engine's batched step

    For each shape ROWSxTOKENS (sessions × tokens per session, every session holding --context
    cached tokens) it times, median of --repeats: hf, transformers' forward with a DynamicCache,
    one session (the rows of a batch would be that many such calls); engine, the worker's runner
    (outrider.engine): all rows in one forward pass over the paged cache; graph, the same step
    replayed from a captured CUDA graph (CUDA only); EAGLE-3 head, the same step of a draft
    worker's head for the model (the shipped one, else random weights); gguf, the same step of
    the gguf drafter: the model's GGUF run by llama.cpp (where it is installed and the model has
    a GGUF: the embedded model's, or one in its directory); with --linears (CPU), the
    engine's step with every linear on F.linear, with every small batch as (W @ x.T).T, and with
    every one on oneDNN's packed weights, each call of the four taking turns
    (outrider/engine/ops.py chose one per count of rows at start, as a worker does). Each is
    printed also as a multiple of
    transformers' single-token step. The model is a real one (default: the default model, fetched
    by `outrider models fetch`), or random weights in its shape with --shape overrides (or from a
    directory holding only a config).
    """

    model: str | None = None
    """model, or a config directory (random weights) (default: the default model's directory)"""
    shape: tuple[tuple[str, Any], ...] = field(
        default=(),
        metadata={"repeatable": True, "parse": parse_config_override, "metavar": "KEY=VALUE"},
    )
    """random weights in the model's shape with this config value overridden, e.g.
    hidden_size=2048; repeatable"""
    device: str = field(default="auto", metadata={"parse": check_device, "metavar": "DEVICE"})
    """auto, cpu, cuda or cuda:N"""
    dtype: str = field(default="auto", metadata={"choices": DTYPES})
    """auto (bfloat16 on CUDA, float32 on the CPU) or a dtype"""
    shapes: tuple[Shape, ...] = field(
        default=parse_shapes("1x1,1x5,8x1,8x5"), metadata={"parse": parse_shapes, "metavar": "LIST"}
    )
    """ROWSxTOKENS, comma-separated"""
    context: int = 512
    """cached tokens per session"""
    repeats: int = 20
    """timed calls per measurement"""
    threads: int | None = None
    """torch threads (CPU)"""
    no_hf: bool = False
    """skip transformers' steps but the 1×1 unit"""
    head_vocab: int = 8192
    """draft vocabulary of the EAGLE-3 head timed beside the engine, for a model with no head
    shipped (random weights: a step costs the same)"""
    linears: bool = False
    """CPU: also the engine's step with every linear on F.linear, with every small batch
    transposed and with every one packed, taking turns with the tuned choice"""
    json: Path | None = None
    """also write the table as JSON"""
    no_progress: bool = False
    """no progress bars"""

    def __post_init__(self) -> None:
        for flag, value in (("--context", self.context), ("--repeats", self.repeats)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1")


@dataclass(frozen=True)
class HttpOptions:
    """time to first token and inter-token latency through the OpenAI HTTP API against gRPC

    Starts the three services (the coordinator with --http-port 0) with --threads 1 on a tiny
    random float32 Llama (the default model's tokenizer, its forward pass next to nothing, so what
    the APIs add shows), the draft an exact copy of the target: every draft is accepted, so every
    round streams K + 1 tokens. For each concurrency N it runs --repeats waves of N requests at
    once through each API in turn, the order rotating from wave to wave: gRPC (the asyncio SDK's
    stream), and HTTP (POST /v1/completions, stream: true) with two clients, httpx (which the
    openai package rides on) and a minimal HTTP/1.1 client on asyncio streams, which shows what the
    server adds without httpx's own cost. Every request sends the same token ids, greedy, K = 4,
    ignore_eos and --max-tokens tokens, so every API streams the same chunks (one a round): that is
    checked. Reports per API and N the time to first token (request sent → first chunk) and the
    inter-token latency (between consecutive chunks) at p50 and p99, and HTTP − gRPC at p50.
    Needs httpx (pip install httpx).
    """

    concurrency: tuple[int, ...] = field(
        default=(1, 16),
        metadata={"parse": _as_tuple(parse_concurrency_list), "metavar": "LIST"},
    )
    """N, the requests at once, comma-separated"""
    repeats: int = 30
    """waves of N requests per API"""
    max_tokens: int = 64
    """tokens per request"""
    model: str | None = None
    """a model to serve instead of the tiny random one (target and draft alike): embedded name,
    directory or hub id"""
    json: Path | None = None
    """also write the samples' quantiles as JSON"""
    no_progress: bool = False
    """no progress bar"""

    def __post_init__(self) -> None:
        for flag, value in (("--repeats", self.repeats), ("--max-tokens", self.max_tokens)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1")


@dataclass(frozen=True)
class MemoryOptions:
    """resident memory of each process of `outrider up`, after one chat generation

    Starts the services as `outrider up` does with the flags given after -- (the default model on
    this machine, by default), asks for one chat generation, and prints each service's resident
    memory (VmRSS in /proc/PID/status: Linux) and their total.
    """

    max_new_tokens: int = 64
    """tokens of the one chat generation"""
    up_flags: tuple[str, ...] = field(
        default=(), metadata={"nargs": argparse.REMAINDER, "metavar": "-- UP_FLAGS"}
    )
    """flags of `outrider up`, after -- (e.g. -- --drafter int4 --device cpu)"""


@dataclass(frozen=True)
class PrefixOptions:
    """prefix caching: time to first token and tokens/s with the cache on and off, and routing

    Starts the default model's target worker, a draft worker for --drafter (none for
    prompt-lookup) and a coordinator, once with both workers' prefix caches on and once off, and
    sends three chat workloads through the gRPC SDK, each turn resending the whole conversation:
    system (a ~1k-token system prompt, cached by one request first, in front of short MT-Bench
    questions), mt-bench (MT-Bench's two turns) and chat-4 (conversations of four MT-Bench
    questions of one category), each at every --concurrency. Reports per workload, N and cache
    setting the time to first token at p50 and p99 (and p50 of the turns that found a cached
    prefix), output tokens/s, the share of prompt tokens the target found cached, and TTFT p50
    on ÷ off; and whether the outputs were identical. --part routing instead starts two target
    replicas and a coordinator drafting by prompt lookup, sends one request per system prompt,
    then runs 16 streams of --routing-requests questions each behind one of 4 ~1k-token system
    prompts drawn at random, routed by prefix and by load: the prompt tokens found cached, TTFT,
    and the sessions each replica opened.
    """

    part: str = field(default="all", metadata={"choices": ("all", "cache", "routing")})
    """what to measure: the cache on and off (cache), prefix against least-loaded routing
    (routing), or both"""
    drafter: str = field(default="int4", metadata={"choices": ("int4", "prompt-lookup")})
    """the drafter of the cache runs (with adaptive K, the coordinator's default)"""
    concurrency: tuple[int, ...] = field(
        default=(1, 8),
        metadata={"parse": _as_tuple(parse_concurrency_list), "metavar": "LIST"},
    )
    """N, the conversations at once, comma-separated"""
    conversations: int = 8
    """conversations per workload"""
    max_tokens: int = 32
    """most tokens per answer"""
    routing_requests: int = 4
    """requests per stream in the routing runs"""
    routing_cache_tokens: int | None = None
    """--max-cached-tokens of the target replicas in the routing runs (default: sized from free
    memory)"""
    threads: int | None = None
    """torch threads per worker (default: all cores)"""
    json: Path | None = None
    """also write the figures as JSON"""
    no_progress: bool = False
    """no progress bar"""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--conversations", self.conversations),
            ("--max-tokens", self.max_tokens),
            ("--routing-requests", self.routing_requests),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1")
