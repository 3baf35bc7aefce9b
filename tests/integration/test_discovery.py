"""Worker discovery through the Kubernetes API: kmock's Kubernetes emulator
served over real HTTP on 127.0.0.1, read by the official ``kubernetes``
client. The routing table follows the EndpointSlices (added, made not ready,
removed), sessions stay on the pod they opened on, and the sessions of a pod
that goes away are recovered on another one with identical output.

What kmock does differently from a real API server, and how the tests cope:
it ignores ``labelSelector`` (the tests assert the coordinator sends it, and
publish one Service per namespace), lists with resourceVersion "..." and
replays the current objects as ADDED at the start of every watch (the
coordinator applies ADDED as "this slice is now", so a replay is harmless).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import kmock
import pytest
from kubernetes import client as k8s

from outrider.client import AsyncClient
from outrider.config import Recovery
from outrider.coordinator.workers.grpc_client import GrpcTargetClient
from outrider.coordinator.workers.replicas import Replicas
from outrider.errors import Unavailable
from outrider.rpc import start_server
from outrider.sampling import SamplingParams
from outrider.speculation import Proposal
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc
from tests.integration.harness import reference_greedy, running_stack

NS = "llm"
SERVICE = f"k8s://target.{NS}:grpc"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
NO_EOS = -1
MAX_NEW = 120
FAST = Recovery(draft_deadline_s=2.0, draft_backoff_s=0.05, target_attempts=3)


class Kube:
    """The emulated API server, and the EndpointSlice edits the tests make over HTTP."""

    def __init__(self, emulator: kmock.KubernetesEmulator, api: k8s.ApiClient) -> None:
        self.emulator = emulator
        self.api = api

    async def create(self, name, endpoints, *, port=50052, port_name="grpc", address_type="IPv4"):
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {"kubernetes.io/service-name": "target"},
            },
            "addressType": address_type,
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": endpoints,
        }
        response = await self.emulator.post(SLICES, json=body)
        assert response.status == 200, await response.text()

    async def set_endpoints(self, name, endpoints):
        response = await self.emulator.patch(f"{SLICES}/{name}", json={"endpoints": endpoints})
        assert response.status == 200, await response.text()

    async def delete(self, name):
        response = await self.emulator.delete(f"{SLICES}/{name}")
        assert response.status == 200, await response.text()

    def requests(self, action) -> list:
        return list(self.emulator[action])


def endpoint(ip, *, ready=True, serving=None, terminating=None):
    conditions = {"ready": ready, "serving": serving, "terminating": terminating}
    conditions = {name: value for name, value in conditions.items() if value is not None}
    return {"addresses": [ip], "conditions": conditions}


@pytest.fixture
async def kube():
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        emulator.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
            kind="EndpointSlice", namespaced=True
        )
        api = k8s.ApiClient(k8s.Configuration(host=str(server.url).rstrip("/")))
        try:
            yield Kube(emulator, api)
        finally:
            api.close()


async def until(condition, what: str, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


def table(replicas: Replicas) -> dict[str, bool]:
    """The routing table: address → takes new sessions."""
    return {address: replica.ready for address, replica in replicas.members.items()}


# --- the routing table (no workers: nothing connects to these addresses) ----


async def test_the_routing_table_follows_endpointslices_added_made_not_ready_and_removed(kube):
    replicas = Replicas("target", [SERVICE], worker_pb2_grpc.TargetWorkerStub, kube_api=kube.api)
    await replicas.start()
    try:
        # Added: a missing `ready` counts as ready; a not-ready endpoint is
        # known but gets no sessions.
        await kube.create(
            "target-a",
            [
                endpoint("127.0.0.2"),
                endpoint("127.0.0.3", ready=None),
                endpoint("127.0.0.4", ready=False),
            ],
        )
        expected = {"127.0.0.2:50052": True, "127.0.0.3:50052": True, "127.0.0.4:50052": False}
        await until(lambda: table(replicas) == expected, f"table == {expected}")
        assert {replicas.pick().address for _ in range(6)} == {"127.0.0.2:50052", "127.0.0.3:50052"}

        # Terminating (still serving): drains. The not-ready one became ready.
        await kube.set_endpoints(
            "target-a",
            [
                endpoint("127.0.0.2", ready=False, serving=True, terminating=True),
                endpoint("127.0.0.3"),
                endpoint("127.0.0.4"),
            ],
        )
        expected = {"127.0.0.2:50052": False, "127.0.0.3:50052": True, "127.0.0.4:50052": True}
        await until(lambda: table(replicas) == expected, f"table == {expected}")
        draining = replicas.members["127.0.0.2:50052"]
        assert not draining.removed

        # A second slice (IPv6, another port); a slice without the named port adds nothing.
        await kube.create("target-b", [endpoint("::1")], port=50060, address_type="IPv6")
        await kube.create("target-c", [endpoint("127.0.0.9")], port_name="metrics")
        await until(lambda: "[::1]:50060" in table(replicas), "the IPv6 endpoint joins")
        assert "127.0.0.9:50052" not in table(replicas)

        # Removed: the endpoint leaves the slice (its pod is deleted), then a whole slice goes.
        await kube.set_endpoints("target-a", [endpoint("127.0.0.3"), endpoint("127.0.0.4")])
        await until(lambda: "127.0.0.2:50052" not in table(replicas), "the removed endpoint leaves")
        assert draining.removed
        await kube.delete("target-b")
        expected = {"127.0.0.3:50052": True, "127.0.0.4:50052": True}
        await until(lambda: table(replicas) == expected, f"table == {expected}")
    finally:
        await replicas.close()

    # List, then watch from the list's resourceVersion, both for this Service only.
    selector = "kubernetes.io/service-name=target"
    (listed,) = kube.requests(kmock.action.LIST)
    watches = kube.requests(kmock.action.WATCH)
    assert listed.params.get("labelSelector") == selector
    assert watches and all(w.params.get("labelSelector") == selector for w in watches)
    assert all(
        w.params.get("resourceVersion") == "..." for w in watches
    )  # kmock's list resourceVersion


async def test_with_no_ready_endpoint_the_coordinator_says_why_instead_of_hanging(kube):
    replicas = Replicas("target", [SERVICE], worker_pb2_grpc.TargetWorkerStub, kube_api=kube.api)
    await replicas.start()
    try:
        await kube.create("target-a", [endpoint("127.0.0.2", ready=False)])
        await until(
            lambda: table(replicas) == {"127.0.0.2:50052": False}, "the not-ready endpoint is known"
        )
        start = time.monotonic()
        with pytest.raises(Unavailable) as waited:
            await replicas.wait_ready(0.5)
        assert time.monotonic() - start < 2.0
        assert f"{SERVICE} lists 1 endpoint(s), none ready" in str(waited.value)
        with pytest.raises(Unavailable, match="no target worker takes new sessions"):
            replicas.pick()
    finally:
        await replicas.close()


async def test_the_watch_lists_again_after_410_gone_and_rides_out_api_errors(kube):
    lists, watches = itertools.count(), itertools.count()
    # The first list fails (the API server is overloaded), the first watch expires at once.
    kube.emulator[kmock.action.LIST] << (
        lambda: (
            kmock.KubernetesError(
                status=503, reason="ServiceUnavailable", message="etcd is not ready"
            )
            if next(lists) == 0
            else NotImplemented
        )
    )
    expired = {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "code": 410,
            "reason": "Expired",
            "message": "too old resource version",
        },
    }
    kube.emulator[kmock.action.WATCH] << (
        lambda: json.dumps(expired).encode() + b"\n" if next(watches) == 0 else NotImplemented
    )
    await kube.create("target-a", [endpoint("127.0.0.2")])
    replicas = Replicas("target", [SERVICE], worker_pb2_grpc.TargetWorkerStub, kube_api=kube.api)
    await replicas.start()
    try:
        await until(
            lambda: table(replicas) == {"127.0.0.2:50052": True}, "listed after the failed list"
        )
        await until(lambda: len(kube.requests(kmock.action.WATCH)) == 2, "watching again after 410")
        # failed list, list, watch → 410, list again, watch
        assert len(kube.requests(kmock.action.LIST)) == 3
        await kube.create("target-b", [endpoint("127.0.0.3")])
        await until(lambda: "127.0.0.3:50052" in table(replicas), "the new watch delivers events")
    finally:
        await replicas.close()


# --- with real workers ---------------------------------------------------------


def publish_to(kube: Kube, slice_of: dict[str, str]):
    """Publishes each target worker as the one endpoint of its own
    EndpointSlice (the workers share 127.0.0.1, so they differ by port)."""

    async def publish(addresses: list[str]) -> list[str]:
        for i, address in enumerate(addresses):
            host, port = address.rsplit(":", 1)
            slice_of[address] = f"target-{i}"
            await kube.create(f"target-{i}", [endpoint(host)], port=int(port))
        return [SERVICE]

    return publish


@pytest.fixture(scope="module")
def prompt_ids(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)("Once upon a time there was a fox")[
        "input_ids"
    ]


async def test_sessions_stay_on_their_pod_and_new_ones_avoid_a_not_ready_one(
    kube, tiny_target_dir, prompt_ids
):
    slice_of = {}
    async with running_stack(
        tiny_target_dir,
        drafter=None,
        target_replicas=2,
        publish_targets=publish_to(kube, slice_of),
        kube_api=kube.api,
    ) as stack:
        client = GrpcTargetClient([SERVICE], kube_api=kube.api)
        await client.start()
        sessions = []
        try:
            await client.info(5)
            greedy = SamplingParams()

            async def open_session():
                session, _ = await client.open(
                    prompt_ids, request_id=f"r{len(sessions)}", sampling=greedy
                )
                sessions.append(session)
                return session

            def where(session) -> int:
                return [server.address for server in stack.target_servers].index(session.address)

            def open_counts() -> list[int]:
                return [len(engine.store) for engine in stack.targets]

            first = await open_session()
            await open_session()
            assert open_counts() == [1, 1]  # spread by load
            pinned = where(first)

            # The first session's pod turns not ready: it keeps that session, gets no new ones.
            await kube.set_endpoints(slice_of[first.address], [endpoint("127.0.0.1", ready=False)])
            await until(
                lambda: not client.replicas.members[first.address].ready, "the pod is not ready"
            )
            reply = await first.verify(len(prompt_ids), Proposal([]))
            assert reply.value.verdict.num_accepted == 0
            for _ in range(2):
                await open_session()
            counts = open_counts()
            assert counts[pinned] == 1 and counts[1 - pinned] == 3

            # Ready again: the least-loaded pod takes the next session.
            await kube.set_endpoints(slice_of[first.address], [endpoint("127.0.0.1")])
            await until(
                lambda: client.replicas.members[first.address].ready, "the pod is ready again"
            )
            assert where(await open_session()) == pinned
            assert await first.verify(len(prompt_ids) + 1, Proposal([])) is not None
        finally:
            for session in sessions:
                session.close()
            await client.close()
        assert await stack.sessions_left() == (0, 0)


async def test_a_removed_target_pods_session_is_recovered_on_the_other_with_identical_output(
    kube, tiny_target_dir, tiny_draft_other_dir, prompt_ids
):
    reference = reference_greedy(tiny_target_dir, prompt_ids, MAX_NEW, eos=None)
    slice_of = {}
    async with running_stack(
        tiny_target_dir,
        draft_dir=tiny_draft_other_dir,
        eos_token_ids={NO_EOS},
        target_replicas=2,
        recovery=FAST,
        publish_targets=publish_to(kube, slice_of),
        kube_api=kube.api,
    ) as stack:
        # The busy pod stops answering (its engine is held), and then its
        # EndpointSlice says it is gone: the stream can only finish on the
        # other pod, through discovery closing the gone pod's channel.
        held = threading.Event()

        async def remove_the_busy_pod():
            (busy,) = [i for i, engine in enumerate(stack.targets) if len(engine.store)]
            engine = stack.targets[busy]
            verify = engine.verify
            engine.verify = lambda *args: (held.wait(30), verify(*args))[1]
            await kube.delete(slice_of[stack.target_servers[busy].address])
            remove_the_busy_pod.busy = busy

        try:
            async with AsyncClient(stack.address, timeout=60) as client:
                chunks = []
                stream = client.stream(
                    token_ids=prompt_ids, max_new_tokens=MAX_NEW, num_speculative_tokens=3
                )
                async with asyncio.timeout(20):
                    async for chunk in stream:
                        if not chunks:
                            await remove_the_busy_pod()
                        chunks.append(chunk)
        finally:
            held.set()
        assert [t for c in chunks for t in c.token_ids] == reference
        survivor = stack.targets[1 - remove_the_busy_pod.busy]
        assert await stack.sessions_left() == (0, 0)
        assert survivor.store.cached_tokens == 0


class _DescribedWorker(worker_pb2_grpc.TargetWorkerServicer):
    """A worker that only says what it serves."""

    def __init__(self, vocab_fingerprint: str) -> None:
        self.info = pb.WorkerInfo(
            model=f"m-{vocab_fingerprint}", vocab_size=100, vocab_fingerprint=vocab_fingerprint
        )

    async def GetWorkerInfo(self, request, context):
        return self.info


async def test_a_pod_serving_another_vocabulary_is_refused(kube):
    servers = [
        await start_server(
            lambda s, f=fingerprint: worker_pb2_grpc.add_TargetWorkerServicer_to_server(
                _DescribedWorker(f), s
            ),
            ["outrider.v1.TargetWorker"],
        )
        for fingerprint in ("aaaa", "bbbb")
    ]
    replicas = Replicas("target", [SERVICE], worker_pb2_grpc.TargetWorkerStub, kube_api=kube.api)
    await replicas.start()
    try:
        first, other = (server.address for server in servers)
        await kube.create("target-0", [endpoint("127.0.0.1")], port=servers[0].port)
        assert (await replicas.wait_ready(5)).vocab_fingerprint == "aaaa"

        await kube.create("target-1", [endpoint("127.0.0.1")], port=servers[1].port)
        await until(lambda: other in table(replicas), "the second pod joins")
        assert {(await replicas.choose()).address for _ in range(4)} == {first}
        assert replicas.members[other].refused and not replicas.members[first].refused
    finally:
        await replicas.close()
        for server in servers:
            await server.stop(None)
