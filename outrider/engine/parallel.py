"""Tensor-parallel workers: one control plane, N data planes
(docs/design.md#tensor-parallelism).

A worker with ``--tensor-parallel-size N`` is N processes. Rank 0 is the
worker as it always is — gRPC, sessions, scheduler, block tables, sampling
and verification — whose runner's forward is a :class:`TensorParallelForward`:
each step it publishes the step's numbers (:func:`pack`), runs its shard,
and gets the logits. Ranks 1..N−1 (:func:`serve_rank`, ``python -m
outrider.engine.parallel``) hold their shard of the weights and of the KV
cache and nothing else: they wait for a step, run the same forward on their
shard, and wait again. Every rank's forward meets the others in its
collectives (torch.distributed: gloo on the CPU, NCCL on CUDA).

The step's numbers travel over ZeroMQ (publish–subscribe on loopback, as
vLLM's ``shm_broadcast`` falls back to), not a torch broadcast: a rank then
waits for the next step as long as the worker is idle, while every
collective stays bounded by the process group's timeout
(docs/tensor-parallel.md#on-this-cpu-2-cores-gloo).

Faults: a rank that dies breaks the next collective (gloo sees its sockets
close; NCCL's watchdog its timeout) — the step raises :class:`RankLost` and
the engine stops, answering every pending call ``UNAVAILABLE``; a rank that
dies while the worker is idle is noticed by a watcher thread, with the same
end. A rank whose worker is gone (its parent changed) exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import zmq

from outrider.engine.causal_lm import truncate_layers
from outrider.engine.llama import AttentionGroup, ForwardBatch, LlamaForward
from outrider.engine.runner import RunnerLost, tune_linears
from outrider.engine.shards import CheckpointShard, Shard
from outrider.logging import get_logger
from outrider.memory import return_freed_memory

log = get_logger(__name__)

STEP, ALLOCATE, STOP = 0, 1, 2
"""The kinds of message rank 0 publishes (the first number of each)."""

POLL_MS = 1000
"""How often a waiting rank checks that its worker is still there."""

START_TIMEOUT_S = 600.0
"""How long the ranks' processes may take to start (their imports, on a
loaded machine) and to load their shards; rank 0 checks meanwhile that none
has exited. The collectives' own timeout is ``--tensor-parallel-timeout-s``."""


class RankLost(RunnerLost):
    """A rank of the worker's tensor-parallel group failed or is gone: the
    worker can run no more steps."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to start (the command line of its process, as JSON)."""

    checkpoint: str
    rank: int
    size: int
    device: str
    """``cpu`` or ``cuda`` (rank r on ``cuda:r``)"""
    dtype: str
    num_layers: int | None
    store_port: int
    steps: str
    """The ZeroMQ address rank 0 publishes its steps on."""
    timeout_s: float
    threads: int
    trust_remote_code: bool = False

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.rank) if self.device == "cuda" else torch.device("cpu")


def meta_model(checkpoint: str, *, num_layers: int | None = None, trust_remote_code: bool = False):
    """The architecture of a checkpoint without its weights (on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    if num_layers is not None:
        truncate_layers(model, num_layers)
    return model.eval()


def load_shard(spec: RankSpec, model: Any = None) -> LlamaForward:
    """This rank's forward, its weights read slice by slice from the checkpoint."""
    model = model or meta_model(
        spec.checkpoint, num_layers=spec.num_layers, trust_remote_code=spec.trust_remote_code
    )
    shard = CheckpointShard(
        Path(spec.checkpoint),
        Shard(spec.rank, spec.size),
        dtype=getattr(torch, spec.dtype),
        device=spec.torch_device,
    )
    try:
        return LlamaForward(model, checkpoint=shard)
    finally:
        shard.close()


def _join(spec: RankSpec, store: dist.Store) -> None:
    """Joins the default process group (collectives time out after ``spec.timeout_s``)."""
    if spec.device == "cuda":
        torch.cuda.set_device(spec.torch_device)
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=spec.rank,
        world_size=spec.size,
        timeout=timedelta(seconds=spec.timeout_s),
    )


# --------------------------------------------------------------------------- step messages


def pack(batch: ForwardBatch) -> torch.Tensor:
    """A step's numbers as one int64 tensor: ``[STEP, N, M (−1: every token),
    groups, (start, rows, tokens per row, width) per group, ids, positions,
    slots, logits indices, block tables]``."""
    indices = batch.logits_indices
    header = [STEP, batch.input_ids.shape[0], -1 if indices is None else indices.shape[0]]
    header.append(len(batch.groups))
    for group in batch.groups:
        header += [group.start, group.rows, group.tokens_per_row, group.block_table.shape[1]]
    parts = [torch.tensor(header), batch.input_ids, batch.positions, batch.slots]
    if indices is not None:
        parts.append(indices)
    parts += [group.block_table.flatten() for group in batch.groups]
    return torch.cat([p.cpu() for p in parts])


def unpack(message: torch.Tensor, device: torch.device) -> ForwardBatch:
    """The :class:`ForwardBatch` of a :func:`pack`\\ ed step, on ``device``."""
    n, m, num_groups = (int(x) for x in message[1:4])
    shapes = message[4 : 4 + 4 * num_groups].view(-1, 4).tolist()
    data = message[4 + 4 * num_groups :].to(device)
    offset = 3 * n + max(m, 0)
    groups = []
    for start, rows, tokens, width in shapes:
        table = data[offset : offset + rows * width].view(rows, width)
        groups.append(AttentionGroup(start, rows, tokens, table))
        offset += rows * width
    return ForwardBatch(
        input_ids=data[:n],
        positions=data[n : 2 * n],
        slots=data[2 * n : 3 * n],
        groups=groups,
        logits_indices=None if m < 0 else data[3 * n : 3 * n + m],
    )


class StepPublisher:
    """Rank 0's end of the step queue: a ZeroMQ XPUB socket on loopback."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not just the first
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def wait_for_subscribers(self, count: int, alive: Callable[[], None]) -> None:
        """Returns once ``count`` ranks have subscribed (a message published
        before would not reach them); ``alive`` raises if a rank has died."""
        while count:
            alive()
            if self._socket.poll(100):
                if self._socket.recv()[:1] == b"\x01":
                    count -= 1

    def send(self, message: torch.Tensor) -> None:
        self._socket.send(message.numpy().data)

    def close(self) -> None:
        self._socket.close()
        self._context.term()


class StepSubscriber:
    """A rank's end of the step queue."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")

    def receive(self, parent: int) -> torch.Tensor | None:
        """The next message; None once the worker (process ``parent``) is gone."""
        while not self._socket.poll(POLL_MS):
            if os.getppid() != parent:
                return None
        buffer = self._socket.recv(copy=False).buffer
        return torch.from_numpy(np.frombuffer(buffer, dtype=np.int64).copy())

    def close(self) -> None:
        self._socket.close()
        self._context.term()


# --------------------------------------------------------------------------- rank 0


class TensorParallelForward:
    """Rank 0's forward (the :class:`LlamaForward` interface the runner
    uses): publishes each step to the other ranks, runs its own shard, and
    returns the logits the ranks gathered to it."""

    def __init__(
        self,
        local: LlamaForward,
        publisher: StepPublisher,
        ranks: list[subprocess.Popen],
    ) -> None:
        self.local = local
        self.publisher = publisher
        self.ranks = ranks
        self.size = len(ranks) + 1
        self.vocab_size, self.device, self.dtype = local.vocab_size, local.device, local.dtype
        self.num_layers = local.num_layers
        self._closing = False
        self._failed = False
        self._lock = threading.Lock()

    def linear_weights(self) -> list[Any]:
        """Rank 0's linear weights (each rank tunes its own, :func:`serve_rank`)."""
        return self.local.linear_weights()

    def allocate_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """This rank's KV cache; every other rank allocates its own, of its KV heads."""
        self.publisher.send(torch.tensor([ALLOCATE, num_blocks, block_size]))
        return self.local.allocate_cache(num_blocks, block_size)

    def forward(self, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        return self.forward_with(batch, cache)[0]

    def forward_with(
        self, batch: ForwardBatch, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every rank's step; rank 0's hidden states are whole after each
        all-reduce, so its own are the features an EAGLE head reads."""
        if self._failed:
            raise RankLost("a tensor-parallel rank was lost earlier; the worker is stopping")
        self.publisher.send(pack(batch))
        try:
            return self.local.forward_with(batch, cache)
        except Exception as exc:  # a collective failed or timed out: the ranks are out of step
            self._failed = True
            raise RankLost(f"a tensor-parallel step failed: {_first_line(exc)}") from exc

    def watch(self, on_lost: Callable[[BaseException], None]) -> None:
        """Calls ``on_lost`` (from a thread of its own) if a rank exits while
        the worker runs."""

        def wait(process: subprocess.Popen, rank: int) -> None:
            code = process.wait()
            with self._lock:
                if self._closing:
                    return
                self._failed = True
            log.error("a tensor-parallel rank exited", rank=rank, exit_code=code)
            on_lost(RankLost(f"tensor-parallel rank {rank} exited with code {code}"))

        for rank, process in enumerate(self.ranks, start=1):
            threading.Thread(
                target=wait, args=(process, rank), name=f"rank-{rank}-watch", daemon=True
            ).start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops every rank (they exit after their current step) and leaves the group."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self.publisher.send(torch.tensor([STOP]))
        deadline = time.monotonic() + timeout_s
        for process in self.ranks:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def start(
    checkpoint: str,
    model: Any,
    *,
    size: int,
    device: torch.device,
    dtype: torch.dtype,
    num_layers: int | None,
    timeout_s: float,
    threads: int,
    trust_remote_code: bool = False,
) -> TensorParallelForward:
    """Starts ranks 1..``size``−1 as processes, joins them in a process
    group as rank 0, and loads rank 0's shard (of ``model``, the
    checkpoint's architecture on the meta device). Raises RankLost when a
    rank does not come up."""
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"--tensor-parallel-size {size} needs {size} CUDA devices, "
            f"this machine has {torch.cuda.device_count()}"
        )
    store = _master_store(size)
    publisher = StepPublisher()
    spec = RankSpec(
        checkpoint=checkpoint,
        rank=0,
        size=size,
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=num_layers,
        store_port=store.port,
        steps=publisher.address,
        timeout_s=timeout_s,
        threads=threads,
        trust_remote_code=trust_remote_code,
    )
    command = [sys.executable, "-m", "outrider.engine.parallel"]
    ranks = [
        subprocess.Popen([*command, json.dumps(asdict(spec) | {"rank": r})]) for r in range(1, size)
    ]
    try:
        local = _meet(spec, model, store, publisher, ranks)
    except BaseException:
        for process in ranks:
            process.kill()
            process.wait()
        publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    log.info("tensor-parallel ranks ready", size=size, backend=spec.backend)
    return TensorParallelForward(local, publisher, ranks)


def _master_store(size: int) -> dist.TCPStore:
    """Rank 0's key–value store, on a free port, where the ranks meet."""
    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        world_size=size,
        is_master=True,
        timeout=timedelta(seconds=START_TIMEOUT_S),
        wait_for_workers=False,
    )


def _meet(
    spec: RankSpec,
    model: Any,
    store: dist.TCPStore,
    publisher: StepPublisher,
    ranks: list[subprocess.Popen],
) -> LlamaForward:
    """Rank 0's side of the start, step by step with the ranks: they start,
    all join the group, they subscribe to the steps, all load their shards.
    Returns rank 0's forward; raises RankLost when a rank exits meanwhile
    or a step takes more than ``START_TIMEOUT_S``."""

    def alive() -> None:
        for rank, process in enumerate(ranks, start=1):
            if (code := process.poll()) is not None:
                raise RankLost(f"tensor-parallel rank {rank} exited with code {code} at start")

    def wait_for(stage: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check([f"{stage}/{r}" for r in range(1, spec.size)]):
            alive()
            if time.monotonic() > deadline:
                raise RankLost(f"the tensor-parallel ranks were not {stage} in {START_TIMEOUT_S} s")
            time.sleep(0.05)

    wait_for("started")  # their imports done: joining the group is quick
    _join(spec, store)
    publisher.wait_for_subscribers(spec.size - 1, alive)
    local = load_shard(spec, model)
    wait_for("loaded")
    return local


# --------------------------------------------------------------------------- ranks 1..N-1


def serve_rank(spec: RankSpec) -> int:
    """A rank's life: join, load its shard, then run every step rank 0
    publishes until it says stop (0) or is gone (1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops the ranks
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    torch.set_num_threads(spec.threads)
    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1",
        spec.store_port,
        world_size=spec.size,
        is_master=False,
        timeout=timedelta(seconds=START_TIMEOUT_S),
    )
    store.set(f"started/{spec.rank}", "1")
    _join(spec, store)
    steps = StepSubscriber(spec.steps)
    forward = load_shard(spec)
    return_freed_memory()
    tune_linears(forward.linear_weights())  # (here: its steps run on this thread)
    store.set(f"loaded/{spec.rank}", "1")
    cache: torch.Tensor | None = None
    try:
        with torch.inference_mode():
            while (message := steps.receive(parent)) is not None:
                kind = int(message[0])
                if kind == STOP:
                    return 0
                if kind == ALLOCATE:
                    cache = forward.allocate_cache(int(message[1]), int(message[2]))
                elif cache is not None:
                    forward.forward(unpack(message, forward.device), cache)
        return 1
    finally:
        steps.close()
        dist.destroy_process_group()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m outrider.engine.parallel",
        description="one rank (1..N-1) of a tensor-parallel worker; started by rank 0",
    )
    parser.add_argument("spec", help="the rank's RankSpec, as JSON")
    spec = RankSpec(**json.loads(parser.parse_args(argv).spec))
    return serve_rank(spec)


if __name__ == "__main__":
    sys.exit(main())
