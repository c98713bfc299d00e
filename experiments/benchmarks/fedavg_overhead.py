"""Benchmark: fedpriv (Flower + Ray) against a plain PyTorch loop doing identical FedAvg work.

For one workload (default: 10 clients, 5 rounds, 1 local epoch, embedded MNIST) it runs

1. ``fedpriv run`` as a user would (a subprocess: CLI, SuperLink, simulation, Ray),
2. :mod:`experiments.benchmarks.plain_fedavg` (one process, same data, seeds and SGD),
3. optionally a bare Flower app whose clients do nothing (Flower's own start-up floor),

each ``--repeat`` times in turns, then once more each sampling the summed memory of its
process tree (untimed: sampling slows the process sampled), and prints total time,
steady-state round time (rounds 2..R), fixed start-up (total minus rounds), peak memory
and the ratios fedpriv / plain. Both runs must reach the same test accuracy: the plain loop
replays fedpriv's arithmetic exactly, so equal numbers show the work was identical.

    python -m experiments.benchmarks.fedavg_overhead                       # MNIST, small-cnn
    python -m experiments.benchmarks.fedavg_overhead --set model=cnn       # McMahan CNN
    python -m experiments.benchmarks.fedavg_overhead --config fashion-mnist \\
        --set num-server-rounds=5 --set local-epochs=1 --skip-plain         # 100 clients
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

from experiments.configs import resolve
from experiments.runtime.procs import tree
from experiments.runtime.superlink import LocalSuperLink
from tasks.results.folder import read_run_info
from tasks.results.ledger import read_ledger

DEFAULT_SET = ["num-clients=10", "num-server-rounds=5", "local-epochs=1"]


def _mem(pids: list[int]) -> tuple[int, int]:
    """Summed RSS and PSS (bytes) of the process trees rooted at ``pids``."""
    rss = pss = 0
    seen: set[int] = set()
    for pid in pids:
        for p in tree(pid):
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                info = p.memory_full_info()
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
            except psutil.Error:
                pass
    return rss, pss


def measured(cmd: list[str], cwd: Path | None = None, memory: bool = True
             ) -> tuple[float, int, int, str]:
    """Run ``cmd``; return wall seconds, peak summed RSS and PSS of its tree (0 without
    ``memory``), and its stdout. Sampling the memory reads every process's page tables
    four times a second under its memory-map lock, which stalls a process that maps and
    unmaps buffers (a 1,000-client round: up to 25% slower), so timed runs leave it out."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, text=True)
        peak_rss = peak_pss = 0
        while proc.poll() is None:
            if memory:
                rss, pss = _mem([proc.pid])
                peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(0.25 if memory else 0.02)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    return wall, peak_rss, peak_pss, text


def bench_fedpriv(args: list[str], results: Path, memory: bool = True) -> dict:
    wall, rss, pss, _ = measured([sys.executable, "-m", "experiments.cli", "run", *args,
                                  "--set", f"results-dir={results}"], memory=memory)
    run = max(results.iterdir(), key=lambda p: p.stat().st_mtime)
    recs = read_ledger(run)
    info = read_run_info(run)
    return {"total-s": wall, "rounds-s": [r.time["round-s"] for r in recs],
            "train-s": [r.time.get("train-s") for r in recs],
            "accuracy": [r.accuracy for r in recs], "loss": [r.test["loss"] for r in recs],
            "setup-s (server)": info.get("setup-s"), "peak-rss": rss, "peak-pss": pss,
            "run-dir": str(run)}


def bench_plain(args: list[str], memory: bool = True) -> dict:
    wall, rss, pss, out = measured([sys.executable, "-m", "experiments.benchmarks.plain_fedavg",
                                    *args], memory=memory)
    res = json.loads(out.strip().splitlines()[-1])
    return {"total-s": wall, "rounds-s": [r["round-s"] for r in res["rounds"]],
            "accuracy": [r["accuracy"] for r in res["rounds"]],
            "loss": [r["loss"] for r in res["rounds"]], "peak-rss": rss, "peak-pss": pss}


BARE_SERVER = '''
import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
app = ServerApp()
@app.main()
def main(grid: Grid, context: Context) -> None:
    n = int(context.run_config["n"])
    FedAvg(fraction_train=float(context.run_config["fraction"]), fraction_evaluate=0.0,
           min_available_nodes=n).start(
        grid=grid, initial_arrays=ArrayRecord([np.zeros(26010, np.float32)]),
        num_rounds=int(context.run_config["rounds"]))
'''
BARE_CLIENT = '''
from flwr.app import Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
app = ClientApp()
@app.train()
def train(msg, context):
    return Message(RecordDict({"arrays": msg.content["arrays"],
                               "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
'''


def bench_bare_flower(n: int, rounds: int, fraction: float = 1.0) -> dict:
    """Flower's floor: the same federation size, clients that return the model untouched
    (``fraction`` of them a round)."""
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp) / "bare"
        (app / "bareapp").mkdir(parents=True)
        (app / "bareapp" / "__init__.py").write_text("")
        (app / "bareapp" / "server.py").write_text(BARE_SERVER)
        (app / "bareapp" / "client.py").write_text(BARE_CLIENT)
        (app / "pyproject.toml").write_text(textwrap.dedent(f"""
            [project]
            name = "bareapp"
            version = "0.1.0"
            [tool.flwr.app]
            publisher = "bench"
            [tool.flwr.app.components]
            serverapp = "bareapp.server:app"
            clientapp = "bareapp.client:app"
            [tool.flwr.app.config]
            n = {n}
            rounds = {rounds}
            fraction = {fraction}
            """))
        t0 = time.perf_counter()
        with LocalSuperLink(cwd=app) as link:
            started = time.perf_counter() - t0
            t1 = time.perf_counter()
            link.submit(app, {"n": n, "rounds": rounds, "fraction": fraction},
                        {"num-supernodes": n, "client-resources-num-cpus": 1},
                        lambda line: None)
            run_s = time.perf_counter() - t1
        return {"total-s": time.perf_counter() - t0, "superlink-s": started, "flwr-run-s": run_s}


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Print rows of strings as aligned columns."""
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)))


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB"


def _merge(runs: list[dict], memory: list[dict]) -> dict:
    """Medians over repeated runs, rounds pooled; peaks: the maximum over the ``memory``
    runs (sampled, not timed)."""
    out = {"total-s": statistics.median(r["total-s"] for r in runs),
           "steady-round-s": statistics.median(x for r in runs for x in r["rounds-s"][1:]
                                               or r["rounds-s"]),
           "first-round-s": statistics.median(r["rounds-s"][0] for r in runs),
           "rounds-total-s": statistics.median(sum(r["rounds-s"]) for r in runs),
           "peak-rss": max((r["peak-rss"] for r in memory), default=0),
           "peak-pss": max((r["peak-pss"] for r in memory), default=0),
           "accuracy": runs[-1]["accuracy"], "loss": runs[-1]["loss"], "runs": runs,
           "memory-runs": memory}
    out["fixed-s"] = out["total-s"] - out["rounds-total-s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="fedpriv vs plain PyTorch FedAvg overhead.")
    parser.add_argument("--config", help="preset for both runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="overrides for both runs (without --config, first: "
                             f"{' '.join(DEFAULT_SET)})")
    parser.add_argument("--repeat", type=int, default=1,
                        help="alternate fedpriv and plain runs this many times; report medians")
    parser.add_argument("--skip-plain", action="store_true")
    parser.add_argument("--bare-flower", action="store_true",
                        help="also time a bare Flower app of the same size (start-up floor)")
    parser.add_argument("--skip-memory", action="store_true",
                        help="no extra sitting for the peak memory (the timed runs never "
                             "sample it: sampling slows the process sampled)")
    parser.add_argument("--json", type=Path, help="write all figures to this file")
    args = parser.parse_args()
    sets = args.set if args.config else DEFAULT_SET + args.set  # a preset brings its own
    common = (["--config", args.config] if args.config else []) + \
        [a for s in sets for a in ("--set", s)]
    report: dict = {"args": common, "repeat": args.repeat}
    fps, pls, fp_mem, pl_mem = [], [], [], []
    sittings = [False] * args.repeat + ([] if args.skip_memory else [True])
    for i, memory in enumerate(sittings):
        what = "peak memory, untimed" if memory else f"{i + 1}/{args.repeat}"
        with tempfile.TemporaryDirectory() as tmp:
            print(f"[{what}] fedpriv run ...", flush=True)
            (fp_mem if memory else fps).append(bench_fedpriv(common, Path(tmp), memory))
        if not args.skip_plain:
            print(f"[{what}] plain PyTorch loop ...", flush=True)
            (pl_mem if memory else pls).append(bench_plain(common, memory))
    report["fedpriv"] = _merge(fps, fp_mem)
    report["plain"] = _merge(pls, pl_mem) if pls else None
    if args.bare_flower:
        cfg = resolve(args.config, sets)
        print("bare Flower app ...", flush=True)
        report["bare-flower"] = bench_bare_flower(cfg.federation.num_clients,
                                                  cfg.federation.num_server_rounds,
                                                  cfg.federation.fraction_train)
    print_table(_rows(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def _rows(report: dict) -> list[tuple[str, ...]]:
    """The comparison table: fedpriv against the plain loop and the bare Flower app (the
    ratios also go into ``report``)."""
    fp, pl = report["fedpriv"], report["plain"]

    def col(key: str, fmt: str) -> list[str]:
        return [fmt.format(fp[key]), fmt.format(pl[key]) if pl else ""]

    def ratio(key: str) -> str:
        return f"{fp[key] / pl[key]:.2f}x" if pl else ""

    rows = [("", "fedpriv", "plain", "ratio"),
            ("total time (s)", *col("total-s", "{:.1f}"), ratio("total-s")),
            ("steady round, median (s)", *col("steady-round-s", "{:.3f}"),
             ratio("steady-round-s")),
            ("first round (s)", *col("first-round-s", "{:.2f}"), ""),
            ("fixed start-up + shutdown (s)", *col("fixed-s", "{:.1f}"), ""),
            ("peak memory, RSS sum", _gib(fp["peak-rss"]), _gib(pl["peak-rss"]) if pl else "",
             ratio("peak-rss") if fp["peak-rss"] else ""),
            ("peak memory, PSS sum", _gib(fp["peak-pss"]), _gib(pl["peak-pss"]) if pl else "",
             ratio("peak-pss") if fp["peak-pss"] else "")]
    if pl:
        worst = max(abs(a - b) for a, b in zip(fp["loss"], pl["loss"], strict=True))
        same = "bit-identical" if fp["loss"] == pl["loss"] else f"max |d loss| {worst:.1e}"
        rows.append(("final test accuracy", f"{fp['accuracy'][-1]:.4f}",
                     f"{pl['accuracy'][-1]:.4f}", same))
        report["ratios"] = {"total": fp["total-s"] / pl["total-s"],
                            "steady-round": fp["steady-round-s"] / pl["steady-round-s"]}
    else:
        rows.append(("final test accuracy", f"{fp['accuracy'][-1]:.4f}", "", ""))
    if "bare-flower" in report:
        bf = report["bare-flower"]
        rows.append(("bare Flower app, total (s)", f"{bf['total-s']:.1f}", "",
                     f"fedpriv fixed cost {fp['fixed-s'] - bf['total-s']:+.1f} s over it"))
    return rows


if __name__ == "__main__":
    main()
