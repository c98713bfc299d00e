"""Benchmark: a sweep of main-job cells, in one simulation and one simulation per cell,
against the plain PyTorch loop doing the same cells' work, in one sitting.

The sweep (default: the main job's shape — 10 clients x 400 embedded-MNIST images, 5
rounds, small CNN — at 4 learning rates x 2 seeds = 8 runs) is run

1. as ``fedpriv sweep`` (every cell inside one Flower simulation),
2. with ``--separate`` (one simulation per cell; skip with ``--skip-separate``),
3. by :mod:`experiments.benchmarks.plain_fedavg`, every cell in turn in one process,
4. and once as a single ``fedpriv run`` of the first cell, whose total minus its rounds is
   fedpriv's fixed start-up.

It prints each wall time and checks the target: the one-simulation sweep should cost
at most the plain loop's time + one start-up + 2 s per cell.

    python -m experiments.benchmarks.sweep_overhead [--skip-separate]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

from experiments.benchmarks.fedavg_overhead import bench_fedpriv, print_table
from experiments.benchmarks.plain_fedavg import plain_fedavg
from experiments.configs import resolve

LRS = [0.02, 0.05, 0.1, 0.2]
SEEDS = [1, 2]


def sweep_file(folder: Path) -> Path:
    path = folder / "bench.toml"
    path.write_text(tomli_w.dumps({
        "name": "bench", "seeds": SEEDS,
        "fixed": {"num-clients": 10, "num-server-rounds": 5, "save-model": False,
                  "results-dir": str(folder / "results")},
        "grid": {"lr": LRS}}))
    return path


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-separate", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cells = len(LRS) * len(SEEDS)
    report: dict = {"cells": cells}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec = sweep_file(folder)
        cli = [sys.executable, "-m", "experiments.cli", "sweep", str(spec)]
        print(f"fedpriv sweep, {cells} runs in one simulation ...", flush=True)
        report["together-s"] = timed(cli)
        if not args.skip_separate:
            print(f"fedpriv sweep --separate, {cells} simulations ...", flush=True)
            report["separate-s"] = timed([*cli, "--separate"])
        print("plain PyTorch loop, the same runs ...", flush=True)
        t0 = time.perf_counter()
        for lr in LRS:
            for seed in SEEDS:
                plain_fedavg(resolve(None, ["num-clients=10", "num-server-rounds=5",
                                            f"lr={lr}", f"seed={seed}"]))
        report["plain-s"] = time.perf_counter() - t0
        print("fedpriv run, one cell (for its fixed start-up) ...", flush=True)
        one = bench_fedpriv(["--set", "num-clients=10", "--set", "num-server-rounds=5",
                             "--set", f"lr={LRS[0]}", "--set", f"seed={SEEDS[0]}"],
                            folder / "one")
        report["startup-s"] = one["total-s"] - sum(one["rounds-s"])
    budget = report["plain-s"] + report["startup-s"] + 2 * cells
    rows = [("", "seconds", "per run"),
            ("fedpriv sweep, one simulation", f"{report['together-s']:.1f}",
             f"{report['together-s'] / cells:.1f}")]
    if "separate-s" in report:
        rows.append(("fedpriv sweep --separate", f"{report['separate-s']:.1f}",
                     f"{report['separate-s'] / cells:.1f}"))
    rows += [("plain PyTorch, same runs", f"{report['plain-s']:.1f}",
              f"{report['plain-s'] / cells:.1f}"),
             ("fedpriv fixed start-up (one run)", f"{report['startup-s']:.1f}", ""),
             ("target: plain + start-up + 2 s/run", f"{budget:.1f}",
              "met" if report["together-s"] <= budget else
              f"missed by {report['together-s'] - budget:.1f} s")]
    print_table(rows)
    report["target-s"] = budget
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
