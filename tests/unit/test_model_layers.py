"""The model code's two layers: ``outrider.model_specs`` says what a model spec
names and where its files are, and imports no torch; ``outrider.engine``
loads the weights and may import ``outrider.model_specs``, never the reverse."""

import ast
import subprocess
import sys
from pathlib import Path

import outrider.model_specs

ENGINE = "outrider.engine"


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names, at any depth:
    function-local imports and ``TYPE_CHECKING`` blocks included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: a relative import; name the module whole")
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_models_layer_names_no_engine_module_in_any_import():
    path = Path(outrider.model_specs.__file__)
    reaching_up = sorted(
        name for name in imported_modules(path) if name == ENGINE or name.startswith(f"{ENGINE}.")
    )
    assert reaching_up == [], f"{path.name} imports the engine: {reaching_up}"


def test_importing_the_models_layer_loads_neither_the_engine_nor_torch():
    code = """
import sys
import outrider.model_specs
loaded = [m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("outrider.engine")]
assert not loaded, loaded
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
