"""The Helm chart: lint, schema, strict validation of the rendered objects
against two Kubernetes versions, and what the objects must say (gRPC probes,
secure pods, minimal RBAC, headless worker Services, discovery wiring)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import kubernetes_validate
import pytest

from outrider.models import EMBEDDED_MODELS
from tests.deploy.conftest import CHART, FULL_VALUES, NAMESPACE, RELEASE, by_kind, component

KUBERNETES_VERSIONS = ["1.30.0", "1.33.0"]
CRD_KINDS = {"ServiceMonitor"}  # no schema bundled with kubernetes-validate: checked by shape below


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


# --------------------------------------------------------------------------- lint and validation


@pytest.mark.parametrize("values", [[], [FULL_VALUES]], ids=["default", "full"])
def test_helm_lint_strict_passes(helm, values):
    command = [str(helm), "lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    for path in values:
        command += ["--values", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_objects_validate_strictly(objects, version):
    validated = []
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version}: "
                f"{exc}"
            )
        validated.append(obj["kind"])
    assert {"Deployment", "Service", "PodDisruptionBudget", "Role", "RoleBinding"} <= set(validated)


def test_the_full_values_render_every_optional_object(full_objects):
    kinds = {o["kind"] for o in full_objects}
    assert kinds == {
        "Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding",
        "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor",
    }  # fmt: skip


@pytest.mark.parametrize(
    "setting, message",
    [
        ("target.dtype=fp8", "target.dtype must be one of"),
        ("coordinator.replica=3", "Additional property replica is not allowed"),
        ("draft.drafter=medusa", "draft.drafter must be one of"),
        ("target.gpu.count=-1", "target.gpu.count"),
        ("target.device=gpu", "target.device"),
        ("draft.device=cuda:x", "draft.device"),
        ("target.maxTokensPerStep=-1", "target.maxTokensPerStep"),
    ],
)
def test_the_schema_rejects_a_bad_value_with_its_name(render, setting, message):
    with pytest.raises(subprocess.CalledProcessError) as failure:
        render(sets=(setting,))
    assert message in failure.value.stderr


def test_helm_lint_refuses_a_device_outrider_does_not_know(helm):
    result = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
         "--set", "target.device=gpu:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "target.device" in result.stdout + result.stderr


def test_the_schema_allows_exactly_the_devices_and_dtypes_outrider_takes():
    """values.schema.json and outrider.device agree: every dtype, and every
    device form ("" is the chart's own: derived from gpu.count)."""
    from outrider.device import DTYPES, check_device

    schema = json.loads((CHART / "values.schema.json").read_text())
    for pool in ("target", "draft"):
        properties = schema["properties"][pool]["properties"]
        assert tuple(properties["dtype"]["enum"]) == DTYPES
        names, pattern = properties["device"]["anyOf"]
        for device in [*names["enum"], "cuda:0", "cuda:7"]:
            allowed = device in names["enum"] or re.fullmatch(
                pattern["pattern"].strip("^$"), device
            )
            assert allowed and (device == "" or check_device(device) == device), device
        for device in ("gpu", "cuda:", "cuda:x", "CUDA", "mps"):
            assert device not in names["enum"] and not re.fullmatch(
                pattern["pattern"].strip("^$"), device
            ), device


def test_a_service_monitor_without_metrics_is_refused(render):
    with pytest.raises(subprocess.CalledProcessError) as failure:
        render(sets=("metrics.serviceMonitor.enabled=true",))
    assert "needs metrics.enabled" in failure.value.stderr


def test_tls_without_its_secrets_is_refused(render):
    with pytest.raises(subprocess.CalledProcessError) as failure:
        render(sets=("tls.enabled=true",))
    assert "secretName is required when tls.enabled" in failure.value.stderr


def test_values_files_pass_yamllint(python_tool):
    config = (
        "{extends: default, rules: {line-length: {max: 120}, document-start: disable, "
        "comments: {min-spaces-from-content: 1}}}"
    )
    files = [CHART / "values.yaml", FULL_VALUES, CHART / "Chart.yaml"]
    result = subprocess.run(
        [str(python_tool("yamllint")), "--strict", "-d", config, *map(str, files)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_value_is_documented():
    """Each key of values.yaml has a comment right above it, or sits inside a
    block whose key has one (e.g. a probe's timings, a resources block)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented_indents: list[int] = []  # indents of the documented blocks we are inside
    undocumented = []
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        documented_indents = [i for i in documented_indents if i < indent]
        commented = number > 0 and lines[number - 1].strip().startswith("#")
        if commented:
            documented_indents.append(indent)
        elif not documented_indents and not line.rstrip().endswith(":"):
            undocumented.append(f"line {number + 1}: {line.strip()}")
    assert not undocumented, "values without a comment:\n" + "\n".join(undocumented)


# --------------------------------------------------------------------------- probes


def test_probes_are_native_grpc_on_the_grpc_port_with_a_startup_budget(default_objects):
    for name in ("coordinator", "target", "draft"):
        container = pod_spec(component(default_objects, "Deployment", name))["containers"][0]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {"port": port}, (name, probe)
            assert (
                "service" not in container[probe]["grpc"]
            )  # the overall status, SERVING once warmed up
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, name


def test_under_tls_probes_run_the_health_check_over_tls(full_objects):
    for name, client_cert in (("coordinator", False), ("target", True), ("draft", True)):
        container = pod_spec(component(full_objects, "Deployment", name))["containers"][0]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert "grpc" not in container[probe]
            command = container[probe]["exec"]["command"]
            assert command[:3] == ["python", "-m", "outrider.probe"]
            assert command[command.index("--port") + 1] == str(port)
            assert (
                command[command.index("--server-name") + 1]
                == f"{RELEASE}-outrider-{name}.{NAMESPACE}.svc"
            )
            assert ("--tls-cert" in command) is client_cert, (name, probe)


# --------------------------------------------------------------------------- security


def test_every_container_is_non_root_read_only_and_drops_all_capabilities(objects):
    for name, deployment in by_kind(objects, "Deployment").items():
        spec = pod_spec(deployment)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/var/cache/outrider"] == "cache" and mounts["/tmp"] == "tmp"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["cache"] and "emptyDir" in volumes["tmp"]


def test_rbac_grants_only_get_list_watch_on_endpointslices_in_the_namespace(objects):
    (role,) = by_kind(objects, "Role").values()
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    (binding,) = by_kind(objects, "RoleBinding").values()
    (account,) = by_kind(objects, "ServiceAccount").values()
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_only_the_coordinator_gets_an_api_token(objects):
    account = next(iter(by_kind(objects, "ServiceAccount").values()))
    assert account["automountServiceAccountToken"] is False
    coordinator = pod_spec(component(objects, "Deployment", "coordinator"))
    assert coordinator["serviceAccountName"] == account["metadata"]["name"]
    assert coordinator["automountServiceAccountToken"] is True
    for name in ("target", "draft"):
        worker = pod_spec(component(objects, "Deployment", name))
        assert worker["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in worker


def test_mtls_secrets_are_wired_into_every_hop(full_objects):
    coordinator = pod_spec(component(full_objects, "Deployment", "coordinator"))
    env = env_of(coordinator["containers"][0])
    assert env["OUTRIDER_TLS_CERT"] == "/etc/outrider/tls/tls.crt"
    assert (
        "OUTRIDER_TLS_CLIENT_CA" not in env
    )  # clients are not asked for certificates in the full values
    assert env["OUTRIDER_WORKER_TLS_CA"] == "/etc/outrider/worker-tls/ca.crt"
    assert env["OUTRIDER_WORKER_TLS_CERT"] == "/etc/outrider/worker-tls/tls.crt"
    assert env["OUTRIDER_AUTH_TOKENS_FILE"] == "/etc/outrider/auth/tokens"
    secrets = {
        v["name"]: v["secret"]["secretName"] for v in coordinator["volumes"] if "secret" in v
    }
    assert secrets == {
        "tls": "outrider-coordinator-tls",
        "worker-tls": "outrider-coordinator-client-tls",
        "auth": "outrider-tokens",
    }
    for name in ("target", "draft"):
        worker = pod_spec(component(full_objects, "Deployment", name))
        env = env_of(worker["containers"][0])
        assert (
            env["OUTRIDER_TLS_CLIENT_CA"] == "/etc/outrider/tls/ca.crt"
        )  # mutual TLS: only the coordinator
        assert {
            v["name"]: v["secret"]["secretName"] for v in worker["volumes"] if "secret" in v
        } == {"tls": "outrider-workers-tls"}


def test_network_policies_let_only_the_coordinator_reach_the_workers(full_objects):
    policies = by_kind(full_objects, "NetworkPolicy")
    coordinator_pods = pod_spec(component(full_objects, "Deployment", "coordinator"))
    coordinator_labels = component(full_objects, "Deployment", "coordinator")["spec"]["template"][
        "metadata"
    ]["labels"]
    assert coordinator_pods  # the coordinator exists
    for name in ("target", "draft"):
        policy = policies[f"{RELEASE}-outrider-{name}"]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        grpc_rule, metrics_rule = policy["spec"]["ingress"]
        assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
        (peer,) = grpc_rule["from"]
        assert peer["podSelector"]["matchLabels"].items() <= coordinator_labels.items()
        assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "coordinator"
        assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        assert metrics_rule["from"][0]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": "monitoring"
        }
    clients = policies[f"{RELEASE}-outrider-coordinator"]["spec"]["ingress"][0]
    assert clients["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "gateway"
    }


# --------------------------------------------------------------------------- services and discovery


def test_worker_services_are_headless_with_a_grpc_port_and_only_ready_pods(objects):
    for name in ("target", "draft"):
        service = component(objects, "Service", name)
        deployment = component(objects, "Deployment", name)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is False
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["targetPort"] == "grpc"
        assert (
            service["spec"]["selector"].items()
            <= deployment["spec"]["template"]["metadata"]["labels"].items()
        )
    coordinator = component(objects, "Service", "coordinator")
    assert "clusterIP" not in coordinator["spec"]  # the one load-balanced address clients use


def test_the_coordinator_serves_the_openai_api_on_its_http_port(
    default_objects, full_objects, render
):
    for objects, (container_port, service_port, protocol) in (
        (default_objects, (8000, 8000, "http")),
        (full_objects, (8080, 443, "https")),  # TLS on
    ):
        container = pod_spec(component(objects, "Deployment", "coordinator"))["containers"][0]
        assert env_of(container)["OUTRIDER_HTTP_PORT"] == str(container_port)
        assert {"name": "http", "containerPort": container_port, "protocol": "TCP"} in container[
            "ports"
        ]
        ports = component(objects, "Service", "coordinator")["spec"]["ports"]
        http = next(p for p in ports if p["name"] == "http")
        assert (http["port"], http["targetPort"], http["appProtocol"]) == (
            service_port,
            "http",
            protocol,
        )
    clients = by_kind(full_objects, "NetworkPolicy")[f"{RELEASE}-outrider-coordinator"]
    assert {"port": "http", "protocol": "TCP"} in clients["spec"]["ingress"][0]["ports"]

    grpc_only = render(sets=("coordinator.httpPort=null",))
    container = pod_spec(component(grpc_only, "Deployment", "coordinator"))["containers"][0]
    assert "OUTRIDER_HTTP_PORT" not in env_of(container)
    assert "http" not in {p["name"] for p in container["ports"]}
    assert "http" not in {
        p["name"] for p in component(grpc_only, "Service", "coordinator")["spec"]["ports"]
    }


def test_the_coordinator_discovers_the_worker_pools_through_their_endpointslices(objects):
    env = env_of(pod_spec(component(objects, "Deployment", "coordinator"))["containers"][0])
    assert env["OUTRIDER_TARGET"] == f"k8s://{RELEASE}-outrider-target.{NAMESPACE}:grpc"
    assert env["OUTRIDER_DRAFT"] == f"k8s://{RELEASE}-outrider-draft.{NAMESPACE}:grpc"
    assert env["OUTRIDER_HOST"] == "0.0.0.0"


def test_without_a_draft_pool_the_coordinator_decodes_with_the_target_alone(render):
    objects = render(sets=("draft.enabled=false",))
    assert {o["metadata"]["name"] for o in objects if "draft" in o["metadata"]["name"]} == set()
    env = env_of(pod_spec(component(objects, "Deployment", "coordinator"))["containers"][0])
    assert "OUTRIDER_DRAFT" not in env


def test_pod_disruption_budgets_cover_every_component(objects):
    budgets = by_kind(objects, "PodDisruptionBudget")
    for name in ("coordinator", "target", "draft"):
        budget = budgets[f"{RELEASE}-outrider-{name}"]
        labels = component(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert budget["spec"]["maxUnavailable"] == 1


def test_every_service_drains_within_its_pods_termination_grace_period(objects):
    for name in ("coordinator", "target", "draft"):
        spec = pod_spec(component(objects, "Deployment", name))
        grace = int(env_of(spec["containers"][0])["OUTRIDER_SHUTDOWN_GRACE_S"])
        assert 0 < grace < spec["terminationGracePeriodSeconds"]


def test_the_hpa_scales_the_coordinator_and_owns_its_replica_count(full_objects, default_objects):
    (hpa,) = by_kind(full_objects, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{RELEASE}-outrider-coordinator",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert "replicas" not in component(full_objects, "Deployment", "coordinator")["spec"]
    assert component(default_objects, "Deployment", "coordinator")["spec"]["replicas"] == 2
    assert not by_kind(default_objects, "HorizontalPodAutoscaler")


def test_the_service_monitor_scrapes_the_metrics_port_of_every_component(full_objects):
    (monitor,) = by_kind(full_objects, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [
        {
            "port": "metrics",
            "path": "/metrics",
            "scheme": "http",
            "interval": "15s",
            "scrapeTimeout": "10s",
        }
    ]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for name in ("coordinator", "target", "draft"):
        service = component(full_objects, "Service", name)
        assert selector.items() <= service["metadata"]["labels"].items()
        assert {
            "name": "metrics",
            "port": 9090,
            "targetPort": "metrics",
            "protocol": "TCP",
            "appProtocol": "http",
        } in service["spec"]["ports"]
        container = pod_spec(component(full_objects, "Deployment", name))["containers"][0]
        assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
        assert env_of(container)["OUTRIDER_METRICS_PORT"] == "9090"


# --------------------------------------------------------------------------- pools and models


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
    objects = render(sets=(f"{name}.gpu.count=1",))
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
    default_objects, full_objects
):
    # Defaults: the target and the coordinator's tokenizer are the embedded
    # model; prompt lookup needs none.
    for name in ("coordinator", "target"):
        (init,) = pod_spec(component(default_objects, "Deployment", name))["initContainers"]
        assert init["args"] == ["models", "fetch", "smollm2-135m-instruct"]
        assert {"name": "cache", "mountPath": "/var/cache/outrider"} in init["volumeMounts"]
    assert "initContainers" not in pod_spec(component(default_objects, "Deployment", "draft"))
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
    for name in ("coordinator", "target", "draft"):
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


@pytest.mark.parametrize("name", ["coordinator", "target", "draft"])
def test_every_service_parses_the_values_the_chart_gives_it(objects, monkeypatch, name):
    """The values, not only the names: Helm reads numbers in values files as
    floats, and a quoted 1048576 renders as 1.048576e+06, which no int flag takes."""
    container = pod_spec(component(objects, "Deployment", name))["containers"][0]
    args = parse_serve_args(monkeypatch, container, name)  # raises on a value a flag cannot take
    if name != "coordinator":
        cached = env_of(container).get("OUTRIDER_MAX_CACHED_TOKENS")
        assert args.max_cached_tokens == (int(cached) if cached else None)


@pytest.mark.parametrize("name", ["target", "draft"])
def test_each_worker_parses_the_device_settings_the_chart_gives_it(render, monkeypatch, name):
    objects = render(
        FULL_VALUES,
        sets=(
            f"{name}.maxTokensPerStep=1024",
            f"{name}.enforceEager=true",
            f"{name}.dtype=float16",
        ),
    )
    args = parse_serve_args(
        monkeypatch, pod_spec(component(objects, "Deployment", name))["containers"][0], name
    )
    device = "cuda" if name == "target" else "cuda:0"
    assert (args.device, args.dtype, args.max_tokens_per_step, args.enforce_eager) == (
        device,
        "float16",
        1024,
        True,
    )


def test_large_integers_from_a_values_file_render_as_integers(full_objects):
    env = env_of(pod_spec(component(full_objects, "Deployment", "target"))["containers"][0])
    assert env["OUTRIDER_MAX_CACHED_TOKENS"] == "1048576"  # ci/full-values.yaml


def test_max_cached_tokens_0_leaves_the_kv_budget_to_the_worker(full_objects, default_objects):
    """0 (the full values' GPU draft pool): no flag, so the worker sizes its
    KV cache from the memory free once its model is loaded."""
    draft = env_of(pod_spec(component(full_objects, "Deployment", "draft"))["containers"][0])
    assert "OUTRIDER_MAX_CACHED_TOKENS" not in draft
    for name in (
        "target",
        "draft",
    ):  # CPU defaults: a fixed budget (the node's memory is not the pod's)
        env = env_of(pod_spec(component(default_objects, "Deployment", name))["containers"][0])
        assert env["OUTRIDER_MAX_CACHED_TOKENS"] == "262144"
