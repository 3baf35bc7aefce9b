"""Prefix-aware routing: a new session goes to the replica that was sent
its prefix, within a bound on that replica's load (no workers: nothing
connects to these addresses)."""

import random

import pytest

from outrider.coordinator.workers.prefixes import BALANCE, prompt_names
from outrider.coordinator.workers.replicas import Replicas
from outrider.v1 import worker_pb2_grpc

ADDRESSES = ["127.0.0.2:50052", "127.0.0.3:50052"]


@pytest.fixture
async def replicas():
    table = Replicas("target", ADDRESSES, worker_pb2_grpc.TargetWorkerStub)
    yield table
    await table.close()


def route(replicas: Replicas, prompt: list[int]):
    """A session routed on ``prompt`` and opened there."""
    names = prompt_names(prompt)
    replica = replicas.pick(names)
    replicas.prefixes.sent(replica, names)
    replica.load += 1
    return replica


def system_prompts(n: int, tokens: int = 64) -> list[list[int]]:
    rng = random.Random(n)
    return [[rng.randrange(1000) for _ in range(tokens)] for _ in range(n)]


async def test_a_session_goes_where_its_prefix_went_and_a_new_prefix_to_the_least_loaded(
    replicas,
):
    a, b = system_prompts(2)
    first = route(replicas, [*a, 1, 2])
    other = route(replicas, [*b, 3])  # no replica holds b: the least loaded
    assert other is not first
    assert route(replicas, [*a, 7, 8, 9]) is first
    assert route(replicas, [*b, 4]) is other


async def test_one_hot_prefix_fills_its_replica_to_the_bound_then_spills(replicas):
    (hot,) = system_prompts(1)
    chosen = [route(replicas, [*hot, i]) for i in range(16)]
    loads = sorted(r.load for r in replicas.members.values())
    assert loads[1] <= BALANCE * (16 / 2) + 1  # within the bound
    assert loads[0] >= 16 - (BALANCE * 8 + 1)
    assert chosen[0] is chosen[1]  # the prefix's replica first


async def test_without_names_the_least_loaded_takes_it_in_turn(replicas):
    picked = [replicas.pick() for _ in range(4)]
    assert {r.address for r in picked} == set(ADDRESSES)


async def test_a_gone_replica_is_forgotten(replicas):
    (a,) = system_prompts(1)
    first = route(replicas, [*a, 1])
    others = {r.address: True for r in replicas.members.values() if r is not first}
    replicas.update("static", others)
    assert replicas.prefixes.matched(first, prompt_names([*a, 1])) == 0
