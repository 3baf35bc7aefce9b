"""What tensor parallelism costs on this machine (gloo on the CPU, or NCCL).

``collectives`` — N processes in a process group time, median of
``--repeats``: an all-reduce of one step's hidden state (``[rows, hidden]``,
float32), the gather of the logits to rank 0, and the two ways to hand a
step's metadata (a packed int64 tensor of ``--message-ints``) to the other
ranks: a torch.distributed broadcast (its length, then its numbers), or a
ZeroMQ publish–subscribe message (what ``outrider.engine.parallel`` does).

``steps`` — the worker's runner at TP=1 and at TP=``--size`` on a real
checkpoint (default: the default model): the median time of a decode step
(1×1), a verify round (1×5) and 8 sessions' rounds (8×5), each session
holding ``--context`` cached tokens.

    python scripts/measure_tensor_parallel.py collectives --size 3
    python scripts/measure_tensor_parallel.py steps --size 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from outrider import models  # noqa: E402
from outrider.engine import parallel  # noqa: E402
from outrider.engine.kv_cache import BlockPool  # noqa: E402
from outrider.engine.llama import LlamaForward  # noqa: E402
from outrider.engine.loading import load_causal_lm  # noqa: E402
from outrider.engine.runner import PagedRunner  # noqa: E402
from outrider.engine.scheduler import Row  # noqa: E402


def _median_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def _collectives(rank: int, args: argparse.Namespace, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.size,
        timeout=timedelta(seconds=60),
    )
    results = {}
    for rows in (1, 5, 40):
        x = torch.randn(rows, args.hidden)
        results[f"all_reduce {rows}x{args.hidden}"] = _median_us(
            lambda x=x: dist.all_reduce(x), args.repeats
        )
    logits = torch.randn(5, -(-args.vocab // args.size))
    parts = [torch.empty_like(logits) for _ in range(args.size)] if rank == 0 else None
    results[f"gather logits 5x{args.vocab}"] = _median_us(
        lambda: dist.gather(logits, parts, dst=0), args.repeats
    )
    message = torch.arange(args.message_ints, dtype=torch.long)
    length = torch.tensor([message.numel()])

    def broadcast() -> None:
        dist.broadcast(length, 0)
        buffer = message if rank == 0 else torch.empty(int(length), dtype=torch.long)
        dist.broadcast(buffer, 0)

    results[f"metadata by torch broadcast ({args.message_ints} ints)"] = _median_us(
        broadcast, args.repeats
    )
    # ZeroMQ: rank 0 publishes, the others receive; a barrier closes each round
    # (as a step's first collective would), so the figure is send → all received.
    publisher = parallel.StepPublisher() if rank == 0 else None
    where = [publisher.address if publisher is not None else None]
    dist.broadcast_object_list(where, 0)
    if publisher is not None:
        publisher.wait_for_subscribers(args.size - 1, lambda: None)

        def publish() -> None:
            publisher.send(message)
            dist.barrier()

        zmq_us = _median_us(publish, args.repeats)
        barrier = _median_us(dist.barrier, args.repeats)
        results[f"metadata by ZeroMQ ({args.message_ints} ints)"] = zmq_us - barrier
        results["barrier (subtracted above)"] = barrier
        out.put(results)
        publisher.close()
    else:
        subscriber = parallel.StepSubscriber(where[0])
        parent = os.getppid()
        for _ in range(5 + args.repeats):
            subscriber.receive(parent)
            dist.barrier()
        for _ in range(5 + args.repeats):
            dist.barrier()
        subscriber.close()
    dist.destroy_process_group()


def collectives(args: argparse.Namespace) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    processes = [
        context.Process(target=_collectives, args=(r, args, port, out)) for r in range(args.size)
    ]
    for p in processes:
        p.start()
    results = out.get()
    for p in processes:
        p.join()
    print(json.dumps({"size": args.size, "us": {k: round(v, 1) for k, v in results.items()}}))


def steps(args: argparse.Namespace) -> None:
    """Both runners live at once and their steps alternate, so that what else
    the machine runs meanwhile slows both alike."""
    checkpoint = models.checkpoint_dir(args.model)
    blocks = 8 * (args.context + 16) // 16 + 8
    threads = {1: args.threads, args.size: max(1, args.threads // args.size)}
    one = PagedRunner(
        LlamaForward(load_causal_lm(checkpoint, dtype=torch.float32)),
        BlockPool(blocks, 16),
    )
    ranks = parallel.start(
        checkpoint,
        parallel.meta_model(checkpoint),
        size=args.size,
        device=torch.device("cpu"),
        dtype=torch.float32,
        num_layers=None,
        timeout_s=60,
        threads=threads[args.size],
    )
    results: dict[str, dict[str, float]] = {"tp1 ms": {}, f"tp{args.size} ms": {}}
    try:
        many = PagedRunner(ranks, BlockPool(blocks, 16))
        runners = {1: one, args.size: many}
        with torch.inference_mode():
            for rows, tokens in [(1, 1), (1, 5), (8, 5)]:
                caches = {n: [r.new_kv() for _ in range(rows)] for n, r in runners.items()}
                for n, runner in runners.items():
                    torch.set_num_threads(threads[n])
                    for kv in caches[n]:
                        kv.reserve(args.context)
                    runner.execute([Row(kv, list(range(args.context)), 0) for kv in caches[n]])
                times: dict[int, list[float]] = {n: [] for n in runners}
                for _ in range(args.repeats + 2):
                    for n, runner in runners.items():
                        torch.set_num_threads(threads[n])
                        for kv in caches[n]:
                            kv.reserve(args.context + tokens)
                        started = time.perf_counter()
                        runner.execute([Row(kv, [5] * tokens, tokens) for kv in caches[n]])
                        times[n].append(time.perf_counter() - started)
                        for kv in caches[n]:
                            kv.crop(args.context)
                for n in runners:
                    key = f"tp{n} ms"
                    results[key][f"{rows}x{tokens}"] = round(
                        1000 * statistics.median(times[n][2:]), 2
                    )
                for n in runners:
                    for kv in caches[n]:
                        kv.free()
    finally:
        ranks.close()
    print(json.dumps({**results, "collectives per step": 2 * ranks.num_layers + 2}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["collectives", "steps"])
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (default model's)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary (default model's)")
    parser.add_argument("--message-ints", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    (collectives if args.what == "collectives" else steps)(args)


if __name__ == "__main__":
    main()
