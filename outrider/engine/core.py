"""The engine: one loop per worker that batches every session's work into
one forward pass per step.

A worker states each call as a function run on the engine. Plain functions
(closing a session) run between steps. A *job* — opening a session, a
target's verify, a draft's proposal — is a generator function: it checks
the request, then ``yield``\\ s :class:`~outrider.engine.scheduler.Feed`\\ s
(append these tokens to this session's cache and give me the logits of the
last n) and gets back :class:`~outrider.engine.runner.Logits`, and finally
``return``\\ s its result::

    def verify(self, session_id, committed_len, draft_tokens, ...):
        session = self.store.get(session_id)         # checks, as plain code
        out = yield Feed(session.kv, [x_n, *draft_tokens], num_logits=K + 1)
        return verdict_from(out)                      # math on the logits

:class:`Engine` runs jobs on its own thread: at each step it takes the new
calls, lets the scheduler pick the rows of every job that is waiting for a
feed, runs them as ONE forward pass, and sends each finished feed's logits
back into its job, which answers or asks for its next feed — so K draft
steps of many sessions run as K batched steps, and sessions join and leave
between steps; a step is held briefly for the sessions the last one answered
while their next round is a short round trip away (:class:`_Returns`). The
gRPC event loop only ever waits on a future.
:class:`InlineEngine` runs the same jobs at once on the caller's thread,
each feed alone, with no thread hop: for tests that drive one session at a time.

A feed's cache room is reserved before it is queued; a full pool is thrown
into the job as ``ResourceExhausted``. A session closed while its job waits
for a feed ends that job (``SessionNotFound``) before the step, so a forward
pass never touches freed memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import os
import queue
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch

from outrider.engine.kv_cache import KVCache
from outrider.engine.runner import Logits, RunnerLost
from outrider.engine.scheduler import Feed, Row, Scheduler
from outrider.engine_load import EngineLoad, LoadMeter
from outrider.errors import ResourceExhausted, SessionNotFound, Unavailable
from outrider.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")
R = TypeVar("R")
Job = Generator[Feed, Logits | None, R]
"""An engine job returning ``R`` (bare ``Job``: any result)."""


@dataclass
class _Done:
    value: Any


@dataclass(frozen=True)
class Timing:
    """Where a call's time at the engine went."""

    compute_s: float
    """From the engine taking the call to its end: its steps, shared with
    other sessions, included."""
    queued_s: float = 0.0
    """Before the engine took it: the rest of the step under way when it
    came, which is other sessions' work."""


def _resume(job: Job, context: contextvars.Context, value: Logits | None) -> Feed | _Done:
    """Runs ``job`` up to its next feed (with room reserved) or its end."""
    error: BaseException | None = None
    while True:
        try:
            feed = context.run(job.send, value) if error is None else context.run(job.throw, error)
        except StopIteration as stop:
            return _Done(stop.value)
        try:
            feed.kv.reserve(len(feed.kv) + len(feed.tokens))
            return feed
        except ResourceExhausted as exc:
            error, value = exc, None


@dataclass
class StepStats:
    """What one step ran, for metrics."""

    rows: int
    tokens: int
    seconds: float


class _Activity:
    """What the engine did lately, logged every ``interval_s`` while it
    works (as vLLM logs its throughput): steps per second, sessions and
    tokens per step, forward time, and the share of the wall time the engine
    thread was busy — near 100% means the engine is the limit, far below it
    means the sessions' rounds reach it too slowly."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.started, self.steps, self.rows, self.tokens, self.forward_s, self.idle_s = (
            now,
            0,
            0,
            0,
            0.0,
            0.0,
        )

    def record(self, stats: StepStats, waiting: int) -> None:
        self.steps += 1
        self.rows += stats.rows
        self.tokens += stats.tokens
        self.forward_s += stats.seconds
        now = time.perf_counter()
        if (elapsed := now - self.started) >= self.interval_s:
            log.info(
                "engine activity",
                steps_per_s=round(self.steps / elapsed, 1),
                rows_per_step=round(self.rows / self.steps, 1),
                tokens_per_s=round(self.tokens / elapsed),
                forward_ms=round(1000 * self.forward_s / self.steps, 2),
                busy_pct=round(100 * (1 - self.idle_s / elapsed)),
                waiting=waiting,
            )
            self._reset(now)


FIRST_BACK_KEPT = 64
"""Steps whose first return :class:`_Returns` remembers."""


class _Returns:
    """The sessions a step answered, on their way back with their next round.

    A session's rounds reach the engine one after another: its verify is
    answered, the coordinator commits and asks the draft, and the next verify
    arrives a round trip later. An engine that steps the moment any work is
    waiting splits sessions that run together into groups that then take
    turns for good, two forward passes per round where one would do — and a
    pass costs far less than twice a pass of half the rows
    (docs/benchmark.md#a-steps-cost).
    So while work waits, the engine holds the step for the sessions it
    answered last, until they are all back or ``max_wait`` of a forward pass
    has gone by — while their round trip (its moving average) is that short.
    Where it is longer (a draft model's K steps between two verifies), the
    engine holds only for the rest of a step's sessions once the first of
    them is back, and only while they come back together (the spread of
    their returns, its moving average, within the wait): sessions whose
    drafts ran in the same draft steps send their verifies at once, and an
    engine that stepped on the first would split them; sessions that drift apart
    take turns, and nobody waits. A session that misses a wait is not
    waited for again until its next answer; a closed one is forgotten."""

    def __init__(self, max_wait: float) -> None:
        self.max_wait = max_wait
        self.round_trip_s: float | None = None
        self.forward_s: float | None = None
        self._answered: dict[KVCache, float] = {}
        """Session cache → when its last round was answered."""
        self._late: dict[KVCache, float] = {}
        """The same, for sessions that missed a wait (still measured on return)."""
        self.spread_s: float | None = None
        """How long after the first of a step's sessions the others come back."""
        self._first_back: dict[float, float] = {}
        """When a step answered → when the first of its sessions came back."""

    def stepped(self, seconds: float) -> None:
        self.forward_s = _average(self.forward_s, seconds)

    def answered(self, kv: KVCache, at: float) -> None:
        self._late.pop(kv, None)
        self._answered[kv] = at

    def arrived(self, kv: KVCache, at: float) -> None:
        answered = self._answered.pop(kv, None)
        if answered is None:
            answered = self._late.pop(kv, None)
        if answered is not None:
            self.round_trip_s = _average(self.round_trip_s, at - answered)
            first = self._first_back.setdefault(answered, at)
            self.spread_s = _average(self.spread_s, at - first)
            while len(self._first_back) > FIRST_BACK_KEPT:
                del self._first_back[next(iter(self._first_back))]

    def deadline(self, now: float) -> float | None:
        """Until when to hold the step; None: start it now."""
        for kv in [kv for kv in self._late if kv.freed]:
            del self._late[kv]
        if not self.expected() or self.round_trip_s is None or self.forward_s is None:
            return None
        longest = self.max_wait * self.forward_s
        if self.round_trip_s <= longest:
            return now + longest
        if self.spread_s is None or self.spread_s > longest:
            return None
        firsts = [self._first_back.get(at) for at in self._answered.values()]
        back = [first for first in firsts if first is not None]
        return min(back) + longest if back else None

    def expected(self) -> bool:
        """Whether a session answered last is still on its way back (not closed)."""
        for kv in [kv for kv in self._answered if kv.freed]:
            del self._answered[kv]
        return bool(self._answered)

    def missed(self) -> None:
        self._late.update(self._answered)
        self._answered.clear()


def _average(average: float | None, sample: float, weight: float = 0.2) -> float:
    return sample if average is None else average + weight * (sample - average)


@dataclass
class _Fatal:
    """Queued by :meth:`Engine.fail`: the loop raises ``exc`` when it takes it."""

    exc: BaseException


Reply = Callable[[bool, Any, Timing | None], None]
"""How a call's outcome goes back: ``reply(True, result, timing)`` or
``reply(False, exception, None)``."""


class _Call:
    __slots__ = ("fn", "args", "context", "reply", "queued", "started", "job", "kv")

    def __init__(self, fn, args, reply: Reply | None) -> None:
        self.fn, self.args, self.reply = fn, args, reply
        self.context = contextvars.copy_context()
        self.queued = time.perf_counter()
        self.started = 0.0
        self.job: Job | None = None
        self.kv: KVCache | None = None
        """The cache of the job's last feed."""

    def finish(self, value: Any) -> None:
        if self.reply is not None:
            now = time.perf_counter()
            self.reply(True, value, Timing(now - self.started, self.started - self.queued))

    def fail(self, exc: BaseException) -> None:
        if self.job is not None:
            self.job.close()  # its finally blocks run; it never resumes
        if self.reply is not None:
            self.reply(False, exc, None)
        else:
            log.error(
                "engine call failed",
                call=getattr(self.fn, "__name__", repr(self.fn)),
                error=repr(exc),
            )


class Engine:
    """Runs calls and jobs on one thread, batching jobs' feeds per step."""

    def __init__(
        self,
        runner,
        *,
        max_tokens_per_step: int,
        max_rows: int,
        max_prefill_tokens: int = 0,
        torch_threads: int | None = None,
        max_batch_wait: float = 0.0,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        """``max_batch_wait``: how long a step may be held for the sessions
        the last one answered, as a share of a forward pass (0: never held);
        ``max_prefill_tokens``: the longest prompt run whole when no other
        session is on the engine (:class:`Scheduler`)."""
        self.runner = runner
        self.scheduler = Scheduler(
            max_tokens_per_step=max_tokens_per_step,
            max_rows=max_rows,
            max_prefill_tokens=max_prefill_tokens,
        )
        self.on_step = on_step
        self.meter = LoadMeter()
        self._activity = _Activity()
        self._returns = _Returns(max_batch_wait)
        self._stepped_at: float | None = None
        """While a step answers its sessions: when it ended."""
        self._forward_ended_at: float | None = None
        """When the last forward pass ended (None: before the first)."""
        self._waited_s = 0.0
        """Seconds the loop has waited for calls since then."""
        self._calls: queue.SimpleQueue[_Call | _Fatal | None] = queue.SimpleQueue()
        self._stopped = False
        self.exited: concurrent.futures.Future[BaseException | None] = concurrent.futures.Future()
        """Set when the loop ends: to None after :meth:`shutdown`, to the
        exception that ended it otherwise (the worker then stops)."""
        self._thread = threading.Thread(
            target=self._serve, args=(torch_threads,), name="engine", daemon=True
        )
        self._thread.start()

    @overload
    async def run(self, fn: Callable[..., Job[R]], *args: object) -> R: ...
    @overload
    async def run(self, fn: Callable[..., T], *args: object) -> T: ...
    async def run(self, fn: Callable[..., Any], *args: object) -> Any:
        """``fn(*args)`` on the engine (a job runs to its end), with the caller's log context."""
        result, _ = await self.timed(fn, *args)
        return result

    @overload
    async def timed(self, fn: Callable[..., Job[R]], *args: object) -> tuple[R, Timing]: ...
    @overload
    async def timed(self, fn: Callable[..., T], *args: object) -> tuple[T, Timing]: ...
    async def timed(self, fn: Callable[..., Any], *args: object) -> tuple[Any, Timing]:
        """Like :meth:`run`, and where its time at the engine went."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.enqueue(
            fn, args, lambda ok, value, timing: _post(loop, _settle, future, ok, value, timing)
        )
        return await future

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Queues ``fn(*args)`` without waiting (safe from a cancelled task's cleanup)."""
        self.enqueue(fn, args, None)

    def enqueue(self, fn: Callable[..., object], args: tuple, reply: Reply | None) -> None:
        """Queues ``fn(*args)``; ``reply`` gets its outcome, on the engine thread."""
        self._calls.put(_Call(fn, args, reply))
        if self._stopped:  # nobody will take it
            self._fail_queued()

    @property
    def load(self) -> EngineLoad:
        """Its step costs, load and steps so far (any thread may read it)."""
        return self.meter.load

    def shutdown(self) -> None:
        self._calls.put(None)
        self._thread.join()

    def fail(self, exc: BaseException) -> None:
        """Ends the loop with ``exc`` as if a step had raised it (from any
        thread): every call is answered ``UNAVAILABLE`` and the worker stops."""
        self._calls.put(_Fatal(exc))

    # --- the engine thread ----------------------------------------------------------

    def _serve(self, torch_threads: int | None) -> None:
        failure = None
        try:
            if torch_threads:
                torch.set_num_threads(torch_threads)
            device = getattr(self.runner, "device", None)
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # graphs capture on this thread's current device
            with torch.inference_mode():
                while self._take_calls(block=not self.scheduler):
                    if self.scheduler and not self._await_returns():
                        break
                    for call in self.scheduler.drop_closed():
                        call.fail(
                            SessionNotFound("the session was closed while its round was running")
                        )
                    if self.scheduler:
                        self._step()
        except (
            BaseException
        ) as exc:  # a bug of the loop itself: answer everyone, then stop the worker
            log.exception("the engine loop failed")
            failure = exc
        finally:
            self._stopped = True
            gone = Unavailable("the worker's engine has stopped; retry on another replica")
            for call in self.scheduler.discard(self.scheduler.owners()):
                call.fail(gone)
            self._fail_queued()
            self.exited.set_result(failure)

    def _fail_queued(self) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            if isinstance(call, _Call):
                call.fail(Unavailable("the worker's engine has stopped; retry on another replica"))

    def _take_calls(self, *, block: bool, timeout: float | None = None) -> bool:
        """Starts every call queued so far (waiting for one when ``block``,
        at most ``timeout`` seconds); False once shut down."""
        waiting_since = time.perf_counter()
        try:
            call = self._calls.get(block=block, timeout=timeout)
        except queue.Empty:
            return True
        finally:
            waited = time.perf_counter() - waiting_since
            self._waited_s += waited
        if block:
            self._activity.idle_s += waited
        while call is not None:
            if isinstance(call, _Fatal):
                raise call.exc
            self._start(call)
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return True
        return False

    def _await_returns(self) -> bool:
        """Holds the step for the sessions on their way back (:class:`_Returns`);
        False once shut down."""
        deadline = self._returns.deadline(time.perf_counter())
        if deadline is None:
            return True
        while self._returns.expected():
            left = deadline - time.perf_counter()
            if left <= 0:
                self._returns.missed()
                break
            if not self._take_calls(block=True, timeout=left):
                return False
        return True

    def _start(self, call: _Call) -> None:
        call.started = time.perf_counter()
        try:
            result = call.context.run(call.fn, *call.args)
        except BaseException as exc:
            call.fail(exc)
            return
        if isinstance(result, Generator):
            call.job = result
            self._advance(call, None)
        else:
            call.finish(result)

    def _advance(self, call: _Call, value: Logits | None) -> None:
        assert call.job is not None  # only a job feeds, so only a job is advanced
        try:
            outcome = _resume(call.job, call.context, value)
        except BaseException as exc:
            call.fail(exc)
            return
        if isinstance(outcome, _Done):
            if call.kv is not None:
                self._returns.answered(call.kv, self._stepped_at or time.perf_counter())
            call.finish(outcome.value)
            return
        if call.kv is None:  # the job's first feed: its session is back
            self._returns.arrived(outcome.kv, call.queued)
        call.kv = outcome.kv
        self.scheduler.add(outcome, call)

    def _step(self) -> None:
        step = self.scheduler.schedule(getattr(self.runner, "graphed_tokens_per_row", 0))
        rows = [scheduled.row for scheduled in step]
        self.meter.begin()
        started = time.perf_counter()
        # The engine's own work since the last forward pass: answering that
        # step's rows, starting the calls that came meanwhile, scheduling.
        work_s = (
            0.0
            if self._forward_ended_at is None
            else max(0.0, started - self._forward_ended_at - self._waited_s)
        )
        try:
            outputs = self.runner.execute(rows)
        except RunnerLost:
            raise  # no step can run any more: the loop ends, every call is answered
        except BaseException as exc:  # a broken step fails its jobs, not the worker
            log.exception(
                "forward pass failed", rows=len(rows), tokens=sum(len(r.tokens) for r in rows)
            )
            for call in self.scheduler.discard(scheduled.pending.owner for scheduled in step):
                call.fail(exc)
            return
        self._forward_ended_at, self._waited_s = time.perf_counter(), 0.0
        stats = StepStats(
            len(rows), sum(len(r.tokens) for r in rows), self._forward_ended_at - started
        )
        log.debug(
            "step",
            rows=stats.rows,
            tokens=stats.tokens,
            ms=round(stats.seconds * 1e3, 2),
            graphed=getattr(self.runner, "graphed", None),
            pid=os.getpid(),
        )
        self._returns.stepped(stats.seconds)
        self.meter.stepped(
            rows=stats.rows, tokens=stats.tokens, seconds=stats.seconds, work_s=work_s
        )
        if self.on_step is not None:
            self.on_step(stats)
        self._stepped_at = time.perf_counter()  # the step's sessions form one group
        for call, output in self.scheduler.update(step, outputs):
            self._advance(call, output)
        self._stepped_at = None
        self._activity.record(stats, waiting=len(self.scheduler))


class InlineEngine:
    """The :class:`Engine` interface, running each call at once on the
    caller's thread and each feed alone, on ``runner``."""

    def __init__(self, runner) -> None:
        self.runner = runner

    @property
    def load(self) -> None:
        """An inline engine has no steps to report."""
        return None

    @overload
    async def run(self, fn: Callable[..., Job[R]], *args: object) -> R: ...
    @overload
    async def run(self, fn: Callable[..., T], *args: object) -> T: ...
    async def run(self, fn: Callable[..., Any], *args: object) -> Any:
        return self.call(fn, *args)

    @overload
    async def timed(self, fn: Callable[..., Job[R]], *args: object) -> tuple[R, Timing]: ...
    @overload
    async def timed(self, fn: Callable[..., T], *args: object) -> tuple[T, Timing]: ...
    async def timed(self, fn: Callable[..., Any], *args: object) -> tuple[Any, Timing]:
        started = time.perf_counter()
        return self.call(fn, *args), Timing(time.perf_counter() - started)

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        fn(*args)

    def shutdown(self) -> None:
        pass

    def call(self, fn: Callable[..., T], *args: object) -> T:
        result = fn(*args)
        if not isinstance(result, Generator):
            return result
        context, value = contextvars.copy_context(), None
        while not isinstance(outcome := _resume(result, context, value), _Done):
            with torch.inference_mode():
                feed = outcome
                row = Row(
                    feed.kv,
                    feed.tokens,
                    feed.num_logits,
                    feed.hidden,
                    feed.features,
                    feed.feature_layers,
                )
                (value,) = self.runner.execute([row])
        return outcome.value


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the loop has closed: nobody is waiting any more


def _settle(future: asyncio.Future, ok: bool, value: Any, timing: Timing | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if ok:
        future.set_result((value, timing))
    else:
        future.set_exception(value)
