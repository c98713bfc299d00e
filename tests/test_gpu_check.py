"""The GPU check script: it says so where there is no GPU, and its whole pipeline (every
workload's benchmark as a child, its JSON read into the table) runs with the CPU standing
in, so that it is known to work before a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import REPO

pytestmark = pytest.mark.slow


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.benchmarks.gpu_check", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_says_so_and_stops():
    done = _check()
    assert done.returncode == 0, done.stderr
    assert "No CUDA device on this machine" in done.stdout
    assert "--device cpu" in done.stdout  # how to try it here


def test_every_workload_runs_with_the_cpu_standing_in(tmp_path):
    out = tmp_path / "figures.json"
    done = _check("--device", "cpu", "--quick", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == []
    names = [f["workload"] for f in report["figures"]]
    for expected in ("main job, steady round", "main job with train-together, steady round",
                     "DP-SGD client epoch, bookkeeping",
                     "DP-SGD char-GRU client epoch, bookkeeping",
                     "train-together, 4 clients x 8 images", "reference training, DP-SGD"):
        assert expected in names, names
    assert all(f["device-s"] > 0 and f["plain-loop-s"] > 0 for f in report["figures"])
    assert "ratio to the loop" in done.stdout
    # each workload's figures are printed as it ends, before the table
    assert done.stdout.index("  main job, steady round: ") < \
        done.stdout.index("DP-SGD on cpu ...")
