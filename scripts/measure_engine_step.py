"""What one forward step costs: transformers' eager step against the
engine's batched step, eager and (on CUDA) replayed from a CUDA graph.

For each shape ``ROWS×TOKENS`` (sessions × tokens per session, every
session holding ``--context`` cached tokens) it times, median of
``--repeats``:

* ``hf`` — transformers' forward with a ``DynamicCache``, one session
  (the rows of a batch would be that many such calls);
* ``engine`` — the worker's runner (``outrider.engine``): all rows in one
  forward pass over the paged cache;
* ``graph`` — the same step replayed from a captured CUDA graph (CUDA only);
* with ``--linears`` (CPU), the engine's step with every linear on
  ``F.linear``, with every small batch as ``(W @ x.T).T``, and with every
  one on oneDNN's packed weights, each call of the four taking turns
  (``outrider/engine/ops.py`` chose one per count of rows at start, as a
  worker does),

and prints each also as a multiple of transformers' single-token step.
The model is a real one (default: the default model, fetched by ``outrider
models fetch``), or random weights in its shape with ``--shape`` overrides
(or from a directory holding only a config).

    python scripts/measure_engine_step.py --device cuda --shapes 1x1,1x5,8x5,32x5,64x5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from outrider import models  # noqa: E402
from outrider.device import resolve_device, resolve_dtype  # noqa: E402
from outrider.engine import ops  # noqa: E402
from outrider.engine.kv_cache import BlockPool  # noqa: E402
from outrider.engine.llama import LlamaForward  # noqa: E402
from outrider.engine.loading import load_causal_lm  # noqa: E402
from outrider.engine.runner import PagedRunner  # noqa: E402
from outrider.engine.scheduler import Row  # noqa: E402


def load(model: str, dtype: torch.dtype, device: torch.device, overrides: dict) -> torch.nn.Module:
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


def timed_in_turn(fn, repeats: int) -> dict[str, float]:
    """Median milliseconds of ``fn`` with the linears as tuned, all on
    ``F.linear``, all transposed and all packed, each call of the four in
    turn (after two warm-up calls each)."""
    paths = {
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


def timed(fn, repeats: int, device: torch.device) -> float:
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


def hf_step(model, tokens: int, context: int, device: torch.device):
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


def engine_step(runner: PagedRunner, rows: int, tokens: int, context: int):
    """One step of ``rows`` sessions feeding ``tokens`` each (a CUDA graph's
    replay when the runner has one that covers it: that is checked)."""
    caches = []
    for _ in range(rows):
        kv = runner.new_kv()
        kv.reserve(context + tokens)
        for start in range(0, context, 512):
            runner.execute([Row(kv, [1] * min(512, context - start), 0)])
        caches.append(kv)

    def step():
        for kv in caches:
            kv.reserve(context + tokens)  # as the engine does before every feed
        runner.execute([Row(kv, [1] * tokens, tokens) for kv in caches])
        for kv in caches:
            kv.crop(context)

    if (
        runner.graphs is not None
        and runner.graphs.bucket([Row(kv, [1] * tokens, tokens) for kv in caches]) is None
    ):
        raise RuntimeError(f"no CUDA graph covers {rows}×{tokens} at context {context}")
    return step


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default=str(models.model_path(models.DEFAULT_MODEL)),
        help="model, or a config directory (random weights) (default: %(default)s)",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="random weights in the model's shape with this config value overridden, e.g. "
        "hidden_size=2048 (repeatable)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on the CPU) or a dtype"
    )
    parser.add_argument(
        "--shapes",
        default="1x1,1x5,8x1,8x5",
        help="ROWSxTOKENS, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--context", type=int, default=512, help="cached tokens per session (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=20, help="timed calls per measurement (default: %(default)s)"
    )
    parser.add_argument("--threads", type=int, help="torch threads (CPU)")
    parser.add_argument(
        "--no-hf", action="store_true", help="skip transformers' steps but the 1×1 unit"
    )
    parser.add_argument(
        "--linears",
        action="store_true",
        help="CPU: also the engine's step with every linear on F.linear, with every small "
        "batch transposed and with every one packed, taking turns with the tuned choice",
    )
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.shape)}
    model = load(args.model, dtype, device, overrides)
    rows_needed = sum(r * -(-(args.context + t) // 16) for r, t in shapes)
    with torch.inference_mode():
        eager = PagedRunner(LlamaForward(copy.deepcopy(model)), BlockPool(rows_needed + 16, 16))
        eager.warm_up(max_rows=1, max_tokens_per_row=1)  # its linears' paths, as a worker's
        graphed = None
        if device.type == "cuda":
            graphed = PagedRunner(
                LlamaForward(copy.deepcopy(model)),
                BlockPool(rows_needed + 16, 16),
                cuda_graphs=True,
            )
            started = time.perf_counter()
            graphed.warm_up(
                max_rows=max(r for r, _ in shapes),
                max_tokens_per_row=max(t for _, t in shapes),
                progress=True,
            )
            print(
                f"captured {len(graphed.graphs.graphs)} CUDA graphs "
                f"in {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
            )
        unit = timed(hf_step(model, 1, args.context, device), args.repeats, device)
        results = []
        for rows, tokens in tqdm(shapes, desc="shapes", unit="shape"):
            row = {"shape": f"{rows}x{tokens}", "hf_ms": None, "engine_ms": None, "graph_ms": None}
            row |= {"f_linear_ms": None, "transposed_ms": None, "packed_ms": None}
            if not args.no_hf or (rows, tokens) == (1, 1):
                row["hf_ms"] = rows * (
                    unit
                    if tokens == 1
                    else timed(hf_step(model, tokens, args.context, device), args.repeats, device)
                )
            step = engine_step(eager, rows, tokens, args.context)
            if args.linears and device.type == "cpu":
                row.update(timed_in_turn(step, args.repeats))
            else:
                row["engine_ms"] = timed(step, args.repeats, device)
            if graphed is not None:
                row["graph_ms"] = timed(
                    engine_step(graphed, rows, tokens, args.context), args.repeats, device
                )
            results.append(row)
    print(
        f"\n{args.model} on {device} in {str(dtype).removeprefix('torch.')}, "
        f"context {args.context}; "
        f"transformers' 1-token step = {unit:.2f} ms\n"
    )
    columns = {"hf_ms": "hf (rows calls)", "engine_ms": "engine", "graph_ms": "engine graph"}
    if any(row["f_linear_ms"] is not None for row in results):
        columns |= {
            "f_linear_ms": "engine F.linear",
            "transposed_ms": "engine W @ x.T",
            "packed_ms": "engine packed",
        }
    print(f"{'rows×tokens':>12} " + " ".join(f"{title:>16}" for title in columns.values()))
    for row in results:
        cells = [
            f"{row[k]:8.2f} ms {row[k] / unit:4.2f}×" if row[k] is not None else f"{'-':>16}"
            for k in columns
        ]
        print(f"{row['shape']:>12} " + " ".join(f"{c:>16}" for c in cells))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "overrides": overrides,
                    "device": str(device),
                    "dtype": str(dtype),
                    "context": args.context,
                    "hf_unit_ms": unit,
                    "rows": results,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
