"""``outrider bench`` itself: the services it starts, the whole run (its options:
:mod:`outrider.bench.options`)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from outrider.bench.concurrency.hf import hf_load_configs
from outrider.bench.concurrency.plot import plot as concurrency_plot
from outrider.bench.concurrency.render import render as concurrency_render
from outrider.bench.concurrency.report import build_report as build_concurrency_report
from outrider.bench.concurrency.run import run_concurrency
from outrider.bench.concurrency.services import Replicas, outrider_load_configs
from outrider.bench.configs import (
    Drafter,
    OutriderVariant,
    coordinators_of,
    outrider_variants,
    parse_drafter,
)
from outrider.bench.endpoints import OutriderEndpoint, outrider_configs
from outrider.bench.hf import HuggingFace
from outrider.bench.llama_cpp_peer import LlamaCpp, llama_cpp_peer
from outrider.bench.options import BenchOptions
from outrider.bench.plot import plot, pyplot
from outrider.bench.prompts import Prompt, chat_prompt_ids, load_prompts
from outrider.bench.render import render
from outrider.bench.report import build_report
from outrider.bench.runner import run_interleaved, selected, warm_up, without_ignored_options


def _variants(options: BenchOptions, drafters: Sequence[Drafter]) -> list[OutriderVariant]:
    """The Outrider configurations of the run."""
    return outrider_variants(
        [d.label for d in drafters] or [None],
        options.k,
        adaptive=options.adaptive,
        pipelined=options.pipelined,
        sampled=options.sampled,
    )


def _stack_args(
    options: BenchOptions, drafters: Sequence[Drafter], variants: Sequence[OutriderVariant]
) -> dict[str, Any]:
    common = ("--log-level", options.log_level)
    # No prefix cache: every configuration runs each prompt, and the ones
    # after the first would find it cached (outrider bench prefix measures it).
    workers = [
        *common, "--threads", str(options.torch_threads), "--device", options.device,
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    if (
        options.concurrency
    ):  # every stream holds a session on each worker, and one may linger as the next opens
        workers += ["--max-sessions", str(max(64, 2 * max(options.concurrency)))]
    max_k = str(max(16, *options.k))
    target = [*workers, "--dtype", options.dtype]
    if options.target_tp != 1:
        target += ["--tensor-parallel-size", str(options.target_tp)]
    coordinator = [*common, "--max-num-speculative-tokens", max_k]
    if options.target_model:
        target += ["--model", options.target_model]
        coordinator += ["--tokenizer", options.target_model]
    draft_threads = ["--threads", str(options.draft_threads)] if options.draft_threads else []
    drafts = {
        d.label: [*workers, *draft_threads, "--max-draft-tokens", max_k, *d.draft_args]
        for d in drafters
        if d.draft_args
    }
    # A model drafter runs in the target's dtype unless its flags say otherwise.
    for args in drafts.values():
        if "--dtype" not in args:
            args += ["--dtype", options.dtype]
        if options.draft_tp != 1:
            args += ["--tensor-parallel-size", str(options.draft_tp)]
    return dict(
        target_args=target,
        drafts=drafts,
        coordinator_drafts={d.label: d.coordinator_args for d in drafters if d.coordinator_args},
        coordinator_args=coordinator,
        coordinator_replicas=options.coordinators,
        coordinators=coordinators_of(variants),
    )


def run_bench(options: BenchOptions, out=None) -> dict[str, Any]:
    """Start the services, run every configuration on every prompt (at every
    concurrency), write and return the report."""
    import torch
    from transformers.utils import logging as hf_logging

    from outrider import model_specs
    from outrider.stack import start_shared_target_stack

    out = out or sys.stdout
    if options.plot is not None:
        pyplot()  # fail before an hour of measuring, not after
    started = time.time()
    prompts = [p for path in options.prompt_files for p in load_prompts(path, options.limit)]
    if not prompts:
        raise ValueError("no prompts: give --prompts FILE (JSONL rows with `turns` or `prompt`)")
    drafters = [parse_drafter(d, target_model=options.target_model) for d in options.drafters]
    model_dir = model_specs.resolve(options.target_model)
    torch.set_num_threads(options.torch_threads)
    hf_logging.set_verbosity_error()
    meta = _meta(options, model_dir, len(prompts), started)

    with ExitStack() as cleanup:
        variants = _variants(options, drafters)
        workers = sum(1 for d in drafters if d.draft_args)
        coordinators = len(coordinators_of(variants)) * options.coordinators
        services = f"{_count(workers, 'draft worker')} and {_count(coordinators, 'coordinator')}"
        print(f"Starting 1 target worker, {services} ...", file=sys.stderr, flush=True)
        stack = cleanup.enter_context(
            start_shared_target_stack(**_stack_args(options, drafters, variants))
        )
        hf = (
            HuggingFace(model_dir, options.dtype, options.device, ignore_eos=options.ignore_eos)
            if options.hf
            else None
        )
        if options.concurrency:
            report = _concurrency_report(options, stack, hf, variants, prompts, meta)
        else:
            report = _sequential_report(
                options, stack, hf, drafters, variants, prompts, meta, cleanup
            )

    report["elapsed_s"] = round(time.time() - started, 1)
    if options.concurrency:
        concurrency_render(report, out)
        runs = f"{len(report['configs'])} configurations × {len(options.levels)} concurrencies"
    else:
        render(report, out)
        runs = f"{len(report['configs'])} configurations"
    print(f"{len(prompts)} prompts × {runs} in {report['elapsed_s']:.0f} s", file=out)
    if options.json is not None:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    if options.plot is not None:
        (concurrency_plot if options.concurrency else plot)(report, options.plot)
    return report


def _sequential_report(
    options, stack, hf, drafters, variants, prompts, meta, cleanup
) -> dict[str, Any]:
    """One request at a time: for each prompt, every configuration in turn."""
    endpoints: dict[str | None, OutriderEndpoint] = {}
    for label, services in stack.coordinators.items():
        endpoint = OutriderEndpoint(
            services[0].address,
            ignore_eos=options.ignore_eos,
            json_schema=options.json_schema.read_text() if options.json_schema else None,
        )
        cleanup.callback(endpoint.close)
        endpoints[label] = endpoint
    configs = outrider_configs(endpoints, variants)
    if hf is not None:
        generate, *assisted = hf.configs(drafters, options.k)
        configs = [generate, *configs, *assisted]
    if (peer := _llama_cpp(options, prompts)) is not None:
        configs += peer.configs()
    configs = selected(configs, options.configs or ())
    warm = warm_up(configs, prompts[0], min(options.max_new_tokens, 16), progress=options.progress)
    configs = without_ignored_options(configs, warm)
    results = run_interleaved(
        configs, prompts, options.max_new_tokens, repeat=options.repeat, progress=options.progress
    )
    return build_report(configs, prompts, results, meta)


def _llama_cpp(options: BenchOptions, prompts: Sequence[Prompt]) -> LlamaCpp | None:
    """llama.cpp as a peer (``outrider.bench.llama_cpp_peer``), where it runs."""
    if not options.llama_cpp:
        return None
    from outrider import model_specs

    tokenizer = model_specs.load_tokenizer(options.target_model)
    eos = model_specs.eos_token_ids(tokenizer, model_specs.generation_config(options.target_model))
    return llama_cpp_peer(
        options.target_model,
        prompts=prompts,
        max_new_tokens=options.max_new_tokens,
        threads=options.torch_threads,
        prompt_ids=lambda prompt: chat_prompt_ids(tokenizer, prompt),
        eos_token_ids=eos,
        ignore_eos=options.ignore_eos,
    )


def _concurrency_report(options, stack, hf, variants, prompts, meta) -> dict[str, Any]:
    """N streams at once, for each N of ``--concurrency``."""
    replicas = {
        label: Replicas([s.address for s in services], ignore_eos=options.ignore_eos)
        for label, services in stack.coordinators.items()
    }
    configs = outrider_load_configs(replicas, variants)
    if hf is not None:
        generate, continuous = hf_load_configs(hf)
        configs = [generate, *configs, continuous]
    configs, batches, not_run = run_concurrency(
        selected(configs, options.configs or ()),
        prompts,
        options.levels,
        options.max_new_tokens,
        repeat=options.repeat,
        once=(1,) if options.reference_once else (),
        progress=options.progress,
    )
    return build_concurrency_report(configs, prompts, batches, not_run, meta)


def _meta(options: BenchOptions, model_dir: str, prompts: int, started: float) -> dict[str, Any]:
    """The run's settings, at the head of the report."""
    import torch

    from outrider import model_specs

    title = f"{Path(model_dir).name}, {prompts} prompts × {options.max_new_tokens} tokens"
    if options.concurrency:
        title += f", N = {','.join(map(str, options.levels))}"
    meta = {
        "title": title,
        "command": shlex.join(["outrider", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else None,
        "target_model": options.target_model or model_specs.DEFAULT_MODEL,
        "dtype": options.dtype,
        "device": options.device,
        "target_tp": options.target_tp,
        "draft_tp": options.draft_tp,
        "ignore_eos": options.ignore_eos,
        "max_new_tokens": options.max_new_tokens,
        "k": list(options.k),
        "drafters": list(options.drafters),
        "prompt_files": [str(p) for p in options.prompt_files],
        "limit": options.limit,
        "threads": options.torch_threads,
        "draft_threads": options.draft_threads or options.torch_threads,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "repeat": options.repeat,
    }
    if options.concurrency:
        meta["coordinators"] = options.coordinators
    return meta


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural where ``n`` is not one."""
    return f"{n} {noun}{'s' * (n != 1)}"
