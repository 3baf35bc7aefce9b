"""Each service collects its garbage and freezes what is left before it
reports SERVING (``outrider.rpc.freeze_startup_heap``), so that a full
collection while serving walks only what serving allocated
(docs/design.md#components)."""

from __future__ import annotations

import json

import pytest

from tests.stress.cluster import Service, start_stack

pytestmark = pytest.mark.stress
INFO = ("--log-level", "info")


def serving_line(service: Service) -> dict:
    """The structured log line the service wrote when it began serving."""
    for line in service.log_file.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "serving":
            return event
    raise AssertionError(f"the {service.name} logged no 'serving' line:\n{service.log_tail()}")


async def test_each_service_freezes_its_start_up_heap_before_it_serves(cluster, tiny_target_dir):
    stack = await start_stack(
        cluster,
        tiny_target_dir,
        tiny_target_dir,
        target_args=INFO,
        draft_args=INFO,
        coordinator_args=INFO,
    )
    for service in (stack.coordinator, *stack.workers):
        # Imports alone (grpc, transformers' tokenizer; torch in a worker)
        # leave well over 10k objects; a service that froze nothing has 0.
        assert serving_line(service)["frozen_objects"] > 10_000, service.name
