"""``outrider bench steps``: what one forward step costs, transformers' eager
step against the engine's batched step, eager and (on CUDA) replayed from a
CUDA graph (what each column times: :class:`outrider.bench.options.StepsOptions`).

Every time is the median of ``--repeats`` calls after two warm-up calls; a
row of ``ROWS×TOKENS`` is that many sessions feeding that many tokens each,
every session holding ``--context`` cached tokens. The engine's rows run in
one forward pass over the paged cache; transformers' would be that many
calls of one session each, so its time is the one call's times ``ROWS``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from outrider import model_specs
from outrider.bench.options import Shape, StepsOptions
from outrider.device import resolve_device, resolve_dtype
from outrider.engine import ops
from outrider.engine.causal_lm import load_causal_lm
from outrider.engine.gguf_runner import GgufRunner
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import PagedRunner
from outrider.engine.scheduler import Row

COLUMNS = {
    "hf_ms": "hf (rows calls)",
    "engine_ms": "engine",
    "graph_ms": "engine graph",
    "head_ms": "EAGLE-3 head",
    "gguf_ms": "gguf (llama.cpp)",
}
LINEAR_COLUMNS = {
    "f_linear_ms": "engine F.linear",
    "transposed_ms": "engine W @ x.T",
    "packed_ms": "engine packed",
}
"""With ``--linears``: the engine's step with every linear on one path."""


def load(model: str, dtype: torch.dtype, device: torch.device, overrides: dict) -> torch.nn.Module:
    """The model, or random weights in its shape (with ``overrides``, or
    from a directory holding only a config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model)
    if (path / "config.json").exists() and (overrides or not any(path.glob("*.safetensors"))):
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(path)
        for key, value in overrides.items():
            setattr(config, key, value)
        with device:  # initialised where it runs: an 8B shape takes minutes on the host
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return load_causal_lm(model, dtype=dtype, device=device, fast_small_batch=False)


def timed_in_turn(fn: Callable[[], None], repeats: int) -> dict[str, float]:
    """Median milliseconds of ``fn`` with the linears as tuned, all on
    ``F.linear``, all transposed and all packed, each call of the four in
    turn (after two warm-up calls each)."""
    paths: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "engine_ms": contextlib.nullcontext,
        "f_linear_ms": lambda: ops.linear_path("library"),
        "transposed_ms": lambda: ops.linear_path("transposed"),
        "packed_ms": lambda: ops.linear_path("packed"),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(repeats + 2):
        for name, path in paths.items():
            with path():
                started = time.perf_counter()
                fn()
                if i >= 2:
                    times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def timed(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` (after two warm-up calls)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def hf_step(model, tokens: int, context: int, device: torch.device) -> Callable[[], None]:
    """One transformers forward of ``tokens`` on a session of ``context``
    cached tokens (the cache cropped back after each)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(
        torch.zeros(1, context, dtype=torch.long, device=device),
        past_key_values=cache,
        use_cache=True,
    )
    ids = torch.ones(1, tokens, dtype=torch.long, device=device)

    def step():
        model(ids, past_key_values=cache, use_cache=True)
        cache.crop(-tokens)

    return step


def engine_step(
    runner: PagedRunner | GgufRunner, rows: int, tokens: int, context: int
) -> Callable[[], None]:
    """One step of ``rows`` sessions feeding ``tokens`` each (a CUDA graph's
    replay when the runner has one that covers it: that is checked); for an
    EAGLE-3 head, each token with a feature."""
    forward: Any = getattr(runner, "forward", None)
    width = getattr(forward, "hidden_size", 0)

    def hidden(n: int) -> torch.Tensor | None:
        return torch.zeros(n, width, dtype=forward.dtype, device=runner.device) if width else None

    caches = []
    for _ in range(rows):
        kv = runner.new_kv()
        kv.reserve(context + tokens)
        for start in range(0, context, 512):
            n = min(512, context - start)
            runner.execute([Row(kv, [1] * n, 0, hidden(n))])
        caches.append(kv)

    def step():
        for kv in caches:
            kv.reserve(context + tokens)  # as the engine does before every feed
        runner.execute([Row(kv, [1] * tokens, tokens, hidden(tokens)) for kv in caches])
        for kv in caches:
            kv.crop(context)

    graphs = getattr(runner, "graphs", None)
    uniform = [Row(kv, [1] * tokens, tokens) for kv in caches]
    if graphs is not None and graphs.bucket(uniform) is None:
        raise RuntimeError(f"no CUDA graph covers {rows}×{tokens} at context {context}")
    return step


Runners = tuple[PagedRunner, PagedRunner | None, PagedRunner | None, GgufRunner | None]


def runners(model: torch.nn.Module, options: StepsOptions, device: torch.device) -> Runners:
    """The engine's runner, eager, on CUDA one that replays CUDA graphs
    (captured for every shape), each on its own copy of the model; an
    EAGLE-3 head's for the model (None for a model outside the Llama family);
    and llama.cpp's of the model's GGUF (None where it has none, or llama.cpp
    is not installed)."""
    shapes = options.shapes
    blocks = sum(s.rows * -(-(options.context + s.tokens) // 16) for s in shapes) + 16
    eager = PagedRunner(LlamaForward(copy.deepcopy(model)), BlockPool(blocks, 16))
    eager.warm_up(max_rows=1, max_tokens_per_row=1)  # its linears' paths, as a worker's
    head = head_runner(model, options, blocks)
    gguf = gguf_runner(options, blocks * 16)
    if device.type != "cuda":
        return eager, None, head, gguf
    graphed = PagedRunner(
        LlamaForward(copy.deepcopy(model)), BlockPool(blocks, 16), cuda_graphs=True
    )
    started = time.perf_counter()
    graphed.warm_up(
        max_rows=max(s.rows for s in shapes),
        max_tokens_per_row=max(s.tokens for s in shapes),
        progress=not options.no_progress,
    )
    captured = len(graphed.graphs.graphs) if graphed.graphs is not None else 0
    print(
        f"captured {captured} CUDA graphs in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    return eager, graphed, head, gguf


def gguf_runner(options: StepsOptions, tokens: int) -> GgufRunner | None:
    """llama.cpp's runner of the model's GGUF (the gguf drafter's), with room
    for ``tokens``; None for random weights, a model without a GGUF, or no llama.cpp."""
    import importlib.util

    from outrider import gguf_files
    from outrider.engine.gguf_runner import GgufRunner

    if options.shape or importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        path = gguf_files.gguf_path(options.model)
    except (gguf_files.NotAGguf, model_specs.ModelNotFetchedError):
        return None
    sessions = min(256, sum(s.rows for s in options.shapes))  # every shape's, held to the end
    threads = options.threads or torch.get_num_threads()
    return GgufRunner.load(path, max_sessions=sessions, max_cached_tokens=tokens, threads=threads)


def head_runner(model: torch.nn.Module, options: StepsOptions, blocks: int) -> PagedRunner:
    """The runner of an EAGLE-3 head for ``model``: the one shipped for it
    (the default model's), else random weights in the shape
    ``outrider draft train`` gives one, with a draft vocabulary of
    ``--head-vocab`` tokens (a step costs the same whatever the weights)."""
    from outrider.eagle.forward import EagleForward
    from outrider.eagle.head import EagleHead, HeadConfig, load_head, shipped_head

    config: Any = model.config
    shipped = shipped_head(options.model) if options.model is None or not options.shape else None
    if shipped is not None:
        head = load_head(shipped, target_num_layers=config.num_hidden_layers)
    else:
        vocab = min(options.head_vocab, config.vocab_size)
        head = EagleHead(HeadConfig.for_target(config, draft_vocab_size=vocab))
    transformers_model: Any = model  # (a PreTrainedModel)
    embed: torch.Tensor = transformers_model.get_input_embeddings().weight
    forward = EagleForward(head, embed, dtype=embed.dtype, device=embed.device)
    runner = PagedRunner(forward, BlockPool(blocks, 16))
    runner.warm_up(max_rows=1, max_tokens_per_row=1)
    return runner


def measure_shape(
    model: torch.nn.Module,
    shape: Shape,
    runners: Runners,
    unit: float,
    options: StepsOptions,
) -> dict[str, Any]:
    """One row of the table: every column's milliseconds at ``shape`` (None: not measured)."""
    device = next(model.parameters()).device
    eager, graphed, head, gguf = runners
    row: dict[str, Any] = {"shape": str(shape)} | dict.fromkeys([*COLUMNS, *LINEAR_COLUMNS])
    if not options.no_hf or (shape.rows, shape.tokens) == (1, 1):
        one = unit if shape.tokens == 1 else None
        if one is None:
            one = timed(
                hf_step(model, shape.tokens, options.context, device), options.repeats, device
            )
        row["hf_ms"] = shape.rows * one
    step = engine_step(eager, shape.rows, shape.tokens, options.context)
    if options.linears and device.type == "cpu":
        row.update(timed_in_turn(step, options.repeats))
    else:
        row["engine_ms"] = timed(step, options.repeats, device)
    if graphed is not None:
        graph_step = engine_step(graphed, shape.rows, shape.tokens, options.context)
        row["graph_ms"] = timed(graph_step, options.repeats, device)
    if head is not None:
        head_step = engine_step(head, shape.rows, shape.tokens, options.context)
        row["head_ms"] = timed(head_step, options.repeats, device)
    if gguf is not None:
        row["gguf_ms"] = timed(
            engine_step(gguf, shape.rows, shape.tokens, options.context), options.repeats, device
        )
    return row


def print_table(rows: Sequence[dict[str, Any]], unit: float, title: str) -> None:
    """Each row's times in milliseconds and as multiples of transformers' 1-token step."""
    print(f"\n{title}; transformers' 1-token step = {unit:.2f} ms\n")
    columns = dict(COLUMNS)
    if all(row["gguf_ms"] is None for row in rows):
        del columns["gguf_ms"]  # no GGUF, or no llama.cpp
    if any(row["f_linear_ms"] is not None for row in rows):
        columns |= LINEAR_COLUMNS
    print(f"{'rows×tokens':>12} " + " ".join(f"{heading:>16}" for heading in columns.values()))
    for row in rows:
        cells = [
            f"{row[k]:8.2f} ms {row[k] / unit:4.2f}×" if row[k] is not None else f"{'-':>16}"
            for k in columns
        ]
        print(f"{row['shape']:>12} " + " ".join(f"{c:>16}" for c in cells))


def main(options: StepsOptions) -> int:
    """Loads the model, times every shape, prints the table (and writes the JSON)."""
    from tqdm import tqdm

    if options.threads:
        torch.set_num_threads(options.threads)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    name = options.model or str(model_specs.model_path(model_specs.DEFAULT_MODEL))
    overrides = dict(options.shape)
    model = load(name, dtype, device, overrides)
    with torch.inference_mode():
        both = runners(model, options, device)
        unit = timed(hf_step(model, 1, options.context, device), options.repeats, device)
        shapes = tqdm(options.shapes, desc="shapes", unit="shape", disable=options.no_progress)
        rows = [measure_shape(model, shape, both, unit, options) for shape in shapes]
    dtype_name = str(dtype).removeprefix("torch.")
    print_table(rows, unit, f"{name} on {device} in {dtype_name}, context {options.context}")
    if options.json is not None:
        report: dict[str, Any] = dict(model=name, overrides=overrides, device=str(device))
        report |= dict(dtype=str(dtype), context=options.context, hf_unit_ms=unit, rows=rows)
        options.json.write_text(json.dumps(report, indent=2))
    return 0
