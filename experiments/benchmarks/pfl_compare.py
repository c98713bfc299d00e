"""Benchmark: fedpriv against a peer, Apple's pfl (pfl-research), on the same FedAvg work.

pfl 0.6 pins dp-accounting < 0.6, which conflicts with flwr[dp], so it gets a virtualenv
of its own (created on first use under ``--venv``, ``pip install pfl==0.6.0``); a
``.pth`` file there adds this environment's packages *after* pfl's own, so pfl's
dp-accounting wins and torch and fedpriv's model code are shared. Both train the main
job's shape (10 clients x 400 embedded-MNIST images, everyone each round, 1 local epoch,
batch 32, the small CNN) on the same client tensors, on the CPU; pfl runs in one process
(``SimulatedBackend``), fedpriv in its in-process runtime and on Flower's simulation
runtime (Ray), and the plain single-process PyTorch loop (:mod:`plain_fedavg`) beside
them. Each sitting runs every system in turn; reported are medians over ``--repeat``
sittings of the whole run, the steady round and a sweep of 8 runs (4 learning rates x 2
seeds; for fedpriv one ``fedpriv sweep``, for pfl the 8 runs in one process).

    python -m experiments.benchmarks.pfl_compare [--repeat 3] [--venv DIR]
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

from experiments.benchmarks.fedavg_overhead import bench_fedpriv, bench_plain, print_table
from experiments.benchmarks.sweep_overhead import LRS, SEEDS, sweep_file, timed
from experiments.configs import resolve
from tasks.splits import client_split, heldout_split

PFL = "pfl==0.6.0"
SETS = ["num-clients=10", "num-server-rounds=5", "local-epochs=1"]
# pfl-research's CIFAR-10 benchmark shape: 1,000 users of 50 images, 50 a round, one local
# epoch of batch 10, a small CNN (fedpriv's McMahan CNN)
CIFAR_SETS = ["dataset=cifar10", "num-clients=1000", "fraction-train=0.05", "model=cnn",
              "local-epochs=1", "batch-size=10", "num-server-rounds=5"]


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


def write_data(path: Path, sets: list[str]) -> dict:
    cfg = resolve(None, sets)
    n = cfg.federation.num_clients
    arrays = {}
    for i in range(n):
        split = client_split(cfg, i, n)
        arrays[f"x{i}"], arrays[f"y{i}"] = split.x.numpy(), split.y.numpy()
    test = heldout_split(cfg)
    arrays["x_test"], arrays["y_test"] = test.x.numpy(), test.y.numpy()
    np.savez(path, **arrays)
    t = cfg.training
    per_round = max(1, round(cfg.federation.fraction_train * n))
    return {"data": str(path), "num_clients": n, "per_round": per_round, "model": t.model,
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


def _runs(python: Path, spec: dict, folder: Path, sets: list[str], rep: int,
          sweeps: bool) -> dict[str, dict]:
    """One sitting of every system, in turn: whole runs (and sweeps)."""
    cfg = resolve(None, sets)
    out: dict[str, dict] = {}
    print(f"[{rep}] pfl, one run ...", flush=True)
    total, (run,) = bench_pfl(python, spec, [{"lr": cfg.training.lr, "seed": cfg.training.seed}])
    out["pfl"] = {"total-s": total, "rounds-s": run["rounds-s"], "accuracy": run["accuracy"]}
    for variant, extra in VARIANTS.items():
        print(f"[{rep}] fedpriv ({variant}), one run ...", flush=True)
        out[variant] = bench_fedpriv([a for s in [*sets, *extra] for a in ("--set", s)],
                                     folder / f"fp-{variant}-{rep}")
    print(f"[{rep}] plain PyTorch loop, one run ...", flush=True)
    out["plain"] = bench_plain([a for s in sets for a in ("--set", s)])
    if not sweeps:
        return out
    print(f"[{rep}] pfl, sweep of {len(LRS) * len(SEEDS)} runs in one process ...", flush=True)
    out["pfl"]["sweep-s"] = bench_pfl(python, spec, [{"lr": lr, "seed": s} for lr in LRS
                                                     for s in SEEDS])[0]
    for variant, extra in VARIANTS.items():
        print(f"[{rep}] fedpriv sweep ({variant}), {len(LRS) * len(SEEDS)} runs ...", flush=True)
        out[variant]["sweep-s"] = timed([sys.executable, "-m", "experiments.cli", "sweep",
                                         str(sweep_file(folder)),
                                         *(a for s in extra for a in ("--set", s))])
    return out


THREADS = os.cpu_count() or 1
# fedpriv's defaults (one torch thread per client, so every runtime gives the same bits, a
# client per core training at once); in-process with every core for one client at a time,
# as pfl and the plain loop use them (torch's default); and Flower's simulation runtime
# (a client per core)
VARIANTS = {"inprocess": ["runtime=inprocess"],
            "inprocess-threads": ["runtime=inprocess", f"client-threads={THREADS}"],
            "ray": ["runtime=ray"]}
NAMES = {"inprocess": "fedpriv in-process", "inprocess-threads":
         f"fedpriv in-process, {THREADS} threads", "ray": "fedpriv on Ray", "pfl": "pfl 0.6",
         "plain": "plain loop"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path,
                        default=Path("~/.cache/fedpriv/pfl-venv").expanduser())
    parser.add_argument("--repeat", type=int, default=3,
                        help="sittings, each running every system in turn (medians reported)")
    parser.add_argument("--workload", choices=("main", "cifar10"), default="main",
                        help="main: the main job's shape (and the 8-run sweep); cifar10: "
                             "pfl's CIFAR-10 benchmark shape (1,000 users x 50 images, "
                             "cohort 50, a CNN) on the real CIFAR-10 files in --data-dir "
                             "(torchvision checks their MD5 sums)")
    parser.add_argument("--data-dir", type=Path, help="for --workload cifar10: the folder "
                        "holding cifar-10-batches-py")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    python = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sets = SETS
        if args.workload == "cifar10":
            if args.data_dir is None:
                parser.error("--workload cifar10 needs --data-dir (the folder holding "
                             "cifar-10-batches-py; CIFAR-10 is not downloadable here)")
            sets = [*CIFAR_SETS, f"data-dir={args.data_dir.resolve()}"]
        spec = write_data(folder / "data.npz", sets)
        sittings = [_runs(python, spec, folder, sets, rep, args.workload == "main")
                    for rep in range(1, args.repeat + 1)]

    def med(system: str, what: str) -> float:
        values = []
        for s in sittings:
            r = s[system]
            if what in ("steady", "steady-train"):
                # pfl's rounds evaluate nothing; fedpriv's "train-s" is its round less the
                # central evaluation of the new model (the plain loop's includes it)
                key = "train-s" if what == "steady-train" and "train-s" in r else "rounds-s"
                values.append(statistics.median(r[key][1:]))
            else:
                values.append(r.get(what, float("nan")))
        return statistics.median(values)

    systems = [*VARIANTS, "pfl", "plain"]
    best = "inprocess"  # the default
    rows = [("", *(NAMES[s] for s in systems), f"{NAMES[best]} / pfl")]
    rows_of = [("whole run (s)", "total-s", "{:.1f}"), ("steady round (s)", "steady", "{:.3f}"),
               ("steady round, training part (s)", "steady-train", "{:.3f}")]
    if args.workload == "main":
        rows_of.append((f"sweep of {len(LRS) * len(SEEDS)} runs (s)", "sweep-s", "{:.1f}"))
    for label, what, fmt in rows_of:
        rows.append((label, *(fmt.format(med(s, what)) if what != "sweep-s" or s != "plain"
                              else "-" for s in systems),
                     f"{med(best, what) / med('pfl', what):.2f}x"))
    rows.append(("peak PSS, process tree (GiB)",
                 *(f"{statistics.median(x[s]['peak-pss'] for x in sittings) / 2**30:.2f}"
                   if s != "pfl" else "-" for s in systems), ""))
    rows.append(("final test accuracy", *(f"{sittings[0][s]['accuracy'][-1]:.4f}"
                                          for s in systems), ""))
    print(f"\nmedians of {args.repeat} sitting(s), systems alternating within each")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(sittings, indent=2, default=str))

if __name__ == "__main__":
    main()
