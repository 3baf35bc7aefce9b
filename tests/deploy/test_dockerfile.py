"""The Dockerfile: hadolint-clean, non-root, no build tools in the final
stage, one entrypoint for the three services. (tests/e2e/test_image.py builds
the image and runs it.)"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.deploy.conftest import ROOT

DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), one list per stage."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    result: list[list[str]] = []
    for instruction in instructions:
        if instruction.startswith("FROM "):
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def test_hadolint_passes(python_tool):
    result = subprocess.run(
        [str(python_tool("hadolint")), "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_final_stage_runs_outrider_as_a_numeric_non_root_user():
    final = stages()[-1]
    (user,) = [i for i in final if i.startswith("USER ")]
    uid, _, gid = user.split()[1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    assert 'ENTRYPOINT ["outrider"]' in final
    assert 'CMD ["serve", "coordinator"]' in final
    assert not any(i.startswith("HEALTHCHECK") for i in final)  # Kubernetes probes instead


def test_the_final_stage_installs_nothing_and_copies_only_the_venv():
    _, builder, final = stages()
    assert not any(
        re.search(r"\b(apt-get|pip|gcc|make)\b", i) for i in final if i.startswith("RUN ")
    )
    copies = [i for i in final if i.startswith("COPY ")]
    assert copies == ["COPY --from=builder /opt/outrider /opt/outrider"]
    # torch is pinned and comes from the CPU index unless a build argument says otherwise
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in builder
    assert any('"torch==${TORCH_VERSION}"' in i for i in builder)


def test_the_image_holds_every_python_package_of_the_project():
    """The builder copies the package pyproject.toml installs and each folder
    its links lead to (the services'), and .dockerignore lets each through."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (package,) = (
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    )
    links = [path for path in (ROOT / package).iterdir() if path.is_symlink()]
    packages = {package, *(link.resolve().relative_to(ROOT).as_posix() for link in links)}
    assert packages == {"outrider", "coordinator", "draft_worker", "target_worker"}
    copied = {m.group(1) for i in stages()[1] if (m := re.match(r"COPY (\w+) \./\1$", i))}
    assert copied == packages
    allowed = set((ROOT / ".dockerignore").read_text().split())
    assert {f"!{p}/" for p in packages} | {"!pyproject.toml", "!README.md"} <= allowed


def test_the_image_hides_no_gpu_and_asks_the_nvidia_runtime_for_cuda():
    """A CUDA build (TORCH_INDEX_URL) runs workers with --device cuda: no stage
    may pin which GPUs are visible, and the final stage asks the NVIDIA runtime
    for the driver's compute libraries. Which GPUs a container gets stays the
    runtime's choice (--gpus, the device plugin)."""
    for stage in stages():
        for instruction in stage:
            if instruction.startswith(("ENV ", "ARG ")):
                assert "CUDA_VISIBLE_DEVICES" not in instruction, instruction
                assert "NVIDIA_VISIBLE_DEVICES" not in instruction, instruction
    env = " ".join(i for i in stages()[-1] if i.startswith("ENV "))
    capabilities = re.search(r"NVIDIA_DRIVER_CAPABILITIES=(\S+)", env)
    assert capabilities and {"compute", "utility"} <= set(capabilities.group(1).split(","))


def test_the_dependency_layer_depends_on_the_dependencies_alone():
    """The builder installs what a stage of its own read from
    pyproject.toml: an edit elsewhere in that file keeps the layer (and its
    llama.cpp compile) cached."""
    requirements, builder, _ = stages()
    assert requirements[0].endswith(" AS requirements")
    assert "COPY pyproject.toml /src/" in requirements
    assert "COPY --from=requirements /requirements.txt /tmp/requirements.txt" in builder
    install = builder.index("COPY --from=requirements /requirements.txt /tmp/requirements.txt")
    assert not any("pyproject.toml" in i for i in builder[:install])
