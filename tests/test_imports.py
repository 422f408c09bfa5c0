"""Imports: each entry module loads only its own framework (a PyTorch user does not pay for
TensorFlow), and the package's import graph, read from its source, has no circle and goes down the
layers only (README, "Layout")."""
import ast
import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

import pytest

PROBE = ("import json, sys; import {module}; "
         "print(json.dumps({{'torch': 'torch' in sys.modules, 'tensorflow': 'tensorflow' in sys.modules}}))")


def measure(module: str) -> Dict[str, bool]:
    """The frameworks a fresh interpreter has loaded after importing ``module``."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                         check=True, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module,loads,not_loaded", [
    ("pipesgd_hvd.torch", "torch", "tensorflow"),
    ("pipesgd_hvd.keras", "tensorflow", "torch"),
    ("pipesgd_hvd.tensorflow", "tensorflow", "torch"),
])
def test_entry_module_loads_only_its_framework(module, loads, not_loaded):
    result = measure(module)
    assert result[loads] is True
    assert result[not_loaded] is False, f"import {module} loaded {not_loaded}"


@pytest.mark.parametrize("module", ["pipesgd_hvd.optimizer.core", "pipesgd_hvd.optimizer.lifecycle", "pipesgd_hvd.pipeline.engine",
                                    "pipesgd_hvd.pipeline.schedule", "pipesgd_hvd.ops.numpy"])
def test_framework_free_layers_load_no_framework(module):
    result = measure(module)
    assert result["torch"] is False and result["tensorflow"] is False, f"import {module} loaded a framework"


# ---------------------------------------------------------------------------------------------
# The import graph, read from the source: every import statement of every module of the package,
# those inside functions included (lazy imports), and importlib.import_module / __import__ calls.

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "pipesgd_hvd"

# Top to bottom; a module imports its own package and the layers below it only.
LAYERS = {"torch": 6, "keras": 6, "tensorflow": 6, "optimizer": 5, "staleness": 4, "auto": 4, "pipeline": 3,
          "compression": 2, "comm": 1, "ops": 0}
# Imports between the framework packages (one layer), each with why it is translation.
FRAMEWORK_IMPORTS = {
    ("tensorflow", "keras"): "pipesgd_hvd.tensorflow offers custom tf.GradientTape loops the Keras optimizer that "
                             "pipesgd_hvd.keras builds (DistributedOptimizer): a re-export, nothing of its own",
}
TESTING = "testing"  # may import any layer; no layer may import it


@dataclass(frozen=True)
class Import:
    importer: str  # module names, dotted
    imported: str
    path: str  # the importer's file, from the repository's root
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.imported}"


def package_modules(package_dir: Path) -> Dict[str, Tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` for every .py file under ``package_dir``."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _is_extension(package_dir: Path, package: str, name: str) -> bool:
    """Whether ``package.name`` is a compiled module (its C source or a built file is there)."""
    folder = package_dir.parent.joinpath(*package.split("."))
    return any(p.name.startswith(name + ".") and p.suffix != ".py" for p in folder.glob(name + ".*"))


def _absolute(importer: str, is_package: bool, level: int, module: Optional[str]) -> str:
    """The absolute name a ``from <level dots><module> import ...`` of ``importer`` reads."""
    if not level:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def read_imports(package_dir: Path) -> Tuple[List[Import], List[str]]:
    """Every import of a module of the package by a module of the package, and the dynamic imports
    whose target cannot be read from the source (each one a problem: it could hide a circle)."""
    root = package_dir.name
    modules = package_modules(package_dir)
    found: List[Import] = []
    unreadable: List[str] = []

    def target(name: str, base: str) -> str:
        """``base.name`` when it is a module (or a compiled one), else ``base`` (a name it defines)."""
        full = f"{base}.{name}"
        return full if full in modules or _is_extension(package_dir, base, name) else base

    for importer, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: List[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(importer, is_package, node.level, node.module)
                names = [target(alias.name, base) for alias in node.names]
            elif isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                    or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names = [arg.value]
                    if arg.value.startswith("."):
                        package = node.args[1] if len(node.args) > 1 else None
                        if not (isinstance(package, ast.Constant) and isinstance(package.value, str)):
                            unreadable.append(f"{path}:{node.lineno}: a relative import_module without a "
                                              "literal package")
                            continue
                        level = len(arg.value) - len(arg.value.lstrip("."))
                        names = [_absolute(package.value, True, level, arg.value.lstrip(".") or None)]
                else:
                    unreadable.append(f"{path}:{node.lineno}: import_module of a name computed at run time")
            for name in names:
                if name == root or name.startswith(root + "."):
                    found.append(Import(importer, name, str(path.relative_to(package_dir.parent)), node.lineno))
    return found, unreadable


def _package_of(module: str) -> Optional[str]:
    """The top-level package (``comm``, ``torch``, ...) a module belongs to; None for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_violations(imports: Sequence[Import]) -> List[str]:
    """Every import up a layer, across one layer (outside FRAMEWORK_IMPORTS), or of the testing
    package by a production module."""
    out = []
    for imp in imports:
        src, dst = _package_of(imp.importer), _package_of(imp.imported)
        if src is None or dst is None or src == dst or src == TESTING:
            continue  # the root package imports nothing; a package imports itself freely
        if dst == TESTING:
            out.append(f"{imp}: production code imports the testing package")
            continue
        for package in (src, dst):
            if package not in LAYERS:
                out.append(f"{imp}: package {package!r} has no layer: add it to LAYERS in tests/test_imports.py")
        if src in LAYERS and dst in LAYERS and LAYERS[src] <= LAYERS[dst] and (src, dst) not in FRAMEWORK_IMPORTS:
            way = "up" if LAYERS[src] < LAYERS[dst] else "across"
            out.append(f"{imp}: {way} a layer ({src} -> {dst})")
    return out


def import_circles(imports: Sequence[Import]) -> List[List[str]]:
    """The circles of the module graph: its strongly connected components of more than one module,
    and modules that import themselves (Tarjan's algorithm, iterative). A module's import of its
    parent package while that package imports it is not an edge here (Python loads parents first
    in any case); an explicit import of a package's ``__init__`` is."""
    graph: Dict[str, Set[str]] = defaultdict(set)
    for imp in imports:
        graph[imp.importer].add(imp.imported)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        circles.append(sorted(component))
    return circles


def _describe(circle: List[str], imports: Sequence[Import]) -> str:
    members = set(circle)
    edges = sorted({str(imp) for imp in imports if imp.importer in members and imp.imported in members})
    return " / ".join(circle) + ": " + "; ".join(edges)


def test_no_import_circle_lazy_imports_included():
    imports, unreadable = read_imports(PACKAGE_DIR)
    assert not unreadable, unreadable
    circles = import_circles(imports)
    assert not circles, "import circles:\n" + "\n".join(_describe(c, imports) for c in circles)


def test_imports_go_down_the_layers_only():
    imports, _ = read_imports(PACKAGE_DIR)
    assert imports, "read no import at all"
    violations = layer_violations(imports)
    assert not violations, "\n".join(violations)


def test_the_framework_imports_across_one_layer_are_those_listed():
    # FRAMEWORK_IMPORTS allows an edge; one that no module uses any more is removed from the list.
    imports, _ = read_imports(PACKAGE_DIR)
    used = {(_package_of(i.importer), _package_of(i.imported)) for i in imports}
    assert set(FRAMEWORK_IMPORTS) <= used, set(FRAMEWORK_IMPORTS) - used


def _write(root: Path, files: Dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pipesgd_hvd"


def test_the_checks_find_lazy_dynamic_and_testing_imports(tmp_path):
    # A tree with one of each problem, where the import statements alone show none at module level.
    package = _write(tmp_path, {
        "pipesgd_hvd/__init__.py": "",
        "pipesgd_hvd/ops/__init__.py": "",
        "pipesgd_hvd/ops/fine.py": "from ..ops import fine2\n",
        "pipesgd_hvd/ops/fine2.py": "import numpy\n",
        "pipesgd_hvd/ops/up.py": "def f():\n    from ..comm import kernels\n    return kernels\n",
        "pipesgd_hvd/comm/__init__.py": "",
        "pipesgd_hvd/comm/kernels.py": "from . import _native\nimport importlib\n"
                                       "def load():\n    return importlib.import_module('pipesgd_hvd.comm.device')\n",
        "pipesgd_hvd/comm/_native.c": "",
        "pipesgd_hvd/comm/device.py": "from .kernels import load\n",
        "pipesgd_hvd/comm/scaffold.py": "import pipesgd_hvd.testing.local\n",
        "pipesgd_hvd/comm/dynamic.py": "import importlib\nname = 'x'\nimportlib.import_module(name)\n",
        "pipesgd_hvd/testing/__init__.py": "from ..torch import anything\n",
        "pipesgd_hvd/testing/local.py": "from ..comm import kernels\n",
    })
    imports, unreadable = read_imports(package)
    assert [u.split(": ", 1)[1] for u in unreadable] == ["import_module of a name computed at run time"]
    assert import_circles(imports) == [["pipesgd_hvd.comm.device", "pipesgd_hvd.comm.kernels"]]
    assert sorted(layer_violations(imports)) == [
        "pipesgd_hvd/comm/scaffold.py:1 imports pipesgd_hvd.testing.local: production code imports the testing package",
        "pipesgd_hvd/ops/up.py:2 imports pipesgd_hvd.comm.kernels: up a layer (ops -> comm)",
    ]
