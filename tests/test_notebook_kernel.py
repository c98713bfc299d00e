"""The notebook flow in a real Jupyter kernel, started as a Jupyter from another environment
starts fedpriv's registered kernel: the kernelspec names this environment's Python by
path, while the environment the kernel inherits is the Jupyter's (its PATH without this
environment's bin, no VIRTUAL_ENV, its inline MPLBACKEND) and the notebook's folder is
outside the checkout. Cells go over Jupyter's messaging protocol (jupyter_client to
ipykernel), and what the notebook shows comes back as the frontend receives it."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import ipykernel  # noqa: F401  (a dev dependency: the kernel this test starts)
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
CELL_TIMEOUT = 420


def _jupyters_environment(notebooks: Path) -> dict[str, str]:
    """What a Jupyter installed elsewhere exports to the kernels it starts."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p != venv_bin)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "MPLBACKEND", "PYTHONHOME")}
    return {**env, "PATH": path, "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            "JPY_SESSION_NAME": str(notebooks / "study.ipynb"),
            "PYDEVD_DISABLE_FILE_VALIDATION": "1"}


class Notebook:
    """A kernel and the outputs of each executed cell, as a frontend collects them."""

    def __init__(self, km: KernelManager) -> None:
        self.client = km.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str) -> dict[str, list]:
        shown: dict[str, list] = {"stream": [], "display": [], "error": []}

        def collect(msg: dict) -> None:
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                shown["stream"].append(content["text"])
            elif kind in ("display_data", "execute_result"):
                shown["display"].append(content["data"])
            elif kind == "error":
                shown["error"].append("\n".join(content["traceback"]))

        reply = self.client.execute_interactive(textwrap.dedent(code), timeout=CELL_TIMEOUT,
                                                output_hook=collect)
        assert reply["content"]["status"] == "ok", "\n".join(shown["error"]) or reply
        return shown


@pytest.fixture
def notebook(tmp_path):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    specs = tmp_path / "kernels"
    (specs / "fedpriv").mkdir(parents=True)
    (specs / "fedpriv" / "kernel.json").write_text(json.dumps({  # what `ipykernel install` writes
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fedpriv", "language": "python"}))
    km = KernelManager(kernel_name="fedpriv",
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(specs)]))
    km.start_kernel(cwd=str(notebooks), env=_jupyters_environment(notebooks))
    try:
        yield Notebook(km), notebooks
    finally:
        km.shutdown_kernel(now=True)  # by the manager, which holds the kernel's PID


def _html(shown: dict[str, list]) -> str:
    return "".join(d.get("text/html", "") for d in shown["display"])


def test_the_notebook_flow_runs_in_a_kernel_started_by_a_jupyter_from_another_environment(
        notebook):
    nb, notebooks = notebook
    setup = nb.run("""
        import os
        import matplotlib
        import fedpriv
        print(matplotlib.get_backend(), os.getcwd(), fedpriv.__version__)
        """)
    text = "".join(setup["stream"])
    assert "inline" in text and str(notebooks) in text, text

    ran = nb.run("""
        result = fedpriv.run(num_clients=2, num_server_rounds=1, results_dir="results",
                             tracking="tensorboard")
        result
        """)
    assert any("round 1" in s or "Round 1" in s or "| " in s for s in ran["stream"]), \
        ran["stream"]  # the run's progress appears in the cell as it goes
    html = _html(ran)
    assert "<img" in html and "accuracy" in html, html[:500]

    nb.run("""
        frame = result.frame()
        assert list(frame["round"]) == [0, 1], frame
        assert (result.run_dir / "tensorboard").is_dir()
        assert result.plots and all(p.exists() for p in result.plots.values())
        """)

    swept = nb.run("""
        study = fedpriv.sweep(grid={"dp": ["none", "local"]},
                              fixed={"num_clients": 2, "num_server_rounds": 1,
                                     "target_epsilon": 5, "results_dir": "results"},
                              echo=None)
        assert study.ok, study.cells
        both = fedpriv.concat([result, *study.runs.values()])
        assert len(both) == 6 and set(both["dp"]) == {"none", "local"}, both
        assert set(study.frame()["cell"]) == set(study.runs) and len(study.runs) == 2
        study
        """)
    assert "<table" in _html(swept) and "<img" in _html(swept)

    drawn = nb.run("""
        import matplotlib.pyplot as plt
        plt.plot(both["round"], both["test_accuracy"], "o")
        plt.show()
        """)
    assert any("image/png" in d for d in drawn["display"]), drawn  # the notebook's own plot

    attacked = nb.run("""
        seen = fedpriv.run(num_clients=2, num_server_rounds=1, results_dir="results",
                           leakage_rounds="1", observed_examples=1, batch_size=1,
                           attacks="labels", echo=None)
        lines = []
        attacked = fedpriv.attack(seen.run_dir, "labels", echo=lines.append)
        assert "labels" in attacked.leakage, attacked.leakage
        past = fedpriv.runs("results")
        assert len(past) >= 4 and set(past["status"]) == {"finished"}, past
        attacked
        """)
    assert "labels:" in _html(attacked)
