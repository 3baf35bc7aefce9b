"""What `pip install outrider` puts into site-packages: one import name,
``outrider``, with the services under it."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (
    "pyproject.toml",
    "README.md",
    "outrider",
    "coordinator",
    "draft_worker",
    "target_worker",
)


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the checkout (links kept as links, as git keeps them)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy(ROOT / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
    command += ["--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(source)]
    subprocess.run(command, check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("outrider-*.whl")
    return wheel


def test_the_wheel_installs_one_import_name_with_the_services_under_it(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"outrider", "outrider-0.1.0.dist-info"}
    for service in ("coordinator", "draft_worker", "target_worker"):
        assert f"outrider/{service}/main.py" in names
    assert "outrider/coordinator/openai/app.py" in names

    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    code = "import outrider.coordinator.main as m; print(m.__file__)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(installed)
