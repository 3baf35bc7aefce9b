"""Fixtures of the deployment tests: helm (installed on first use by
scripts/install_tools.py, the same code `make tools` runs) and the chart
rendered with the default values (a CPU draft pool of the gguf drafter), the
default values with prompt lookup in the coordinator (no draft pool), and the
full-featured values."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "outrider"
FULL_VALUES = CHART / "ci" / "full-values.yaml"
RELEASE, NAMESPACE = "demo", "inference"
# The CPU defaults without a draft-worker pool: prompt lookup, in the coordinator.
LOOKUP = ("draft.drafter=prompt-lookup",)


def _load_install_tools():
    spec = importlib.util.spec_from_file_location(
        "install_tools", ROOT / "scripts" / "install_tools.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


install_tools = _load_install_tools()


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return install_tools.ensure_helm()
    except (install_tools.ToolError, OSError, subprocess.SubprocessError) as exc:
        pytest.fail(
            f"helm is needed by the chart tests and could not be installed: {exc}", pytrace=False
        )


@pytest.fixture(scope="session")
def python_tool() -> Callable[[str], Path]:
    def find(name: str) -> Path:
        try:
            return install_tools.python_tool(name)
        except install_tools.ToolError as exc:
            pytest.fail(str(exc), pytrace=False)

    return find


Render = Callable[..., list[dict]]


@pytest.fixture(scope="session")
def render(helm) -> Render:
    """``render(*values_files, set=[...])`` -> the rendered objects; raises
    CalledProcessError (with helm's stderr) when rendering fails."""

    def run(*values: Path, sets: tuple[str, ...] = ()) -> list[dict]:
        command = [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        for path in values:
            command += ["--values", str(path)]
        for item in sets:
            command += ["--set", item]
        result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return run


@pytest.fixture(scope="session")
def default_objects(render) -> list[dict]:
    return render()


@pytest.fixture(scope="session")
def lookup_objects(render) -> list[dict]:
    return render(sets=LOOKUP)


@pytest.fixture(scope="session")
def full_objects(render) -> list[dict]:
    return render(FULL_VALUES)


@pytest.fixture(params=["default", "lookup", "full"])
def objects(request, default_objects, lookup_objects, full_objects) -> list[dict]:
    return {"default": default_objects, "lookup": lookup_objects, "full": full_objects}[
        request.param
    ]


@pytest.fixture(params=["default", "full"])
def drafting_objects(request, default_objects, full_objects) -> list[dict]:
    """The renderings with a draft-worker pool."""
    return default_objects if request.param == "default" else full_objects


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def component(objects: list[dict], kind: str, name: str) -> dict:
    return by_kind(objects, kind)[f"{RELEASE}-outrider-{name}"]


def components(objects: list[dict]) -> list[str]:
    """The components deployed: coordinator, target, and draft when there is
    a draft-worker pool (not with prompt lookup, which runs in the coordinator)."""
    prefix = f"{RELEASE}-outrider-"
    names = [name.removeprefix(prefix) for name in by_kind(objects, "Deployment")]
    assert {"coordinator", "target"} <= set(names) <= {"coordinator", "target", "draft"}
    return names


def workers(objects: list[dict]) -> list[str]:
    """The worker pools deployed: target, and draft when there is a draft pool."""
    return [name for name in components(objects) if name != "coordinator"]


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}
