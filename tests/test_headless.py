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
WHY_INLINE = ("matplotlib-inline is installed here, so Jupyter's backend loads: the "
              "environment this case needs is one without it")


@pytest.fixture
def no_matplotlib_inline():
    if INLINE_INSTALLED:
        pytest.skip(WHY_INLINE)


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
@pytest.mark.parametrize("backend", [
    # only Jupyter's backend needs matplotlib-inline absent; the others are missing anywhere
    pytest.param(JUPYTER, marks=pytest.mark.skipif(INLINE_INSTALLED, reason=WHY_INLINE)),
    MISSING, "no-such-backend"])
def test_a_run_plots_to_files_whatever_mplbackend_says(tmp_path, backend):
    """The CLI and every child it starts (pre-flight check, runtime, plots)."""
    results = tmp_path / "results"
    res = run_cli("run", "--set", "num-clients=2", "--set", "num-server-rounds=1",
                  "--set", f"results-dir={results}", env={"MPLBACKEND": backend})
    assert res.returncode == 0, res.stdout + res.stderr
    plots = only_run(results) / "plots"
    assert {"accuracy.png", "loss.png", "label_distribution.png"} <= \
        {p.name for p in plots.iterdir()}


@pytest.mark.slow
def test_the_python_api_from_a_kernel_with_another_environments_backend(tmp_path,
                                                                      no_matplotlib_inline):
    """As a Jupyter kernel started by a Jupyter in another environment runs it."""
    script = ("import json, sys, fedpriv\n"
              "r = fedpriv.run(num_clients=2, num_server_rounds=1, echo=None,\n"
              "                results_dir=sys.argv[1])\n"
              "import matplotlib.pyplot  # the notebook's own plots still import\n"
              "print(json.dumps({'ok': r.ok, 'plots': sorted(p.name for p in\n"
              "      (r.run_dir / 'plots').iterdir())}))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "results")],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MPLBACKEND": JUPYTER})
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ok"] and "accuracy.png" in out["plots"], out
