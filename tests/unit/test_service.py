"""The coordinator servicer's translation, without workers: a request's
speculation switches become the loop's GenerationRequest, the loop's Stats
become GenerationStats, the policy becomes ModelInfo."""

import pytest

from outrider.coordinator.request_stats import Stats
from outrider.coordinator.requests import SpeculationDefaults
from outrider.coordinator.served_models import Models
from outrider.coordinator.service import CoordinatorService, stats_to_pb
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.v1 import coordinator_pb2 as pb

TARGET = WorkerInfo(
    model="target", drafter="", vocab_size=100, vocab_fingerprint="", max_context=64
)
NO_DRAFT = None
SOME_DRAFT = object()  # request_from_pb only asks whether there is one


def service(
    *, draft=SOME_DRAFT, default_num_speculative_tokens: int = 4, **policy
) -> CoordinatorService:
    return CoordinatorService(
        Models(tokenizer=None, eos_token_ids=frozenset(), target=TARGET),
        target=object(),
        draft=draft,
        defaults=SpeculationDefaults(
            default_num_speculative_tokens=default_num_speculative_tokens,
            max_num_speculative_tokens=8,
            default_max_new_tokens=16,
            **policy,
        ),
    )


def request(**speculation) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]), speculation=pb.SpeculationParams(**speculation)
    )


@pytest.mark.parametrize(
    "default_pipeline, speculation, expected",
    [
        (False, {}, False),
        (True, {}, True),  # unset: the server's default
        (False, {"pipeline": True}, True),
        (True, {"pipeline": False}, False),  # the request wins
        (False, {"pipeline": True, "adaptive": True}, True),
    ],
)
def test_a_request_pipelines_as_it_asks_else_as_the_server_defaults(
    default_pipeline, speculation, expected
):
    mapped = service(default_pipeline=default_pipeline).request_from_pb(request(**speculation))
    assert mapped.pipeline is expected


@pytest.mark.parametrize(
    "draft, default_num_speculative_tokens, speculation",
    [
        (SOME_DRAFT, 4, {"pipeline": True, "num_speculative_tokens": 0}),
        (SOME_DRAFT, 0, {"pipeline": True}),
        (NO_DRAFT, 4, {"pipeline": True}),
    ],
)
def test_a_request_without_drafts_runs_unpipelined_rather_than_being_refused(
    draft, default_num_speculative_tokens, speculation
):
    mapped = service(
        draft=draft,
        default_num_speculative_tokens=default_num_speculative_tokens,
        default_pipeline=True,
    ).request_from_pb(request(**speculation))
    assert mapped.num_speculative_tokens == 0 and mapped.pipeline is False


def test_stats_carry_the_pipeline_counts_and_the_critical_path_overhead():
    stats = Stats(rounds=3, pipeline=True, speculation_hits=2, speculation_misses=1)
    stats.critical_path_overheads_s.extend([0.5, 0.25, 0.125])
    sent = stats_to_pb(stats)
    assert sent.pipeline and (sent.speculation_hits, sent.speculation_misses) == (2, 1)
    assert sent.critical_path_overhead_s_p50 == 0.25
    assert not stats_to_pb(Stats()).pipeline


async def test_model_info_reports_the_default_pipeline():
    assert (
        await service(default_pipeline=True).GetModelInfo(pb.GetModelInfoRequest(), None)
    ).default_pipeline
    assert not (await service().GetModelInfo(pb.GetModelInfoRequest(), None)).default_pipeline
