"""Health, reflection and model info on real services."""

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from outrider.client import AsyncClient
from tests.integration.harness import running_stack


async def test_health_reports_serving_and_reflection_lists_the_services(tiny_target_dir):
    async with running_stack(tiny_target_dir, drafter="prompt-lookup") as stack:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "outrider.v1.Coordinator"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            names = {s.name async for reply in stream for s in reply.list_services_response.service}
        assert {"outrider.v1.Coordinator", "grpc.health.v1.Health"} <= names


async def test_model_info_describes_target_and_drafter(tiny_target_dir):
    async with running_stack(tiny_target_dir, drafter="prompt-lookup", k=3) as stack:
        async with AsyncClient(stack.address) as client:
            info = await client.model_info()
    assert info.target_model == str(tiny_target_dir)
    assert info.max_context_length == 512
    assert info.default_num_speculative_tokens == 3
    assert (info.drafter, info.draft_model) == ("prompt-lookup", "prompt-lookup")


async def test_the_coordinator_learns_how_many_tokens_a_row_the_targets_graphs_hold(
    tiny_target_dir, monkeypatch
):
    """(Adaptive K stays within them: outrider.coordinator.adaptive.session.adaptive_k_max.) On
    the CPU no step is graphed; a CUDA target's runner reports its largest
    bucket (tests/cuda), stood in for here."""
    from outrider.engine.runner import PagedRunner

    async with running_stack(tiny_target_dir, drafter="prompt-lookup") as stack:
        assert stack.coordinator is not None
        assert stack.coordinator.models.target.graphed_tokens_per_row == 0
    monkeypatch.setattr(PagedRunner, "graphed_tokens_per_row", property(lambda self: 9))
    async with running_stack(tiny_target_dir, drafter="prompt-lookup") as stack:
        assert stack.coordinator is not None
        assert stack.coordinator.models.target.graphed_tokens_per_row == 9
