"""The layers of the code: no import cycles, and each package imports only what is below it.

    privacy  <-  tasks  <-  strategies  <-  server       experiments (CLI) on top,
                       ^--  clients  (never server)        fedpriv (the Python API) above it

``privacy`` takes plain arguments: no Flower, no run-config schema. ``tasks`` is what
both sides of the federation share. Read from the source (every import statement, at
module level or inside a function), so a lazy import cannot hide a cycle or a breach.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

PACKAGES = ("tasks", "privacy", "strategies", "server", "clients", "experiments", "fedpriv")
ALLOWED = {  # package -> project packages it may import
    "privacy": {"privacy"},
    "tasks": {"tasks", "privacy"},
    "strategies": {"strategies", "tasks", "privacy"},
    "clients": {"clients", "tasks", "privacy"},
    "server": {"server", "strategies", "tasks", "privacy"},
    "experiments": set(PACKAGES) - {"fedpriv"},
    "fedpriv": {"fedpriv", "experiments", "tasks"},
}


def _module(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {_module(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}


def _imports(path: Path, module: str, known: set[str]) -> list[str]:
    """Every project module the file imports, at module level or inside a function."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out += [name for name in names if name in known]
    return out


def import_cycle(modules: dict[str, Path]) -> list[str] | None:
    """The first import cycle among ``modules`` (every import, function-level ones too: a
    lazy import only moves the failure to run time), or None."""
    known = set(modules)
    graph = {m: {n for n in _imports(p, m, known) if n != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    cycle = import_cycle(_modules())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_closed_by_a_function_level_import_is_caught(tmp_path):
    # The shape fedpriv once had: state -> central_dp -> rounds at module level, and
    # rounds back to state inside a function.
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "state.py").write_text("from .central_dp import X\n")
    (pkg / "central_dp.py").write_text("from .rounds import Y\nX = 1\n")
    (pkg / "rounds.py").write_text("Y = 2\n\n\ndef later():\n    from . import state\n"
                                   "    return state\n")
    cycle = import_cycle(_modules(tmp_path, ("planted",)))
    assert cycle is not None and set(cycle) == {"planted.state", "planted.central_dp",
                                                 "planted.rounds"}
    (pkg / "rounds.py").write_text("Y = 2\n")  # the lazy import removed: no cycle
    assert import_cycle(_modules(tmp_path, ("planted",))) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_the_layers_below_it(package):
    modules = _modules()
    known = set(modules)
    for m, path in modules.items():
        if m.split(".")[0] != package:
            continue
        for name in _imports(path, m, known):
            assert name.split(".")[0] in ALLOWED[package], f"{m} imports {name}"
        if package == "privacy":  # plain arguments in, plain numbers out
            text = path.read_text()
            assert "import flwr" not in text and "from flwr" not in text, m


def test_the_schema_loads_without_torch_or_flower():
    # The CLI validates every input before starting anything; that must stay cheap.
    code = ("import sys, tasks.config, experiments.cli.main; "
            "print(sorted(m for m in ('torch', 'flwr', 'sklearn', 'opacus', 'dp_accounting') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_what_every_run_starts_with_leaves_the_heavy_extras_to_the_runs_using_them():
    # The runtime's and the pre-flight check's imports, and a sweep's CLI before its
    # runtime starts, are on every run's critical path: scipy's statistics (half a
    # second) serve audits and malicious-server tables, matplotlib the CLI's plots.
    code = ("import sys, experiments.runtime.inprocess as r, experiments.preflight.checks, "
            "experiments.cli.main, experiments.sweep.run; r.warm_up(); "
            "print(sorted(m for m in ('scipy.stats', 'scipy.optimize', 'sklearn') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
    code = ("import sys, experiments.cli.main, experiments.sweep.run; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "False"
    # a sweep's tables and plots, at its end: its intervals need scipy's t quantile only
    code = ("import sys, experiments.sweep.plots, experiments.sweep.table; "
            "print('scipy.stats' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "False"


REFERENCE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def test_lazy_references_point_down_too():
    # A registry entry "module:attribute" is an import made later: it obeys the layers too
    # (the strategies' registry lives in strategies/, not in tasks/ pointing up at it).
    modules = _modules()
    for m, path in modules.items():
        package = m.split(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and REFERENCE.fullmatch(node.value):
                target = node.value.split(":")[0]
                if target in modules:
                    assert target.split(".")[0] in ALLOWED[package], f"{m} names {node.value}"
