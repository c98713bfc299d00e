"""A notebook's MPLBACKEND never stops a run: Jupyter exports its inline backend to the
kernel, and from a kernel in another environment every fedpriv process inherited a backend
that matplotlib refuses to import (every run crashed in its pre-flight check)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tasks.headless import keep_matplotlib_importable, loadable

from .conftest import REPO, only_run, run_cli

MISSING = "module://fedpriv_test_no_such_backend.backend_inline"  # importable nowhere
# what Jupyter exports; matplotlib maps it to its "inline" entry point and refuses to import
# where matplotlib-inline is not installed (fedpriv does not depend on it)
JUPYTER = "module://matplotlib_inline.backend_inline"
INLINE_INSTALLED = importlib.util.find_spec("matplotlib_inline") is not None
# an environment without matplotlib-inline, for this process's children: a sitecustomize
# (run at every interpreter's start) that hides the package from imports and from the
# installed distributions (matplotlib maps Jupyter's backend to the entry point it registers)
HIDE_INLINE = """import importlib.machinery, sys
HIDDEN = "matplotlib_inline"
class NoInline:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoInline())
installed = importlib.machinery.PathFinder.find_distributions
def others(*args, **kwargs):
    return (d for d in installed(*args, **kwargs)
            if (d.metadata["Name"] or "").lower().replace("-", "_") != HIDDEN)
importlib.machinery.PathFinder.find_distributions = others
"""


def _environment(tmp_path, backend: str) -> dict[str, str]:
    """MPLBACKEND set to ``backend``; for Jupyter's, in an environment where it cannot load."""
    if backend != JUPYTER:
        return {"MPLBACKEND": backend}
    site = tmp_path / "no-matplotlib-inline"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_INLINE)
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"MPLBACKEND": backend, "PYTHONPATH": os.pathsep.join(paths)}


def test_which_backends_can_load():
    assert loadable("agg") and loadable("Agg") and loadable("svg")
    assert loadable("module://matplotlib.backends.backend_agg")
    assert not loadable(MISSING)
    assert loadable(JUPYTER) == INLINE_INSTALLED
    assert not loadable("module://")
    assert not loadable("no-such-backend")


def test_an_unloadable_backend_is_replaced_and_a_loadable_one_kept(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", MISSING)
    assert keep_matplotlib_importable() == MISSING
    assert os.environ["MPLBACKEND"] == "agg"
    monkeypatch.setenv("MPLBACKEND", "svg")  # a notebook's own choice stays
    assert keep_matplotlib_importable() is None and os.environ["MPLBACKEND"] == "svg"


@pytest.mark.slow
@pytest.mark.parametrize("backend", [JUPYTER, MISSING, "no-such-backend"])
def test_a_run_plots_to_files_whatever_mplbackend_says(tmp_path, backend):
    """The CLI and every child it starts (pre-flight check, runtime, plots)."""
    results = tmp_path / "results"
    res = run_cli("run", "--set", "num-clients=2", "--set", "num-server-rounds=1",
                  "--set", f"results-dir={results}", env=_environment(tmp_path, backend))
    assert res.returncode == 0, res.stdout + res.stderr
    plots = only_run(results) / "plots"
    assert {"accuracy.png", "loss.png", "label_distribution.png"} <= \
        {p.name for p in plots.iterdir()}


@pytest.mark.slow
def test_the_python_api_from_a_kernel_with_another_environments_backend(tmp_path):
    """As a Jupyter kernel started by a Jupyter in another environment runs it: Jupyter's
    backend, in an environment without matplotlib-inline."""
    script = ("import json, sys\n"
              "from tasks.headless import loadable\n"
              f"assert not loadable({JUPYTER!r})  # this environment cannot load it\n"
              "import fedpriv\n"
              "r = fedpriv.run(num_clients=2, num_server_rounds=1, echo=None,\n"
              "                results_dir=sys.argv[1])\n"
              "import matplotlib.pyplot  # the notebook's own plots still import\n"
              "print(json.dumps({'ok': r.ok, 'plots': sorted(p.name for p in\n"
              "      (r.run_dir / 'plots').iterdir())}))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "results")],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **_environment(tmp_path, JUPYTER)})
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ok"] and "accuracy.png" in out["plots"], out
