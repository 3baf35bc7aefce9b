"""Measures the floor under Outrider's per-round overhead on this machine.

A round is one message to the draft worker and one to the target worker, each
answered over its session stream (docs/design.md#protocol). This script times that shape
with nothing of Outrider's on the path but the engine thread a worker hands
its forward pass to: a client like the coordinator's (grpc.aio on uvloop) and
two echo servers in their own processes — the draft answers at once, the
target spends ``W`` ms on its engine thread (a Python loop standing in for a
forward pass, which holds the GIL as one does). It reports, per W, the round
wall time minus W, p50:

* ``grpc K=0``   — one RPC per round (target only);
* ``grpc K>0``   — two RPCs per round;
* ``grpc K>0, work on the loop`` — the same with the work run on the event
  loop itself, no engine thread (what a worker must not do; shown to
  separate the hop from the transport);
* ``tcp K>0``    — the same two round trips over plain TCP streams on uvloop
  (length-prefixed frames, no gRPC), for comparison.

On an idle machine, W = 0 shows the transport alone; W near the verify time of
the model being measured shows what a round of that model cannot go below,
because every thread that slept through the forward pass must be woken again.

    .venv/bin/python scripts/measure_transport_floor.py --work-ms 0,1,4
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import struct
import time

import grpc
import uvloop
from tqdm import tqdm

from outrider.engine import Engine
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

DRAFT_REQUEST = pb.DraftRequest(
    round=pb.DraftRound(committed_len=100, new_token_ids=[7], num_draft_tokens=4)
)
PROPOSAL = pb.DraftResponse(proposal=pb.DraftProposal(draft_token_ids=[1, 2, 3, 4], compute_s=0.0))
VERIFY_REQUEST = pb.VerifyRequest(
    round=pb.VerifyRound(committed_len=100, draft_token_ids=[1, 2, 3, 4])
)
VERDICT = pb.VerifyResponse(verdict=pb.Verdict(num_accepted=1, next_token_id=5, compute_s=0.0))


def engine_hop() -> Engine:
    """A worker's engine without a model: its plain calls take the same hop."""
    return Engine(None, max_tokens_per_step=1, max_rows=1, torch_threads=1)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Target(worker_pb2_grpc.TargetWorkerServicer):
    def __init__(self, work_s: float, on_loop: bool) -> None:
        self.work_s = work_s
        self.thread = None if on_loop else engine_hop()

    async def Session(self, requests, context):
        async for _ in requests:
            if self.thread is None:
                busy(self.work_s)
            else:
                await self.thread.run(busy, self.work_s)
            yield VERDICT


class Draft(worker_pb2_grpc.DraftWorkerServicer):
    async def Session(self, requests, context):
        async for _ in requests:
            yield PROPOSAL


def serve_grpc(role: str, work_s: float, on_loop: bool, ports: mp.Queue) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        if role == "target":
            worker_pb2_grpc.add_TargetWorkerServicer_to_server(Target(work_s, on_loop), server)
        else:
            worker_pb2_grpc.add_DraftWorkerServicer_to_server(Draft(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def serve_tcp(role: str, work_s: float, ports: mp.Queue) -> None:
    async def main() -> None:
        thread = engine_hop() if role == "target" else None
        answer = (VERDICT if role == "target" else PROPOSAL).SerializeToString()

        async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    (size,) = struct.unpack("<I", await reader.readexactly(4))
                    await reader.readexactly(size)
                except asyncio.IncompleteReadError:
                    return
                if thread is not None:
                    await thread.run(busy, work_s)
                writer.write(struct.pack("<I", len(answer)) + answer)

        server = await asyncio.start_server(session, "127.0.0.1", 0)
        ports.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    uvloop.run(main())


async def rounds_grpc(
    target_port: int, draft_port: int, n: int, work_s: float, two_rpcs: bool, bar
) -> list[float]:
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{target_port}") as target_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{draft_port}") as draft_channel,
    ):
        target = worker_pb2_grpc.TargetWorkerStub(target_channel).Session()
        draft = worker_pb2_grpc.DraftWorkerStub(draft_channel).Session()
        overheads = []
        for _ in range(n):
            started = time.perf_counter()
            drafts = []
            if two_rpcs:
                await draft.write(DRAFT_REQUEST)
                drafts = (await draft.read()).proposal.draft_token_ids
            await target.write(
                pb.VerifyRequest(round=pb.VerifyRound(committed_len=100, draft_token_ids=drafts))
            )
            await target.read()
            overheads.append(time.perf_counter() - started - work_s)
            bar.update()
        target.cancel()
        draft.cancel()
    return overheads


async def rounds_tcp(target_port: int, draft_port: int, n: int, work_s: float, bar) -> list[float]:
    target = await asyncio.open_connection("127.0.0.1", target_port)
    draft = await asyncio.open_connection("127.0.0.1", draft_port)
    exchanges = (
        (draft, DRAFT_REQUEST.SerializeToString(), pb.DraftResponse),
        (target, VERIFY_REQUEST.SerializeToString(), pb.VerifyResponse),
    )
    overheads = []
    for _ in range(n):
        started = time.perf_counter()
        for (reader, writer), frame, response in exchanges:
            writer.write(struct.pack("<I", len(frame)) + frame)
            (size,) = struct.unpack("<I", await reader.readexactly(4))
            response.FromString(await reader.readexactly(size))
        overheads.append(time.perf_counter() - started - work_s)
        bar.update()
    for _, writer in (draft, target):
        writer.close()
    return overheads


def measure(shape: str, work_s: float, n: int, bar) -> float:
    """p50 of round wall time minus the work, in ms, for one shape."""
    context = mp.get_context("spawn")
    processes, ports = [], []
    for role in ("target", "draft"):
        queue = context.Queue()
        if shape.startswith("tcp"):
            process = context.Process(target=serve_tcp, args=(role, work_s, queue), daemon=True)
        else:
            process = context.Process(
                target=serve_grpc, args=(role, work_s, "loop" in shape, queue), daemon=True
            )
        process.start()
        processes.append(process)
        ports.append(queue.get(timeout=60))
    try:
        if shape.startswith("tcp"):
            overheads = uvloop.run(rounds_tcp(*ports, n, work_s, bar))
        else:
            overheads = uvloop.run(rounds_grpc(*ports, n, work_s, "K>0" in shape, bar))
    finally:
        for process in processes:
            process.terminate()
            process.join()
    warm = overheads[n // 10 :]
    return statistics.median(warm) * 1e3


SHAPES = ("grpc K=0", "grpc K>0", "grpc K>0, work on the loop", "tcp K>0")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--work-ms", default="0,4", help="target work per round, ms, comma-separated (default: 0,4)"
    )
    parser.add_argument(
        "--rounds", type=int, default=500, help="rounds per measurement (default: 500)"
    )
    args = parser.parse_args()
    works = [float(w) for w in args.work_ms.split(",")]
    results = {}
    with tqdm(total=len(works) * len(SHAPES) * args.rounds, unit="round") as bar:
        for work_ms in works:
            for shape in SHAPES:
                bar.set_description(f"{shape}, W={work_ms:g} ms")
                results[shape, work_ms] = measure(shape, work_ms / 1e3, args.rounds, bar)
    print("round overhead p50 (ms): wall time minus the target's work W")
    print(f"| shape | {' | '.join(f'W = {w:g} ms' for w in works)} |")
    print(f"|---|{'---:|' * len(works)}")
    for shape in SHAPES:
        print(f"| {shape} | {' | '.join(f'{results[shape, w]:.2f}' for w in works)} |")


if __name__ == "__main__":
    main()
