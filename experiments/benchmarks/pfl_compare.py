"""Benchmark: fedpriv against a peer, Apple's pfl (pfl-research), on the same FedAvg work.

pfl 0.6 pins dp-accounting < 0.6, which conflicts with flwr[dp], so it gets a virtualenv
of its own (created on first use under ``--venv``, ``pip install pfl==0.6.0``); a
``.pth`` file there adds this environment's packages *after* pfl's own, so pfl's
dp-accounting wins and torch and fedpriv's model code are shared. Both train the main
job's shape (10 clients x 400 embedded-MNIST images, everyone each round, 1 local epoch,
batch 32, the small CNN) on the same client tensors, on the CPU; pfl runs in one process
(``SimulatedBackend``), fedpriv through Flower's simulation. Reported, in one sitting:
the whole run, the steady round, and a sweep of 8 runs (4 learning rates x 2 seeds; for
fedpriv one ``fedpriv sweep`` in one simulation, for pfl the 8 runs in one process).

    python -m experiments.benchmarks.pfl_compare [--venv ~/.cache/fedpriv/pfl-venv]
"""

from __future__ import annotations

import argparse
import json
import os
import site
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.benchmarks.fedavg_overhead import bench_fedpriv, print_table
from experiments.benchmarks.sweep_overhead import LRS, SEEDS, sweep_file, timed
from experiments.configs import resolve
from tasks.splits import client_split, heldout_split

PFL = "pfl==0.6.0"
SETS = ["num-clients=10", "num-server-rounds=5", "local-epochs=1"]


def ensure_venv(path: Path) -> Path:
    """pfl's virtualenv (made once); its python."""
    python = path / "bin" / "python"
    if not python.exists():
        print(f"creating pfl's virtualenv in {path} (pip install {PFL}) ...", flush=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", PFL], check=True)
        packages = subprocess.run(
            [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
            capture_output=True, text=True, check=True).stdout.strip()
        ours = site.getsitepackages()[0]
        (Path(packages) / "zz-fedpriv-env.pth").write_text(
            f"import site; site.addsitedir({ours!r})\n")
    return python


def write_data(path: Path) -> dict:
    cfg = resolve(None, SETS)
    n = cfg.federation.num_clients
    arrays = {}
    for i in range(n):
        split = client_split(cfg, i, n)
        arrays[f"x{i}"], arrays[f"y{i}"] = split.x.numpy(), split.y.numpy()
    test = heldout_split(cfg)
    arrays["x_test"], arrays["y_test"] = test.x.numpy(), test.y.numpy()
    np.savez(path, **arrays)
    t = cfg.training
    return {"data": str(path), "num_clients": n, "per_round": n, "model": t.model,
            "input_shape": list(test.x.shape[1:]), "num_classes": test.num_classes,
            "rounds": cfg.federation.num_server_rounds, "epochs": t.local_epochs,
            "batch_size": t.batch_size, "momentum": t.momentum, "weight_decay": t.weight_decay}


def bench_pfl(python: Path, spec: dict, runs: list[dict]) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    proc = subprocess.run([str(python), "-m", "experiments.benchmarks.pfl_worker",
                           json.dumps({**spec, "runs": runs})], capture_output=True, text=True,
                          env={**os.environ, "PFL_PYTORCH_DEVICE": "cpu"},
                          cwd=Path(__file__).resolve().parents[2])
    if proc.returncode != 0:
        raise RuntimeError(f"pfl failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return time.perf_counter() - t0, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path,
                        default=Path("~/.cache/fedpriv/pfl-venv").expanduser())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    python = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec = write_data(folder / "data.npz")
        cfg = resolve(None, SETS)
        print("pfl, one run ...", flush=True)
        pfl_total, (pfl_run,) = bench_pfl(python, spec, [{"lr": cfg.training.lr,
                                                          "seed": cfg.training.seed}])
        print("fedpriv, one run ...", flush=True)
        fp = bench_fedpriv([a for s in SETS for a in ("--set", s)], folder / "fp")
        print(f"pfl, sweep of {len(LRS) * len(SEEDS)} runs in one process ...", flush=True)
        pfl_sweep, _ = bench_pfl(python, spec, [{"lr": lr, "seed": s} for lr in LRS
                                                for s in SEEDS])
        print(f"fedpriv sweep, {len(LRS) * len(SEEDS)} runs in one simulation ...", flush=True)
        fp_sweep = timed([sys.executable, "-m", "experiments.cli", "sweep",
                          str(sweep_file(folder))])
    pfl_steady = statistics.median(pfl_run["rounds-s"][1:])
    fp_steady = statistics.median(fp["rounds-s"][1:])
    rows = [("", "fedpriv", "pfl 0.6", "fedpriv / pfl"),
            ("whole run (s)", f"{fp['total-s']:.1f}", f"{pfl_total:.1f}",
             f"{fp['total-s'] / pfl_total:.2f}x"),
            ("steady round, median (s)", f"{fp_steady:.3f}", f"{pfl_steady:.3f}",
             f"{fp_steady / pfl_steady:.2f}x"),
            (f"sweep of {len(LRS) * len(SEEDS)} runs (s)", f"{fp_sweep:.1f}", f"{pfl_sweep:.1f}",
             f"{fp_sweep / pfl_sweep:.2f}x"),
            ("final test accuracy", f"{fp['accuracy'][-1]:.4f}",
             f"{pfl_run['accuracy'][-1]:.4f}" if pfl_run["accuracy"] else "?", "")]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"fedpriv": fp, "pfl": pfl_run, "pfl-total-s": pfl_total,
                                         "pfl-sweep-s": pfl_sweep, "fedpriv-sweep-s": fp_sweep},
                                        indent=2, default=str))


if __name__ == "__main__":
    main()
