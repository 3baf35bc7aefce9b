"""The routing table of one worker role: its replicas, which of them take
new sessions, and how loaded each one is.

A session is one bidirectional stream on one replica's channel, so it stays
pinned to the replica it opened on; only new sessions are routed — to a
replica that takes sessions, one that has not just failed first, the one
most likely to hold the session's prefix in its cache within a bound on its
load (``outrider.coordinator.workers.prefixes``), else the least loaded.

Members are the static ``HOST:PORT`` addresses (fixed) and the endpoints of
each ``k8s://`` address, which a watch of the Service's EndpointSlices keeps
in step (``outrider.coordinator.workers.discovery``):

* a new endpoint joins (its channel connects lazily);
* one that turns not ready drains: it gets no new sessions, its open streams
  go on (the pod may be finishing them while it terminates);
* one that disappears (its pod is deleted) is dropped and its channel closed,
  so its streams fail at once and recovery takes over
  (``outrider.coordinator.workers.draft_link``, ``target_link``): the target session
  is reopened on another replica from the history, the draft goes on at
  K = 0 until it can be reopened.

Every replica is asked what it serves before its first session; one whose
vocabulary differs from the first replica's is refused (logged) and never
routed to.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from outrider.coordinator.workers import discovery
from outrider.coordinator.workers.discovery import EndpointSliceWatch, ServiceRef
from outrider.coordinator.workers.prefixes import PrefixIndex, prompt_names
from outrider.engine_load import EngineLoad
from outrider.errors import Unavailable
from outrider.logging import get_logger
from outrider.rpc import CHANNEL_OPTIONS
from outrider.v1 import worker_pb2 as pb

log = get_logger(__name__)

# A worker that comes back is found again within a second or two, not after
# gRPC's default reconnect back-off of up to two minutes.
WORKER_CHANNEL_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
STATIC = "static"
DESCRIBE_TIMEOUT_S = 10.0
"""How long a replica may take to say what it serves before its first session."""


@dataclass(eq=False)
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: Any
    ready: bool = True
    """Takes new sessions (an endpoint: ready and not terminating)."""
    load: int = 0
    """Sessions this coordinator has open on it."""
    down_until: float = 0.0
    """A failure was seen: the other replicas go first until then (monotonic)."""
    checked: bool = False
    """It has said what it serves."""
    refused: bool = False
    """It serves another vocabulary than the first replica: never routed to."""
    removed: bool = False
    """Gone from the table (its pod was deleted); its channel is closed."""
    failures: int = 0
    """Failures since its last session opened."""
    steps: int = 0
    """Its engine's forward passes, as it last said (``outrider.engine_load``)."""

    def failed(self, *, for_s: float = 5.0, max_s: float = 60.0) -> None:
        """Sends new sessions to the others for ``for_s``, doubling with each
        failure in a row (a frozen worker keeps failing) up to ``max_s``."""
        self.failures += 1
        self.down_until = time.monotonic() + min(max_s, for_s * 2 ** (self.failures - 1))

    def opened(self) -> None:
        self.failures = 0

    def answered(self, load: EngineLoad | None) -> None:
        """Any answer of the replica: its engine's step count moves on."""
        if load is not None:
            self.steps = max(self.steps, load.steps)

    async def stepping(self, timeout_s: float, *, lately_s: float, since: int) -> int | None:
        """Its engine's progress — the steps it has begun and ended — where
        it is at work (busy, not frozen): it has begun or ended a step since
        progress ``since`` — what the asking call last heard — or the step
        under way began within ``lately_s``, or within twice the longest
        step it has measured, as a step longer than the deadline is still a
        step; a worker that answers without its engine's load is alive. A step that ended
        since may have answered the call, its answer on its way. Asked
        within ``timeout_s``; None when it is not at work or does not answer
        in time. Each call keeps its own progress: one's probe must not spend
        the news of a step for another waiting beside it."""
        try:
            info = await self.stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):  # (UsageError: its channel closed)
            return None
        if not info.HasField("load"):
            return since
        load = info.load
        self.steps = max(self.steps, load.steps)
        progress = 2 * load.steps - (load.running_s > 0)
        longest = max(load.curve_seconds, default=0.0)
        if progress > since or 0.0 < load.running_s < max(lately_s, 2 * longest):
            return progress
        return None

    def progress_heard(self) -> int:
        """The engine's progress (:meth:`stepping`) as it last said, its last
        step taken as under way then."""
        return 2 * self.steps - 1


class Replicas:
    """One role's routing table: worker address → channel, load, health."""

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        stub_class,
        *,
        credentials=None,
        kube_api=None,
        prefix_routing: bool = True,
    ) -> None:
        if not addresses:
            raise ValueError(f"at least one {role} worker address is needed")
        self.role = role
        self._stub_class = stub_class
        self._credentials = credentials
        self._services = [ServiceRef.parse(a) for a in addresses if discovery.is_service_address(a)]
        self._tls_names = {str(ref): f"{ref.service}.{ref.namespace}.svc" for ref in self._services}
        """The name a discovered pod's certificate is checked against: its Service's DNS name."""
        self._kube_api = kube_api
        self._owns_kube_api = False
        self._watches: list[tuple[EndpointSliceWatch, threading.Thread]] = []
        self._members: dict[str, Replica] = {}
        self._sources: dict[str, dict[str, bool]] = {}
        """Where members come from (static, or a k8s:// address) → address → takes new sessions."""
        self._closing: set[asyncio.Task] = set()
        """Channels and sessions being closed."""
        self._changed = asyncio.Event()
        self._reference: pb.WorkerInfo | None = None
        self._tiebreak = itertools.count()
        self.prefixes = PrefixIndex()
        """The prompt blocks sent to each replica (prefix-aware routing)."""
        self.prefix_routing = prefix_routing
        """Route by prefix (else to the least loaded)."""
        static = [a for a in addresses if not discovery.is_service_address(a)]
        if static:
            self.update(STATIC, dict.fromkeys(static, True))

    @property
    def members(self) -> dict[str, Replica]:
        return dict(self._members)

    async def start(self) -> None:
        """Starts following the EndpointSlices of the k8s:// addresses."""
        if not self._services or self._watches:
            return
        if self._kube_api is None:
            self._kube_api = await asyncio.to_thread(discovery.api_client)
            self._owns_kube_api = True
        loop = asyncio.get_running_loop()
        for ref in self._services:
            source = str(ref)
            watch = EndpointSliceWatch(
                ref,
                self._kube_api,
                self._update_on(loop, source),
            )
            # Its own thread: the blocking watch would hold a slot of the
            # loop's default executor for the process's whole life.
            thread = threading.Thread(target=watch.run, name=f"watch {source}", daemon=True)
            thread.start()
            self._watches.append((watch, thread))
        log.info(
            "watching worker endpointslices",
            role=self.role,
            services=[str(ref) for ref in self._services],
        )

    def _update_on(
        self, loop: asyncio.AbstractEventLoop, source: str
    ) -> Callable[[dict[str, bool]], None]:
        """For a watch's thread: :meth:`update` of ``source``, run on ``loop``."""

        def on_change(endpoints: dict[str, bool]) -> None:
            loop.call_soon_threadsafe(self.update, source, endpoints)

        return on_change

    def update(self, source: str, endpoints: dict[str, bool]) -> None:
        """Applies the endpoint set of one source: address → takes new sessions."""
        self._sources[source] = endpoints
        wanted: dict[str, bool] = {}
        origin: dict[str, str] = {}
        for from_source, source_endpoints in self._sources.items():
            for address, ready in source_endpoints.items():
                wanted[address] = wanted.get(address, False) or ready
                origin.setdefault(address, from_source)
        for address in self._members.keys() - wanted.keys():
            replica = self._members.pop(address)
            replica.removed = True
            self.prefixes.forget(replica)
            log.warning(
                "worker gone: its sessions fail over",
                role=self.role,
                address=address,
                sessions=replica.load,
            )
            self.close_later(replica.channel.close())  # ends the streams on it at once
        for address, ready in wanted.items():
            member = self._members.get(address)
            if member is None:
                self._members[address] = self._replica(
                    address, ready, self._tls_names.get(origin[address])
                )
                log.info("worker joined", role=self.role, address=address, ready=ready)
            elif member.ready != ready:
                member.ready = ready
                if ready:
                    log.info("worker ready: takes new sessions", role=self.role, address=address)
                else:
                    log.info(
                        "worker not ready: draining",
                        role=self.role,
                        address=address,
                        sessions=member.load,
                    )
        self._changed.set()

    def close_later(self, closing: Coroutine[Any, Any, None]) -> None:
        """Runs ``closing`` (of a channel, or of a session) on its own;
        :meth:`close` waits for it."""
        task = asyncio.ensure_future(closing)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _replica(self, address: str, ready: bool, tls_name: str | None) -> Replica:
        if self._credentials:
            # A pod is dialled by its IP, but its certificate names the Service.
            options = [
                *WORKER_CHANNEL_OPTIONS,
                *([("grpc.ssl_target_name_override", tls_name)] if tls_name else []),
            ]
            channel = grpc.aio.secure_channel(address, self._credentials, options=options)
        else:
            channel = grpc.aio.insecure_channel(address, options=WORKER_CHANNEL_OPTIONS)
        return Replica(address, channel, self._stub_class(channel), ready=ready)

    def pick(self, names: Sequence[bytes] = ()) -> Replica:
        """The replica for a new session on the prompt blocks ``names``
        (:func:`outrider.coordinator.workers.prefixes.prompt_names`): one that takes
        sessions, not recently failed, then the one most likely to hold the
        longest prefix of them among those its load allows
        (:meth:`PrefixIndex.choose`), then the least loaded, ties taken in turn."""
        candidates = [r for r in self._members.values() if r.ready and not r.refused]
        if not candidates:
            raise Unavailable(f"no {self.role} worker takes new sessions: {self._why_none()}")
        turn = next(self._tiebreak) % len(candidates)
        candidates = candidates[turn:] + candidates[:turn]
        now = time.monotonic()
        healthy = [r for r in candidates if r.down_until <= now]
        if not healthy:  # every one failed lately: the least loaded, in turn, prefix or not
            return min(candidates, key=lambda r: r.load)
        return self.prefixes.choose(healthy, names)[0]

    async def choose(self, timeout_s: float | None = None, prompt: Sequence[int] = ()) -> Replica:
        """:meth:`pick` for a session on ``prompt``, asking a replica what it
        serves before its first session; one that has not answered within
        ``timeout_s`` (at most DESCRIBE_TIMEOUT_S) counts as failed."""
        timeout_s = min(DESCRIBE_TIMEOUT_S, timeout_s or DESCRIBE_TIMEOUT_S)
        names = prompt_names(prompt) if self.prefix_routing and len(self._members) > 1 else []
        while True:
            replica = self.pick(names)
            if not replica.checked:
                try:
                    info = await replica.stub.GetWorkerInfo(
                        pb.GetWorkerInfoRequest(), timeout=timeout_s
                    )
                except grpc.aio.AioRpcError as exc:
                    replica.failed()
                    raise Unavailable(
                        f"{self.role} worker {replica.address}: {exc.details()}"
                    ) from exc
                self._check(replica, info)
            if not replica.refused:
                self.prefixes.sent(replica, names)
                return replica

    async def wait_ready(self, timeout_s: float) -> pb.WorkerInfo:
        """Waits up to ``timeout_s`` for a replica that takes sessions to
        answer; what it serves is the reference the others must match."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        error = ""
        while True:
            self._changed.clear()
            candidates = [r for r in self._members.values() if r.ready and not r.refused]
            if candidates:
                info, error = await self._first_answer(
                    candidates, max(0.05, min(deadline - loop.time(), 2.0))
                )
                if info is not None:
                    return info
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Unavailable(
                    f"no {self.role} worker answered within {timeout_s:g} s:"
                    f" {error or self._why_none()}"
                )
            # Until the endpoints change, or a short pause before asking again.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait(), min(remaining, 0.5) if candidates else remaining
                )

    async def _first_answer(
        self, candidates: list[Replica], timeout_s: float
    ) -> tuple[pb.WorkerInfo | None, str]:
        async def ask(replica: Replica) -> pb.WorkerInfo:
            return await replica.stub.GetWorkerInfo(
                pb.GetWorkerInfoRequest(), wait_for_ready=True, timeout=timeout_s
            )

        asking = {asyncio.create_task(ask(r)): r for r in candidates}
        pending, error = set(asking), ""
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    replica = asking[task]
                    try:
                        info = task.result()
                    except grpc.aio.AioRpcError as exc:
                        error = f"{replica.address}: {exc.details()}"
                        continue
                    self._check(replica, info)
                    if not replica.refused:
                        return info, ""
            return None, error
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _check(self, replica: Replica, info: pb.WorkerInfo) -> None:
        if self._reference is None:
            self._reference = info
        replica.checked = True
        if info.vocab_fingerprint != self._reference.vocab_fingerprint:
            replica.refused = True
            log.error(
                "worker refused: its vocabulary differs from the other replicas';"
                " serve one model on every replica",
                role=self.role,
                address=replica.address,
                model=info.model,
                vocab_fingerprint=info.vocab_fingerprint,
                expected_model=self._reference.model,
                expected_vocab_fingerprint=self._reference.vocab_fingerprint,
            )
        else:
            log.info("worker checked", role=self.role, address=replica.address, model=info.model)

    def _why_none(self) -> str:
        reasons = []
        for ref in self._services:
            endpoints = self._sources.get(str(ref))
            if endpoints is None:
                reasons.append(
                    f"the EndpointSlices of {ref} are not read yet"
                    " (see the Kubernetes API errors logged)"
                )
            elif endpoints:
                reasons.append(f"{ref} lists {len(endpoints)} endpoint(s), none ready")
            else:
                reasons.append(f"{ref} lists no endpoint")
        refused = [r.address for r in self._members.values() if r.refused]
        if refused:
            reasons.append(f"refused for serving another vocabulary: {', '.join(refused)}")
        return "; ".join(reasons)

    async def close(self) -> None:
        for watch, _ in self._watches:
            watch.stop()
        for _, thread in self._watches:
            await asyncio.to_thread(thread.join)
        if self._owns_kube_api:
            await asyncio.to_thread(self._kube_api.close)
        await asyncio.gather(*self._closing)  # sessions ending, before their channels close
        await asyncio.gather(*(r.channel.close() for r in self._members.values()))
