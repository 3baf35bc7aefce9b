"""scripts/build_image.py's choices, without building: the engine, the
base's full name, and what of this machine's pip settings a build gets."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from tests.deploy.conftest import ROOT


def _load_build_image():
    spec = importlib.util.spec_from_file_location(
        "build_image", ROOT / "scripts" / "build_image.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_image = _load_build_image()


def test_the_dockerfile_base_gets_the_full_name_podman_pulls():
    assert build_image.dockerfile_arg("PYTHON_IMAGE") == "python:3.11-slim-bookworm"
    assert build_image.qualified("python:3.11-slim-bookworm") == (
        "docker.io/library/python:3.11-slim-bookworm"
    )
    assert build_image.qualified("org/python:3") == "docker.io/org/python:3"
    for name in ("localhost/outrider-python:bookworm", "ghcr.io/org/python:3", "reg:5000/p"):
        assert build_image.qualified(name) == name


def test_without_podman_or_a_docker_daemon_it_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(build_image.shutil, "which", lambda name: None)
    assert build_image.main([]) == 2
    error = capsys.readouterr().err
    assert error.startswith("build_image: no container engine: install podman")
    assert error.count("\n") == 1


def test_a_docker_without_its_daemon_is_passed_over(monkeypatch):
    monkeypatch.setattr(build_image.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert build_image.find_engine(None) == "podman"
    monkeypatch.setattr(
        build_image.shutil, "which", lambda name: "/usr/bin/docker" if name == "docker" else None
    )
    monkeypatch.setattr(build_image, "answers", lambda command: False)
    with pytest.raises(build_image.BuildError, match="daemon does not answer"):
        build_image.find_engine(None)


def test_pip_settings_come_from_pip_config_list_its_environment_first(monkeypatch):
    listed = "\n".join(
        [
            ":env:.find-links='/opt/wheels'",
            "global.find-links='/elsewhere'",
            "global.extra-index-url='file:///opt/pypi/simple https://mirror.example/simple'",
            "global.constraint='/etc/pip/constraints.txt'",
        ]
    )
    monkeypatch.setattr(
        build_image, "run", lambda command, **kw: subprocess.CompletedProcess(command, 0, listed)
    )
    assert build_image.pip_config() == {
        "find-links": "/opt/wheels",
        "extra-index-url": "file:///opt/pypi/simple https://mirror.example/simple",
    }


def test_local_pip_paths_are_mounted_read_only_an_index_from_above_its_simple(tmp_path):
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    settings = {
        "extra-index-url": f"file://{tmp_path}/pypi/simple https://mirror.example/simple",
        "find-links": f"{tmp_path}/wheels",
        "cert": f"{tmp_path}/missing.crt",
    }
    assert build_image.local_mounts(settings) == [
        f"--volume={tmp_path}/pypi:{tmp_path}/pypi:ro",
        f"--volume={tmp_path}/wheels:{tmp_path}/wheels:ro",
    ]


def test_a_reachable_torch_index_leaves_pip_as_the_dockerfile_has_it(monkeypatch):
    monkeypatch.setattr(build_image, "reachable", lambda url: True)
    assert build_image.pip_build_args("podman", "https://download.pytorch.org/whl/cpu") == ([], [])
