"""Regenerates the protobuf and gRPC stubs in ``outrider/v1`` from ``protos/``.

The generated modules are committed and never edited by hand; run
``make proto`` (``python -m outrider._protogen``) after changing a ``.proto``.
A test regenerates them into a temporary directory and fails when the
committed copies are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "outrider" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes ``outrider/v1/*_pb2*.py`` (and ``.pyi``) under ``out_dir``."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


if __name__ == "__main__":
    generate(REPO_ROOT)
    sys.exit(0)
