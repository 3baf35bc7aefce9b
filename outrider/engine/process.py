"""The engine in its own process, behind ZeroMQ (vLLM's engine core).

In one process the gRPC threads and the engine thread take turns at the
interpreter: with many sessions, parsing and answering their messages holds
the engine's steps back, however free the GPU is. ``--engine-process`` moves
the worker's sessions and engine into a child process of their own:

* the child (:func:`_serve_core`) builds the worker (model, KV cache, CUDA
  graphs), warms it up, then runs each call it receives on its
  :class:`~outrider.engine.core.Engine` and sends back the outcome;
* the gRPC process keeps a :class:`RemoteSessions` — the worker's static
  facts and, for metrics and ``GetWorkerInfo``, its store's counts as of the
  last reply — and an :class:`EngineClient` with the engine's interface
  (``run``, ``timed``, ``submit``), which sends the *name* of the sessions'
  method and its arguments.

Calls go over a PUSH/PULL pair of ``ipc://`` sockets each way, pickled
(both ends are the same program). A child that dies fails every call in
flight with ``UNAVAILABLE`` and takes the worker down with it, so that its
supervisor restarts both.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import multiprocessing
import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import zmq
import zmq.asyncio

from outrider.errors import Unavailable
from outrider.logging import configured_level, get_logger

log = get_logger(__name__)

METHODS = ("open", "verify", "propose", "close")
"""The sessions' methods a gRPC process may call."""


@dataclass(frozen=True)
class StoreCounts:
    """What the metrics and ``GetWorkerInfo`` read of a session store."""

    sessions: int = 0
    cached_tokens: int = 0
    used_blocks: int = 0
    num_blocks: int = 0
    max_sessions: int = 0
    max_cached_tokens: int = 0

    @classmethod
    def of(cls, store) -> StoreCounts:
        pool = store.pool
        return cls(
            len(store),
            store.cached_tokens,
            pool.used_blocks if pool else 0,
            pool.num_blocks if pool else 0,
            store.max_sessions,
            store.max_cached_tokens,
        )


class RemoteStore:
    """A session store's counts, as of the engine process's last reply."""

    def __init__(self, counts: StoreCounts) -> None:
        self.counts = counts

    def __len__(self) -> int:
        return self.counts.sessions

    @property
    def cached_tokens(self) -> int:
        return self.counts.cached_tokens

    @property
    def max_sessions(self) -> int:
        return self.counts.max_sessions

    @property
    def max_cached_tokens(self) -> int:
        return self.counts.max_cached_tokens

    @property
    def usage(self) -> float:
        return self.counts.used_blocks / self.counts.num_blocks if self.counts.num_blocks else 0.0


class RemoteSessions:
    """A worker's sessions living in the engine process: their static facts
    (``info``; a draft worker's ``drafter``) and store counts here, their
    methods as names the :class:`EngineClient` sends."""

    open, verify, propose, close = METHODS

    def __init__(self, info: Any, drafter: SimpleNamespace | None, counts: StoreCounts) -> None:
        self.info = info
        self.drafter = drafter
        self.store = RemoteStore(counts)


class EngineClient:
    """The engine's interface in the gRPC process, over ZeroMQ to the engine process."""

    def __init__(self, process: multiprocessing.Process, requests: zmq.asyncio.Socket, replies: zmq.asyncio.Socket,
                 sessions: RemoteSessions, on_step: Callable | None, on_death: Callable[[], None]) -> None:  # fmt: skip
        self.process = process
        self.sessions = sessions
        self.on_step = on_step
        self.on_death = on_death
        self._requests = requests
        self._replies = replies
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._receiver = asyncio.ensure_future(self._receive())

    @classmethod
    async def start(
        cls,
        module: str,
        config: Any,
        *,
        on_step: Callable | None = None,
        on_death: Callable[[], None] | None = None,
        timeout_s: float = 900.0,
    ):
        """Starts the engine process of the worker that ``module``
        (``target_worker.main``, ``draft_worker.main``) builds from
        ``config``; returns once it has warmed up. ``on_death`` runs if the
        engine process dies (default: the worker exits with status 1)."""
        directory = tempfile.mkdtemp(prefix="outrider-engine-")
        to_core, from_core = f"ipc://{directory}/requests", f"ipc://{directory}/replies"
        context = zmq.asyncio.Context.instance()
        requests, replies = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        requests.bind(to_core)
        replies.bind(from_core)
        process = multiprocessing.get_context("spawn").Process(
            target=_serve_core,
            args=(module, config, to_core, from_core, configured_level()),
            name=f"engine-{module}",
            daemon=True,
        )
        process.start()
        try:
            kind, info, drafter, counts = await _ready(replies, process, timeout_s)
        except BaseException:
            process.kill()
            raise
        log.info("engine process ready", pid=process.pid, module=module)
        sessions = RemoteSessions(info, drafter, counts)
        return cls(process, requests, replies, sessions, on_step, on_death or _exit_worker)

    async def run(self, method: str, *args: object) -> Any:
        result, _ = await self.timed(method, *args)
        return result

    async def timed(self, method: str, *args: object) -> tuple[Any, float]:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._send(call_id, method, args)
            return await future
        finally:
            self._pending.pop(call_id, None)

    def submit(self, method: str, *args: object) -> None:
        self._send(0, method, args)

    def _send(self, call_id: int, method: str, args: tuple) -> None:
        if method not in METHODS:
            raise ValueError(f"the engine process runs the sessions' {', '.join(METHODS)}, not {method!r}")
        if not self.process.is_alive():
            raise Unavailable("this worker's engine process has died; retry on another replica")
        self._requests.send(pickle.dumps((call_id, method, args), protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)

    async def _receive(self) -> None:
        while True:
            if not await self._replies.poll(1000):
                if not self.process.is_alive():
                    return self._died()
                continue
            call_id, ok, value, seconds, counts, steps = pickle.loads(await self._replies.recv())
            self.sessions.store.counts = counts
            if self.on_step is not None:
                for step in steps:
                    self.on_step(step)
            future = self._pending.get(call_id)
            if future is not None and not future.done():
                future.set_result((value, seconds)) if ok else future.set_exception(value)

    def _died(self) -> None:
        log.critical("engine process died", exitcode=self.process.exitcode)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable("this worker's engine process died; retry on another replica"))
        self.on_death()

    def shutdown(self) -> None:
        self._receiver.cancel()
        if self.process.is_alive():
            self._requests.send(pickle.dumps(None))
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
        self._requests.close(linger=0)
        self._replies.close(linger=0)


def _exit_worker() -> None:
    """A worker without its engine serves nothing: exit, and let its supervisor restart it."""
    asyncio.get_running_loop().call_later(0.1, os._exit, 1)


async def _ready(replies: zmq.asyncio.Socket, process, timeout_s: float):
    """The engine process's first message: its facts once warmed up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await replies.poll(500):
        if not process.is_alive():
            raise RuntimeError(f"the engine process exited with code {process.exitcode} while starting")
        if loop.time() > deadline:
            raise RuntimeError(f"the engine process did not start within {timeout_s:.0f} s")
    return pickle.loads(await replies.recv())


# --- the engine process -------------------------------------------------------------


def _serve_core(module: str, config: Any, to_core: str, from_core: str, log_level: str) -> None:
    """The child: build and warm up the worker, then run the calls that come in."""
    from outrider.logging import configure_logging
    from outrider.worker import start_engine

    configure_logging(log_level)
    role = importlib.import_module(module)
    context = zmq.Context()
    requests, replies = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    requests.connect(to_core)
    replies.connect(from_core)
    sessions = role.build_engine(config)
    steps: list = []
    engine = start_engine(sessions, config.engine, max_rows=config.limits.max_sessions, on_step=steps.append)
    asyncio.run(role.warm_up(sessions, engine))
    drafter = getattr(sessions, "drafter", None)
    facts = None if drafter is None else SimpleNamespace(
        model_name=drafter.model_name, kind=drafter.kind, vocab_size=drafter.vocab_size
    )  # fmt: skip
    steps.clear()
    replies.send(pickle.dumps(("ready", sessions.info, facts, StoreCounts.of(sessions.store))))

    def reply(call_id: int):
        # On the engine thread, which alone sends from here on.
        def send(ok: bool, value: Any, seconds: float) -> None:
            counts, done = StoreCounts.of(sessions.store), steps[:]
            del steps[: len(done)]
            try:
                message = pickle.dumps((call_id, ok, value, seconds, counts, done), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # an outcome that does not pickle still answers the call
                message = pickle.dumps((call_id, False, RuntimeError(repr(exc)), seconds, counts, done))
            replies.send(message)

        return send

    while (message := pickle.loads(requests.recv())) is not None:
        call_id, method, args = message
        engine.enqueue(getattr(sessions, method), args, reply(call_id))
    engine.shutdown()
