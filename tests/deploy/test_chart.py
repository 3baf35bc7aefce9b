"""The Helm chart: lint, schema and values, strict validation of the
rendered objects against two Kubernetes versions, and gRPC health probes."""

from __future__ import annotations

import json
import re
import subprocess

import kubernetes_validate
import pytest

from tests.deploy.conftest import (
    CHART,
    FULL_VALUES,
    NAMESPACE,
    RELEASE,
    component,
    components,
    pod_spec,
)

KUBERNETES_VERSIONS = ["1.30.0", "1.33.0"]
CRD_KINDS = {"ServiceMonitor"}  # no schema bundled with kubernetes-validate: checked by shape below


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
    for name in components(default_objects):
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
