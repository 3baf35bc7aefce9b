"""The Helm chart's drafters: by default the gguf drafter on a CPU draft
pool; prompt lookup runs in the coordinator, with no draft-worker pool; the
drafters that run a model (gguf, model, int4, early-exit) run on the draft
pool, which the coordinator discovers."""

from __future__ import annotations

import subprocess

import kubernetes_validate
import pytest

from tests.deploy.conftest import (
    CHART,
    FULL_VALUES,
    NAMESPACE,
    RELEASE,
    by_kind,
    component,
    components,
    env_of,
    pod_spec,
)
from tests.deploy.test_chart_pools import parse_serve_args

DRAFT = f"{RELEASE}-outrider-draft"


def service_config(monkeypatch, objects: list[dict], role: str):
    """The config `outrider serve ROLE` builds from the environment the chart
    gives it (raises ValueError on a combination the service refuses)."""
    from outrider import flags
    from outrider.cli import ROLE_CONFIGS

    container = pod_spec(component(objects, "Deployment", role))["containers"][0]
    return flags.build(ROLE_CONFIGS[role], parse_serve_args(monkeypatch, container, role))


def coordinator_env(objects: list[dict]) -> dict[str, str | None]:
    return env_of(pod_spec(component(objects, "Deployment", "coordinator"))["containers"][0])


def test_by_default_the_targets_gguf_drafts_on_a_cpu_pool(default_objects, monkeypatch):
    assert components(default_objects) == ["coordinator", "draft", "target"]
    draft = service_config(monkeypatch, default_objects, "draft")
    assert (draft.drafter_kind, draft.model, draft.engine.device) == ("gguf", None, "cpu")
    assert draft.limits.max_cached_tokens == 16384  # resident from the start: 360 MiB
    assert not service_config(monkeypatch, default_objects, "coordinator").prompt_lookup


def test_prompt_lookup_runs_in_the_coordinator_with_no_draft_pool(lookup_objects, monkeypatch):
    assert DRAFT not in {o["metadata"]["name"] for o in lookup_objects}
    assert components(lookup_objects) == ["coordinator", "target"]
    env = coordinator_env(lookup_objects)
    assert (env["OUTRIDER_PROMPT_LOOKUP"], env["OUTRIDER_MAX_NGRAM"]) == ("true", "3")
    assert "OUTRIDER_DRAFT" not in env
    config = service_config(monkeypatch, lookup_objects, "coordinator")
    assert (config.prompt_lookup, config.max_ngram, config.draft) == (True, 3, ())


def test_a_gguf_pool_given_a_gpu_is_refused_with_the_way_out(helm):
    result = subprocess.run(
        [str(helm), "template", "demo", str(CHART), "--set", "draft.gpu.count=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "draft.drafter gguf runs on the CPU" in result.stderr


def test_draft_max_ngram_is_the_coordinators_max_ngram(render, monkeypatch):
    objects = render(sets=("draft.drafter=prompt-lookup", "draft.maxNgram=5"))
    assert coordinator_env(objects)["OUTRIDER_MAX_NGRAM"] == "5"
    assert service_config(monkeypatch, objects, "coordinator").max_ngram == 5


@pytest.mark.parametrize(
    "sets",
    [
        ("draft.drafter=gguf",),
        ("draft.drafter=int4",),
        ("draft.drafter=model",),
        ("draft.drafter=early-exit", "draft.draftLayers=8"),
    ],
    ids=["gguf", "int4", "model", "early-exit"],
)
def test_a_drafter_that_runs_a_model_runs_on_the_draft_pool(render, monkeypatch, sets):
    drafter = sets[0].split("=")[1]
    objects = render(sets=sets)
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        assert DRAFT in by_kind(objects, kind), kind
    draft_env = env_of(pod_spec(component(objects, "Deployment", "draft"))["containers"][0])
    assert draft_env["OUTRIDER_DRAFTER"] == drafter
    assert "OUTRIDER_MAX_NGRAM" not in draft_env  # (a flag of the coordinator's prompt lookup)
    env = coordinator_env(objects)
    assert env["OUTRIDER_DRAFT"] == f"k8s://{DRAFT}.{NAMESPACE}:grpc"
    assert "OUTRIDER_PROMPT_LOOKUP" not in env and "OUTRIDER_MAX_NGRAM" not in env
    coordinator = service_config(monkeypatch, objects, "coordinator")
    assert (coordinator.prompt_lookup, coordinator.draft) == (
        False,
        (f"k8s://{DRAFT}.{NAMESPACE}:grpc",),
    )
    assert service_config(monkeypatch, objects, "draft").drafter == drafter


def test_with_prompt_lookup_no_policy_or_scraped_service_is_left_for_a_draft_pool(
    render, full_objects
):
    """The full values (NetworkPolicies, a ServiceMonitor, TLS) with prompt
    lookup: the draft pool's objects go, and what is left still validates."""
    assert DRAFT in by_kind(full_objects, "NetworkPolicy")
    objects = render(FULL_VALUES, sets=("draft.drafter=prompt-lookup",))
    assert DRAFT not in {o["metadata"]["name"] for o in objects}
    assert set(by_kind(objects, "NetworkPolicy")) == {
        f"{RELEASE}-outrider-coordinator",
        f"{RELEASE}-outrider-target",
    }
    # The ServiceMonitor selects the release's Services: coordinator and target.
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    scraped = {
        name for name, service in by_kind(objects, "Service").items()
        if selector <= service["metadata"]["labels"].items()
    }  # fmt: skip
    assert scraped == {f"{RELEASE}-outrider-coordinator", f"{RELEASE}-outrider-target"}
    env = coordinator_env(objects)
    assert env["OUTRIDER_PROMPT_LOOKUP"] == "true" and "OUTRIDER_DRAFT" not in env
    for obj in objects:
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_whether_a_draft_pool_is_deployed_is_decided_in_one_helper():
    """The templates ask "outrider.draftWorker"; only that helper knows which
    drafter runs in the coordinator."""
    templates = CHART / "templates"
    for path in templates.iterdir():
        if path.name != "_helpers.tpl":
            assert "prompt-lookup" not in path.read_text(), path.name
    for name in (
        "draft-worker-deployment.yaml",
        "draft-worker-service.yaml",
        "draft-worker-pdb.yaml",
        "networkpolicy.yaml",
        "coordinator-deployment.yaml",
    ):
        assert 'include "outrider.draftWorker"' in (templates / name).read_text(), name


def test_the_suffix_drafter_runs_in_the_coordinator_with_no_draft_pool(render, monkeypatch):
    objects = render(sets=("draft.drafter=suffix", "draft.suffixCacheTokens=4096"))
    assert components(objects) == ["coordinator", "target"]
    env = coordinator_env(objects)
    assert (env["OUTRIDER_SUFFIX_DECODING"], env["OUTRIDER_SUFFIX_CACHE_TOKENS"]) == (
        "true",
        "4096",
    )
    assert "OUTRIDER_PROMPT_LOOKUP" not in env and "OUTRIDER_DRAFT" not in env
    config = service_config(monkeypatch, objects, "coordinator")
    assert (config.suffix_decoding, config.suffix_cache_tokens, config.draft) == (True, 4096, ())


def test_suffix_decoding_beside_a_draft_pool(render, monkeypatch):
    objects = render(sets=("draft.drafter=int4", "draft.suffixDecoding=true"))
    assert "draft" in components(objects)
    env = coordinator_env(objects)
    assert env["OUTRIDER_SUFFIX_DECODING"] == "true"
    assert env["OUTRIDER_DRAFT"] == f"k8s://{DRAFT}.{NAMESPACE}:grpc"
    config = service_config(monkeypatch, objects, "coordinator")
    assert config.suffix_decoding and not config.prompt_lookup and config.draft
    # Without a draft pool it means nothing: prompt lookup stays prompt lookup.
    env = coordinator_env(render(sets=("draft.drafter=prompt-lookup", "draft.suffixDecoding=true")))
    assert env["OUTRIDER_PROMPT_LOOKUP"] == "true" and "OUTRIDER_SUFFIX_DECODING" not in env
