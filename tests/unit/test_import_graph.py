"""The product's imports: one top-level name, no circle — counting the
imports inside functions and under TYPE_CHECKING, which hide a circle rather
than remove it — and none running back up the layers."""

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("coordinator", "draft_worker", "target_worker")


def module_files(root: Path = ROOT, package: str = "outrider") -> dict[str, Path]:
    """Module name → file, through the links by which the services' folders
    at the root are the package's subpackages."""
    files = {}
    for folder, _, names in os.walk(root / package, followlinks=True):
        for file in names:
            if not file.endswith(".py"):
                continue
            parts = Path(folder, file).relative_to(root).with_suffix("").parts
            if "v1" in parts:  # generated
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = Path(folder, file)
    return files


def test_the_services_are_subpackages_of_outrider():
    files = module_files()
    for service in SERVICES:
        assert (ROOT / "outrider" / service).resolve() == ROOT / service
        assert f"outrider.{service}.main" in files


def test_every_import_of_the_product_goes_through_outrider():
    """A bare ``coordinator`` import would load a second copy of the module
    from a checkout and fail where the package is installed."""
    sources = [*module_files().values(), *ROOT.glob("tests/**/*.py"), *ROOT.glob("scripts/*.py")]
    bare = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            bare += [(str(path), n) for n in names if n.split(".")[0] in SERVICES]
    assert bare == []


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the product's modules it imports anywhere in its source (a
    module's own packages, which Python imports first anyway, left out)."""

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        imported: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.update(resolve(f"{node.module}.{alias.name}") for alias in node.names)
        graph[module] = {
            m for m in imported if m and m != module and not module.startswith(m + ".")
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                found.append(sorted([module, *component]))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_in_a_circle():
    assert cycles(import_graph(module_files())) == []


def test_a_circle_hidden_in_a_function_or_under_type_checking_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
    )
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg.a import f\n")
    graph = import_graph(module_files(tmp_path, "pkg"))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


TOP = {
    "outrider.__main__": (),
    "outrider.cli": ("outrider.__main__",),
    "outrider.bench": ("outrider.cli",),
    **{f"outrider.{service}": ("outrider.cli",) for service in SERVICES},
}
"""The layers on top, and who may import each (besides its own modules):
the command line is the entry point's; the benchmark and each service the
command line's — so no service imports another's code, and the shared
layer below imports none."""


def back_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports that run back up the layers: a module below importing one of :data:`TOP`."""

    def layer(module: str) -> str | None:
        return next((top for top in TOP if module == top or module.startswith(top + ".")), None)

    found = []
    for module, imported in graph.items():
        for other in imported:
            top = layer(other)
            if top is None or layer(module) == top:
                continue
            if module not in TOP[top]:
                found.append((module, other))
    return sorted(found)


def test_no_import_runs_back_up_the_layers():
    assert back_edges(import_graph(module_files())) == []


def test_a_back_edge_is_found():
    graph = {
        "outrider.eagle.train": {"outrider.bench.plot"},
        "outrider.cli": {"outrider.bench", "outrider.coordinator.main"},
        "outrider.drafters.lookup": {"outrider.coordinator.workers.protocol"},
        "outrider.target_worker.sessions": {"outrider.draft_worker.sessions"},
    }
    assert back_edges(graph) == [
        ("outrider.drafters.lookup", "outrider.coordinator.workers.protocol"),
        ("outrider.eagle.train", "outrider.bench.plot"),
        ("outrider.target_worker.sessions", "outrider.draft_worker.sessions"),
    ]
