"""Benchmark: start-up and memory as the federation grows (10 vs 10,000 clients).

Runs ``fedpriv run`` on full Fashion-MNIST with the small CNN, 100 clients a round
(everyone at 10 clients), 1 local epoch, 2 rounds, at each size, and prints the whole
run, the rounds, the start-up (total minus the rounds after the first; the first round
includes starting the Ray actors) and the peak memory of the whole process tree. In
simulation the server assigns partitions to nodes, so nothing in start-up should grow
with the number of clients.

    python -m experiments.benchmarks.scale [--clients 10 10000] [--bare-flower]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from experiments.benchmarks.fedavg_overhead import (
    _gib,
    bench_bare_flower,
    bench_fedpriv,
    print_table,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 10_000])
    parser.add_argument("--bare-flower", action="store_true",
                        help="also time a bare Flower app (clients that do nothing) at each "
                             "size, 100 clients a round: Flower's own cost of the size")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [("clients", "total (s)", "round 1 (s)", "round 2 (s)", "start-up (s)",
             "peak PSS", "peak RSS", "accuracy")]
    report: dict = {}
    bare_rows = [("clients", "bare Flower app, total (s)")]
    for n in args.clients:
        print(f"fedpriv run, {n:,} clients ...", flush=True)
        sets = ["--config", "fashion-mnist", "--set", f"num-clients={n}",
                "--set", f"fraction-train={min(1.0, 100 / n)}", "--set", "model=small-cnn",
                "--set", "local-epochs=1", "--set", "num-server-rounds=2",
                "--set", "save-model=false"]
        with tempfile.TemporaryDirectory() as tmp:
            r = bench_fedpriv(sets, Path(tmp))
        startup = r["total-s"] - sum(r["rounds-s"][1:])
        report[n] = {**r, "startup-s": startup}
        if args.bare_flower:
            print(f"bare Flower app, {n:,} clients ...", flush=True)
            report[n]["bare-flower"] = bench_bare_flower(n, 2, min(1.0, 100 / n))
            bare_rows.append((f"{n:,}", f"{report[n]['bare-flower']['total-s']:.1f}"))
        rows.append((f"{n:,}", f"{r['total-s']:.1f}", f"{r['rounds-s'][0]:.2f}",
                     f"{r['rounds-s'][1]:.2f}", f"{startup:.1f}", _gib(r["peak-pss"]),
                     _gib(r["peak-rss"]), f"{r['accuracy'][-1]:.4f}"))
    print_table(rows)
    if args.bare_flower:
        print_table(bare_rows)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
