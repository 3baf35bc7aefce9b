"""Builds the container image, localhost/outrider:VERSION, from deploy/docker/Dockerfile.

    python scripts/build_image.py [--tag TAG] [--fetch-models NAMES] [--dry-run]

With podman, or with docker where podman is missing and docker's daemon
answers. Where the Dockerfile's base image (PYTHON_IMAGE) cannot be pulled,
the build runs on a Python base built from Debian packages with debootstrap
(localhost/outrider-python:bookworm; built once, then taken from the image
store). Where PyTorch's CPU index cannot be reached, pip in the build uses
this machine's pip settings instead (index, extra indexes, find-links, CA
bundle: `pip config list`), passed as pip's own PIP_* variables, with their
local files mounted read-only while the build runs (podman only: they are
not part of the image).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DEBIAN_BASE = "localhost/outrider-python:bookworm"
DEBIAN_PACKAGES = "python3,python3-venv,ca-certificates"
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
BASE_JUNK = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man")
"""What the base image leaves out of debootstrap's tree: downloaded packages, lists, docs."""
PIP_SETTINGS = ("index-url", "extra-index-url", "find-links", "cert")
"""The pip settings a build needs to find packages where this machine finds them."""


class BuildError(RuntimeError):
    """A reason the image cannot be built, in one line."""


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def dockerfile_arg(name: str) -> str:
    """The default of the Dockerfile's ``ARG name=DEFAULT``."""
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    if match is None:
        raise BuildError(f"{DOCKERFILE}: no ARG {name}=DEFAULT")
    return match.group(1)


def qualified(image: str) -> str:
    """``image`` with its registry: podman resolves no short names unless configured to."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if rest else f"docker.io/library/{image}"


def run(command: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), check=False, **kwargs)


def answers(command: Sequence[str]) -> bool:
    try:
        return run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_engine(requested: str | None) -> str:
    """podman, else docker when its daemon answers."""
    if requested:
        if shutil.which(requested) is None:
            raise BuildError(f"--engine {requested}: not found on PATH")
        return requested
    if shutil.which("podman"):
        return "podman"
    if shutil.which("docker") and answers(["docker", "info"]):
        return "docker"
    if shutil.which("docker"):
        raise BuildError(
            "docker's daemon does not answer: start it, or install podman "
            "(Debian: apt-get install podman runc)"
        )
    raise BuildError("no container engine: install podman (Debian: apt-get install podman runc)")


def has_image(engine: str, image: str) -> bool:
    return answers([engine, "image", "inspect", image])


def pullable(engine: str, image: str) -> bool:
    """``image`` is in the store, or pulls."""
    if has_image(engine, image):
        return True
    print(f"$ {engine} pull {image}", flush=True)
    return answers([engine, "pull", "--quiet", image])


def build_debian_base(engine: str) -> None:
    """Builds DEBIAN_BASE from Debian's packages (debootstrap, run as root)."""
    if shutil.which("debootstrap") is None:
        raise BuildError(
            "the Python base image cannot be pulled and debootstrap is missing: "
            "apt-get install debootstrap (or make the base pullable)"
        )
    if os.geteuid() != 0:
        raise BuildError("the Python base image cannot be pulled; debootstrap needs root")
    with tempfile.TemporaryDirectory(prefix="outrider-base-") as tmp:
        root = Path(tmp) / "rootfs"
        command = ["debootstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}"]
        print(f"$ {shlex.join([*command, 'bookworm', str(root)])}", flush=True)
        if run([*command, "bookworm", str(root)], stdout=subprocess.DEVNULL).returncode:
            raise BuildError("debootstrap failed (see its output above)")
        for junk in BASE_JUNK:
            shutil.rmtree(root / junk, ignore_errors=True)
        changes = [f"--change=ENV {env}" for env in BASE_ENV] + ['--change=CMD ["python3"]']
        print(f"$ tar -C {root} -c . | {engine} import ... - {DEBIAN_BASE}", flush=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = run([engine, "import", *changes, "-", DEBIAN_BASE], stdin=tar.stdout)
        if tar.wait() or imported.returncode:
            raise BuildError(f"importing {root} as {DEBIAN_BASE} failed")


def python_image(engine: str) -> str:
    """The Dockerfile's base where it pulls, else the Debian base (built once)."""
    default = qualified(dockerfile_arg("PYTHON_IMAGE"))
    if pullable(engine, default):
        return default
    print(f"{default} cannot be pulled: building on {DEBIAN_BASE}", flush=True)
    if not has_image(engine, DEBIAN_BASE):
        build_debian_base(engine)
    return DEBIAN_BASE


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=15):
            return True
    except (OSError, urllib.error.URLError):
        return False


def pip_config() -> dict[str, str]:
    """This machine's pip settings of PIP_SETTINGS (``pip config list``:
    its environment over its files)."""
    if importlib.util.find_spec("pip") is not None:
        pip = [sys.executable, "-m", "pip"]
    elif found := shutil.which("pip3") or shutil.which("pip"):
        pip = [found]
    else:
        return {}
    listed = run([*pip, "config", "list"], capture_output=True, text=True).stdout.splitlines()
    settings: dict[str, str] = {}
    for line in sorted(listed, key=lambda line: line.startswith(":env:")):  # env last: it wins
        scope_key, _, value = line.partition("=")
        key = scope_key.rpartition(".")[2]
        if key in PIP_SETTINGS:
            settings[key] = value.strip("'\"")
    return settings


def local_mounts(settings: dict[str, str]) -> list[str]:
    """Read-only mounts for the local paths among pip's settings. A local
    index is mounted from above its simple/ directory: its files lie beside it."""
    mounts = []
    for value in settings.values():
        for item in value.split():
            path = Path(item.removeprefix("file://"))
            if not path.is_absolute() or not path.exists():
                continue
            path = path.parent if path.name == "simple" else path
            mounts.append(f"--volume={path}:{path}:ro")
    return sorted(set(mounts))


def pip_build_args(engine: str, torch_index: str) -> tuple[list[str], list[str]]:
    """Build arguments (and podman's mounts) that make pip in the build find
    torch and the dependencies: none where ``torch_index`` answers, else
    this machine's pip settings."""
    if reachable(torch_index):
        return [], []
    settings = pip_config()
    settings.setdefault("index-url", "https://pypi.org/simple")
    print(f"{torch_index} does not answer: pip in the build uses this machine's {settings}")
    args = [f"--build-arg=TORCH_INDEX_URL={settings['index-url']}"]
    args += [f"--build-arg=PIP_{key.upper().replace('-', '_')}={v}" for key, v in settings.items()]
    mounts = local_mounts(settings)
    if mounts and engine != "podman":
        print(f"{engine} build mounts no volumes: left out {mounts}", flush=True)
        mounts = []
    return args, mounts


def build_command(engine: str, tag: str, fetch_models: str) -> list[str]:
    base = python_image(engine)
    pip_args, mounts = pip_build_args(engine, dockerfile_arg("TORCH_INDEX_URL"))
    command = [engine, "build", "--file", str(DOCKERFILE), "--tag", tag]
    if engine == "podman":
        # chroot isolation builds where the machine is itself a container or VM
        # that refuses nested namespaces and cgroups, as CI machines often do.
        command.append("--isolation=chroot")
    command += [f"--build-arg=PYTHON_IMAGE={base}", *pip_args, *mounts]
    if fetch_models:
        command.append(f"--build-arg=FETCH_MODELS={fetch_models}")
    return [*command, str(ROOT)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/build_image.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tag", default=f"localhost/outrider:{version()}", help="%(default)s")
    parser.add_argument(
        "--fetch-models",
        default="",
        metavar="NAMES",
        help="embedded models to bake in (the Dockerfile's FETCH_MODELS), e.g. "
        "smollm2-135m-instruct; default: none",
    )
    parser.add_argument(
        "--engine", choices=("podman", "docker"), help="default: podman, else docker"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        engine = find_engine(args.engine)
        command = build_command(engine, args.tag, args.fetch_models)
    except BuildError as exc:
        print(f"build_image: {exc}", file=sys.stderr)
        return 2
    print(f"$ {shlex.join(command)}", flush=True)
    started = time.monotonic()
    if run(command).returncode:
        print(f"build_image: {engine} build failed (see its output above)", file=sys.stderr)
        return 1
    print(f"built {args.tag} in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
