"""Benchmark: per-round time on real SuperNodes (Flower's deployment runtime, loopback)
against the simulation of the same workload, and what fedpriv's polling settings change.

Runs the same config (default: 3 clients, 4 rounds, embedded MNIST, small CNN) as

1. a simulation (``fedpriv run``),
2. real SuperNodes with Flower's own polls (3 s reply poll, 1 s SuperExec poll),
3. real SuperNodes with fedpriv's 0.2 s reply poll (its default),
4. the same with a 0.1 s SuperExec poll (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``),

and prints the steady round time (rounds 2..R), the training time the clients reported,
and the rest (Flower's transport: polls, a new ClientApp process per message).

    python -m experiments.benchmarks.deploy_latency
    python -m experiments.benchmarks.deploy_latency --rounds 6 --clients 4
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
SUPEREXEC_POLL = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # Flower's SuperExec poll, 1 s by default


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


def _row(name: str, wall: float, ledger: list) -> str:
    steady = [r.time["round-s"] for r in ledger[1:]] or [ledger[0].time["round-s"]]
    train = [max((c.get("train-time-s", 0.0) for c in r.clients), default=0.0)
             for r in ledger[1:]] or [0.0]
    round_s, train_s = statistics.mean(steady), statistics.mean(train)
    return (f"| {name} | {wall:.1f} | {round_s:.2f} | {train_s:.2f} | {round_s - train_s:.2f} "
            f"| {ledger[-1].accuracy:.4f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    base = [f"num-clients={args.clients}", f"num-server-rounds={args.rounds}",
            "local-epochs=1"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("simulation (Ray)", False, [], {}),
                 ("SuperNodes, Flower's polls (reply 3 s, SuperExec 1 s)", True,
                  ["reply-poll-interval=3"], {}),
                 ("SuperNodes, fedpriv's defaults (reply 0.2 s, SuperExec 1 s)", True, [], {}),
                 ("SuperNodes, reply 0.2 s, SuperExec 0.1 s", True, [],
                  {SUPEREXEC_POLL: "0.1"})]
        for i, (name, nodes, extra, env) in enumerate(cases):
            print(f"running: {name}...", flush=True)
            wall, ledger = _run(Path(tmp) / str(i), base + extra, nodes, env)
            rows.append(_row(name, wall, ledger))
    print(f"\n{args.clients} clients, {args.rounds} rounds, embedded MNIST, small CNN "
          "(steady = rounds 2..R; transport = round minus the slowest client's training)")
    print("| runtime | total s | steady round s | training s | transport s | final acc |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
