"""The Helm chart's worker pools: GPUs, devices, tensor parallelism,
embedded models, and the flags and environment each service is given
(each service parses what the chart renders for it)."""

from __future__ import annotations

import os
import re

import pytest

from outrider.model_specs import EMBEDDED_MODELS
from tests.deploy.conftest import (
    CHART,
    FULL_VALUES,
    component,
    components,
    env_of,
    pod_spec,
)


def test_gpu_pools_get_their_gpus_node_pools_and_settings(full_objects):
    # target: device and dtype left to the chart; draft: both set explicitly
    expected = {
        "target": (4, "gpu-large", "cuda", "auto", "8"),
        "draft": (1, "gpu-small", "cuda:0", "bfloat16", "4"),
    }
    for name, (gpus, pool, device, dtype, threads) in expected.items():
        spec = pod_spec(component(full_objects, "Deployment", name))
        container = spec["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert spec["nodeSelector"] == {"node-pool": pool}
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        env = env_of(container)
        assert (env["OUTRIDER_DEVICE"], env["OUTRIDER_DTYPE"], env["OUTRIDER_THREADS"]) == (
            device,
            dtype,
            threads,
        )
    target_env = env_of(pod_spec(component(full_objects, "Deployment", "target"))["containers"][0])
    draft_env = env_of(pod_spec(component(full_objects, "Deployment", "draft"))["containers"][0])
    assert (
        target_env["OUTRIDER_MAX_TOKENS_PER_STEP"] == "4096"
        and "OUTRIDER_ENFORCE_EAGER" not in target_env
    )
    assert (
        draft_env["OUTRIDER_ENFORCE_EAGER"] == "true"
        and "OUTRIDER_MAX_TOKENS_PER_STEP" not in draft_env
    )
    target = pod_spec(component(full_objects, "Deployment", "target"))
    assert "podAntiAffinity" in target["affinity"]
    assert env_of(target["containers"][0])["OUTRIDER_MODEL"] == "/models/Llama-3.1-70B-Instruct"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in target["containers"][0][
        "volumeMounts"
    ]
    draft_env = env_of(pod_spec(component(full_objects, "Deployment", "draft"))["containers"][0])
    assert (draft_env["OUTRIDER_DRAFTER"], draft_env["OUTRIDER_MODEL"]) == (
        "model",
        "meta-llama/Llama-3.2-1B-Instruct",
    )


def test_cpu_defaults_request_no_gpu_and_run_on_the_cpu(default_objects):
    for name in ("target", "draft"):
        container = pod_spec(component(default_objects, "Deployment", name))["containers"][0]
        resources = container["resources"]
        assert not any(
            "gpu" in key for key in {**resources.get("limits", {}), **resources.get("requests", {})}
        )
        env = env_of(container)
        assert (env["OUTRIDER_DEVICE"], env["OUTRIDER_DTYPE"]) == (
            "cpu",
            "auto",
        )  # auto: float32 on the CPU
        assert "OUTRIDER_MAX_TOKENS_PER_STEP" not in env and "OUTRIDER_ENFORCE_EAGER" not in env


@pytest.mark.parametrize("name", ["target", "draft"])
def test_a_pool_given_a_gpu_runs_its_model_on_cuda(render, name):
    """gpu.count alone moves a pool onto its GPU: the device plugin's resource
    is requested, and the worker is told --device cuda (OUTRIDER_DEVICE)."""
    objects = render(sets=("draft.drafter=int4", f"{name}.gpu.count=1"))
    container = pod_spec(component(objects, "Deployment", name))["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env_of(container)["OUTRIDER_DEVICE"] == "cuda"
    other = "draft" if name == "target" else "target"
    assert (
        env_of(pod_spec(component(objects, "Deployment", other))["containers"][0])[
            "OUTRIDER_DEVICE"
        ]
        == "cpu"
    )


def test_a_pools_tensor_parallel_size_requests_a_gpu_a_rank_and_reaches_its_worker(
    render, full_objects
):
    """Each pool sets its own: the full values' 70B target runs over its 4
    GPUs, its draft on one; a size above gpu.count raises the request."""
    target = pod_spec(component(full_objects, "Deployment", "target"))
    assert env_of(target["containers"][0])["OUTRIDER_TENSOR_PARALLEL_SIZE"] == "4"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in target["containers"][0]["volumeMounts"]
    draft = pod_spec(component(full_objects, "Deployment", "draft"))
    assert "OUTRIDER_TENSOR_PARALLEL_SIZE" not in env_of(draft["containers"][0])
    assert all(v["name"] != "dshm" for v in draft["volumes"])

    objects = render(
        sets=(
            "target.gpu.count=1",
            "target.tensorParallelSize=8",
            "draft.drafter=model",
            "draft.gpu.count=1",
            "draft.tensorParallelSize=2",
        )
    )
    for name, size in (("target", 8), ("draft", 2)):
        spec = pod_spec(component(objects, "Deployment", name))
        container = spec["containers"][0]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == size
        assert container["resources"]["limits"]["nvidia.com/gpu"] == size
        assert env_of(container)["OUTRIDER_TENSOR_PARALLEL_SIZE"] == str(size)
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
    cpu_pool = pod_spec(
        component(render(sets=("target.tensorParallelSize=2",)), "Deployment", "target")
    )["containers"][0]
    assert env_of(cpu_pool)["OUTRIDER_TENSOR_PARALLEL_SIZE"] == "2"
    assert not any("gpu" in key for key in cpu_pool["resources"].get("limits", {}))


@pytest.mark.parametrize(
    "sets, device",
    [
        (("target.gpu.count=1", "target.device=cpu"), "cpu"),
        (("target.gpu.count=2", "target.device=cuda:1"), "cuda:1"),
        (("target.device=auto",), "auto"),
    ],
)
def test_an_explicit_device_wins_over_the_one_gpu_count_implies(render, sets, device):
    objects = render(sets=sets)
    assert (
        env_of(pod_spec(component(objects, "Deployment", "target"))["containers"][0])[
            "OUTRIDER_DEVICE"
        ]
        == device
    )


def test_an_embedded_model_is_fetched_by_an_init_container_and_others_are_not(
    default_objects, lookup_objects, full_objects
):
    # Defaults: the target and the coordinator's tokenizer are the embedded
    # model; the gguf drafter runs the embedded model's GGUF, which its fetch
    # keeps (prompt lookup, in the coordinator, needs no draft pool).
    for objects in (default_objects, lookup_objects):
        for name in components(objects):
            (init,) = pod_spec(component(objects, "Deployment", name))["initContainers"]
            assert init["args"] == ["models", "fetch", "smollm2-135m-instruct"]
            assert {"name": "cache", "mountPath": "/var/cache/outrider"} in init["volumeMounts"]
    # Directories and hub ids are loaded by the service itself.
    for name in ("coordinator", "target", "draft"):
        assert "initContainers" not in pod_spec(component(full_objects, "Deployment", name))


def test_the_chart_knows_the_same_embedded_models_as_outrider():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    block = re.search(
        r'define "outrider.embeddedModels" -}}\n(.*?)\n\{\{- end', helpers, re.S
    ).group(1)
    assert set(block.split()) == set(EMBEDDED_MODELS)


def test_worker_flags_reach_the_services_as_outrider_environment(render):
    objects = render(
        sets=("draft.drafter=early-exit", "draft.draftLayers=8", "target.trustRemoteCode=true",
              "target.maxTokensPerStep=512", "target.enforceEager=true")
    )  # fmt: skip
    draft_env = env_of(pod_spec(component(objects, "Deployment", "draft"))["containers"][0])
    assert (draft_env["OUTRIDER_DRAFTER"], draft_env["OUTRIDER_DRAFT_LAYERS"]) == (
        "early-exit",
        "8",
    )
    # early exit cuts the default model: embedded, so it is fetched first
    assert (
        pod_spec(component(objects, "Deployment", "draft"))["initContainers"][0]["args"][-1]
        == "smollm2-135m-instruct"
    )
    target_env = env_of(pod_spec(component(objects, "Deployment", "target"))["containers"][0])
    assert target_env["OUTRIDER_TRUST_REMOTE_CODE"] == "true"
    assert (target_env["OUTRIDER_MAX_TOKENS_PER_STEP"], target_env["OUTRIDER_ENFORCE_EAGER"]) == (
        "512",
        "true",
    )


def test_coordinator_pipeline_reaches_the_coordinator_as_its_pipeline_flag(render, monkeypatch):
    coordinator = pod_spec(component(render(), "Deployment", "coordinator"))["containers"][0]
    assert "OUTRIDER_PIPELINE" not in env_of(coordinator)
    assert parse_serve_args(monkeypatch, coordinator, "coordinator").pipeline is False
    coordinator = pod_spec(
        component(render(sets=("coordinator.pipeline=true",)), "Deployment", "coordinator")
    )
    assert (
        parse_serve_args(monkeypatch, coordinator["containers"][0], "coordinator").pipeline is True
    )


def test_every_outrider_variable_the_chart_sets_is_a_flag_of_that_service(objects):
    """The chart configures the services through OUTRIDER_* variables; each
    must be a flag of `outrider serve ROLE` (OUTRIDER_CACHE_DIR is read by the
    model cache, not a flag)."""
    from outrider.cli import build_parser

    roles = (
        build_parser()
        ._subparsers._group_actions[0]
        .choices["serve"]
        ._subparsers._group_actions[0]
        .choices
    )
    for name in components(objects):
        flags = {
            "OUTRIDER_" + option.lstrip("-").upper().replace("-", "_")
            for action in roles[name]._actions
            for option in action.option_strings
            if option.startswith("--")
        }
        container = pod_spec(component(objects, "Deployment", name))["containers"][0]
        unknown = (
            {k for k in env_of(container) if k.startswith("OUTRIDER_")}
            - flags
            - {"OUTRIDER_CACHE_DIR"}
        )
        assert not unknown, f"{name}: {sorted(unknown)} are not flags of `outrider serve {name}`"


def parse_serve_args(monkeypatch, container: dict, role: str):
    """`outrider serve ROLE`'s arguments, built from the container's OUTRIDER_*
    environment alone (as the service builds them in its pod)."""
    from outrider.cli import build_parser

    for key in [k for k in os.environ if k.startswith("OUTRIDER_")]:
        monkeypatch.delenv(key)
    for key, value in env_of(container).items():
        if key.startswith("OUTRIDER_") and value is not None:
            monkeypatch.setenv(key, value)
    return build_parser().parse_args(["serve", role])


def test_every_service_parses_the_values_the_chart_gives_it(objects, monkeypatch):
    """The values, not only the names: Helm reads numbers in values files as
    floats, and a quoted 1048576 renders as 1.048576e+06, which no int flag takes."""
    for name in components(objects):
        container = pod_spec(component(objects, "Deployment", name))["containers"][0]
        args = parse_serve_args(monkeypatch, container, name)  # raises on a value no flag takes
        if name != "coordinator":
            cached = env_of(container).get("OUTRIDER_MAX_CACHED_TOKENS")
            assert args.max_cached_tokens == (int(cached) if cached else None)


@pytest.mark.parametrize("name", ["target", "draft"])
def test_each_worker_parses_the_device_settings_the_chart_gives_it(render, monkeypatch, name):
    objects = render(
        FULL_VALUES,
        sets=(
            f"{name}.maxTokensPerStep=1024",
            f"{name}.maxPrefillTokens=8192",
            f"{name}.enforceEager=true",
            f"{name}.dtype=float16",
        ),
    )
    args = parse_serve_args(
        monkeypatch, pod_spec(component(objects, "Deployment", name))["containers"][0], name
    )
    device = "cuda" if name == "target" else "cuda:0"
    assert (
        args.device,
        args.dtype,
        args.max_tokens_per_step,
        args.max_prefill_tokens,
        args.enforce_eager,
    ) == (device, "float16", 1024, 8192, True)


def test_large_integers_from_a_values_file_render_as_integers(full_objects):
    env = env_of(pod_spec(component(full_objects, "Deployment", "target"))["containers"][0])
    assert env["OUTRIDER_MAX_CACHED_TOKENS"] == "1048576"  # ci/full-values.yaml


def test_max_cached_tokens_0_leaves_the_kv_budget_to_the_worker(full_objects, default_objects):
    """0 (the full values' GPU draft pool): no flag, so the worker sizes its
    KV cache from the memory free once its model is loaded."""
    draft = env_of(pod_spec(component(full_objects, "Deployment", "draft"))["containers"][0])
    assert "OUTRIDER_MAX_CACHED_TOKENS" not in draft
    # CPU defaults: a fixed budget (the node's memory is not the pod's); the
    # gguf draft's is resident from the start, so it fits the pod's memory.
    for name, tokens in (("target", "262144"), ("draft", "16384")):
        env = env_of(pod_spec(component(default_objects, "Deployment", name))["containers"][0])
        assert env["OUTRIDER_MAX_CACHED_TOKENS"] == tokens


def test_an_eagle_pool_loads_the_targets_checkpoint_and_its_head(render):
    """A head reads the target's embeddings: its pool loads the target's model
    unless draft.model names one, and draft.head reaches the worker."""
    sets = ("draft.drafter=eagle", "target.model=/models/llama")
    draft = env_of(pod_spec(component(render(sets=sets), "Deployment", "draft"))["containers"][0])
    assert (draft["OUTRIDER_DRAFTER"], draft["OUTRIDER_MODEL"]) == ("eagle", "/models/llama")
    assert "OUTRIDER_HEAD" not in draft  # the head shipped for the target
    objects = render(sets=(*sets, "draft.model=/models/other", "draft.head=/heads/llama"))
    draft = env_of(pod_spec(component(objects, "Deployment", "draft"))["containers"][0])
    assert (draft["OUTRIDER_MODEL"], draft["OUTRIDER_HEAD"]) == ("/models/other", "/heads/llama")
