"""Benchmark: per-round time on real SuperNodes (Flower's deployment runtime, loopback)
against the simulation of the same workload: warm SuperNodes against Flower's stock ones.

Runs the same config (default: 3 clients, 4 rounds, embedded MNIST, small CNN) as

1. a simulation, in-process (``fedpriv run``'s default) and on Ray (``runtime = ray``),
2. real SuperNodes as Flower ships them (``FEDPRIV_CLIENTAPPS=per-message``): a new
   ``flwr-clientapp`` process per message, the SuperNode's 3 s idle poll,
3. warm SuperNodes (fedpriv's default, :mod:`experiments.deploy.warm_node`): one
   long-running ClientApp worker per node, 0.1 s SuperNode polls,

``--repeat`` times, alternating, and prints per case the medians of the steady round time
(rounds 2..R), the training time the clients reported, and the rest (transport: polls,
process starts), with each sitting's steady rounds.

    python -m experiments.benchmarks.deploy_latency
    python -m experiments.benchmarks.deploy_latency --repeat 3 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tasks.results.ledger import read_ledger

REPO = Path(__file__).resolve().parents[2]


CLIENTAPPS = "FEDPRIV_CLIENTAPPS"  # experiments.runtime.superlink: warm | per-message


def _run(results: Path, sets: list[str], supernodes: bool,
         env: dict[str, str] | None = None) -> tuple[float, list]:
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--set", f"results-dir={results}"]
    for s in sets:
        cmd += ["--set", s]
    if supernodes:
        cmd.append("--supernodes")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    run = next(p for p in results.iterdir() if p.is_dir())
    return wall, read_ledger(run)


def _measure(wall: float, ledger: list) -> tuple[float, float, float, float]:
    """(total s, steady round s, slowest client's training s, final accuracy)."""
    steady = [r.time["round-s"] for r in ledger[1:]] or [ledger[0].time["round-s"]]
    train = [max((c.get("train-time-s", 0.0) for c in r.clients), default=0.0)
             for r in ledger[1:]] or [0.0]
    return wall, statistics.mean(steady), statistics.mean(train), ledger[-1].accuracy


CASES = [("simulation, in-process (the default)", False, {}, []),
         ("simulation, Ray (runtime = ray)", False, {}, ["runtime=ray"]),
         ("SuperNodes, Flower's stock (a flwr-clientapp per message, 3 s idle poll)", True,
          {CLIENTAPPS: "per-message"}, []),
         ("SuperNodes, warm (one ClientApp worker per node, 0.1 s polls)", True,
          {CLIENTAPPS: "warm"}, [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="sittings, cases alternating")
    args = ap.parse_args(argv)
    base = [f"num-clients={args.clients}", f"num-server-rounds={args.rounds}",
            "local-epochs=1"]
    got: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, *_ in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for i, (name, nodes, env, extra) in enumerate(CASES):
                print(f"sitting {rep + 1}/{args.repeat}: {name}...", flush=True)
                wall, ledger = _run(Path(tmp) / f"{rep}-{i}", [*base, *extra], nodes, env)
                got[name].append(_measure(wall, ledger))
                print(f"  steady round {got[name][-1][1]:.2f} s", flush=True)
    print(f"\n{args.clients} clients, {args.rounds} rounds, embedded MNIST, small CNN, "
          f"{args.repeat} sitting(s), medians (steady = rounds 2..R; transport = round minus "
          "the slowest client's training)")
    print("| runtime | total s | steady round s | training s | transport s | final acc "
          "| steady round per sitting |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, runs in got.items():
        wall, round_s, train_s = (statistics.median(r[k] for r in runs) for k in range(3))
        print(f"| {name} | {wall:.1f} | {round_s:.2f} | {train_s:.2f} | {round_s - train_s:.2f} "
              f"| {runs[-1][3]:.4f} | {', '.join(f'{r[1]:.2f}' for r in runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
