"""Signals at seeded moments of real runs on a loaded machine: does every run stop?

Starts one busy-loop process per core (the load), then, for each seeded point, a small
``fedpriv run`` that gets Ctrl-C (SIGINT) or SIGTERM after a seeded delay (start-up, a
round, shutdown: wherever the delay lands). For each it reports how long the run took to
exit after the signal, its exit code, what run.json says, and whether any process it
started is still alive 15 s later. Every busy loop and run is stopped by PID at the end.

    .venv/bin/python scripts/signal_soak.py [--points 20] [--seed 1] [--load 2]

Exit code 0 only when every run exited within --limit seconds with an honest run.json
(interrupted, or finished/failed if the signal came after the end) and left nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
MARKER = "FEDPRIV_TEST_MARKER"


def _spin() -> None:
    while True:
        pass


def _left(marker: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(MARKER) == marker:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def _one(results: Path, delay: float, how: int, limit: float) -> dict:
    marker = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--set", "num-clients=3",
           "--set", "num-server-rounds=4", "--set", f"results-dir={results}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, MARKER: marker})
    time.sleep(delay)
    sent = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(how)
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - sent
    if code is None:  # a hung run: stop it (and what it started) by PID, then report
        for pid in [proc.pid, *_left(marker)]:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        proc.wait()
    deadline = time.monotonic() + 15
    while _left(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    runs = sorted(p for p in results.iterdir() if (p / "run.json").is_file())
    status = (json.loads((runs[-1] / "run.json").read_text()).get("status") if runs
              else "no run folder yet")
    return {"delay-s": delay, "signal": signal.Signals(how).name, "exit": code,
            "exit-after-s": round(took, 1), "status": status, "left": len(_left(marker))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2,
                        help="busy-loop processes (default: one per core)")
    parser.add_argument("--longest", type=float, default=40.0,
                        help="latest signal, seconds after the start (default 40)")
    parser.add_argument("--limit", type=float, default=30.0,
                        help="seconds a run may take to exit after the signal (default 30)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for s in spinners:
        s.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="fedpriv-soak-") as tmp:
            for i in range(args.points):
                results = Path(tmp) / f"point-{i:02d}"
                results.mkdir()
                how = rng.choice([signal.SIGINT, signal.SIGTERM])
                row = _one(results, round(rng.uniform(0.5, args.longest), 1), how, args.limit)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for s in spinners:
            s.kill()
    honest = {"interrupted", "finished", "failed", "no run folder yet"}
    bad = [r for r in rows if r["exit"] is None or r["exit-after-s"] > args.limit
           or r["status"] not in honest or r["left"]]
    worst = max((r["exit-after-s"] for r in rows), default=0.0)
    print(f"{len(rows)} signalled runs under a load of {args.load}: {len(bad)} bad; slowest "
          f"exit {worst:.1f} s after its signal (limit {args.limit:g} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
