"""The ``fedpriv`` argument parser: one function per subcommand (``fedpriv deploy``'s are in
:mod:`experiments.cli.deploy`)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from privacy.attacks.registry import ATTACKS
from tasks.version import describe

from .. import configs
from . import deploy
from .keys import keys_reference


def build_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="fedpriv",
        description="Federated-learning simulator for privacy research, on Flower (its "
                    "in-process runtime by default, Ray or real SuperNodes on request).")
    top.add_argument("--version", action="version", version=describe())
    sub = top.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_sweep(sub)
    _add_attack(sub)
    _add_dp_test(sub)
    deploy.add_parser(sub)
    keys = sub.add_parser("keys", help="print every run-config key with default and allowed "
                                       "values")
    keys.add_argument("--markdown", action="store_true", help="as docs/CONFIG.md")
    keys.add_argument("--toml", action="store_true",
                      help="the defaults as TOML, for pyproject.toml's [tool.flwr.app.config]")
    sub.add_parser("presets", help="list the bundled presets and sweeps")
    runs = sub.add_parser("runs", help="list past runs (sweep cells included) with their "
                                       "status, final accuracy and epsilon")
    runs.add_argument("results_dir", nargs="?", default="results", metavar="RESULTS_DIR",
                      help="the results folder to list (default: results)")
    runs.add_argument("--last", type=int, default=0, metavar="N",
                      help="only the N most recently started")
    return top


def _add_run(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run one configuration in Flower's simulation runtime",
        description="Run one federated configuration: defaults <- --config preset <- --set "
                    "overrides. Results go to a new folder under results-dir.",
        epilog="run-config keys (use with --set key=value; text values may be bare or "
               "quoted):" + keys_reference())
    run.add_argument("preset", nargs="?", metavar="PRESET",
                     help=f"a preset TOML file, or the name of one in {configs.PRESETS} "
                          "(`fedpriv run mnist`; the same as --config)")
    run.add_argument("--config", metavar="PRESET", help="the preset, as an option")
    run.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                     help="override one key (repeatable), e.g. --set num-clients=20")
    run.add_argument("--name", help="name for the results folder (default: dataset-strategy-"
                                    "partitioner)")
    run.add_argument("--verbose", action="store_true",
                     help="show Flower's and Ray's full log on the terminal")
    run.add_argument("--resume", metavar="RUN_FOLDER", type=Path,
                     help="continue a crashed, interrupted or failed run from its last "
                          "checkpointed round, in its own folder with its own config (no "
                          "--config/--set/--name/--supernodes then)")
    run.add_argument("--supernodes", action="store_true",
                     help="run on a real SuperLink and num-clients real SuperNodes on this "
                          "machine (loopback, deployment runtime) instead of the simulation "
                          "runtime; slower per round, same apps as across hosts")


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    sweep = sub.add_parser(
        "sweep", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run a grid of configurations and compare them",
        description="Run every combination of a sweep file's [grid] (and [[cells]]), each "
                    "once per seed, inside one Flower simulation, continuing past failed "
                    "cells; write sweep.csv, sweep.md and comparison plots.",
        epilog=textwrap.dedent("""\
            sweep file:
              preset = "mnist"          # optional base preset
              seeds = [1, 2, 3]         # optional: every cell once per seed
              [fixed]                   # keys applied to every cell
              num-server-rounds = 5
              [grid]                    # every combination is one cell
              num-clients = [5, 10]
              partitioner = ["iid", "shard"]
            """))
    sweep.add_argument("file", help=f"a sweep TOML file, or the name of one in "
                                    f"{configs.SWEEPS} (with --replot: a finished sweep's "
                                    "folder)")
    sweep.add_argument("--replot", action="store_true",
                       help="redraw the comparison plots of a finished sweep folder")
    sweep.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                       help="override a key in every cell")
    sweep.add_argument("--dry-run", action="store_true", help="list the cells and stop")
    sweep.add_argument("--repeat", type=int, metavar="N",
                       help="run every cell with N seeds (the run seed, seed+1, ...); the "
                            "table shows mean and 95%% interval (or give seeds = [...] in the "
                            "file)")
    sweep.add_argument("--separate", action="store_true",
                       help="give each cell a simulation of its own (slower: Flower and Ray "
                            "start once per cell) instead of running all cells in one")
    sweep.add_argument("--cells-at-once", type=_cells_at_once, metavar="N",
                       help="in-process, run up to N cells side by side on the shared "
                            "client workers (default: 2 on 2 cores or more; 1: one after "
                            "another); cells with secure aggregation, anonymizers, the "
                            "leakage study, memorization or tracking run alone")
    sweep.add_argument("--verbose", action="store_true", help="show Flower's full log")


def _cells_at_once(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of cells from 1 to 64: give e.g. --cells-at-once 1 "
            "to run the cells one after another, or leave it out for the default")
    return n


def _add_attack(sub: argparse._SubParsersAction) -> None:
    attack = sub.add_parser(
        "attack", help="run the leakage attacks on a finished run's observations",
        description="Attack what the server observed in a finished run (its observations/ "
                    "folder, kept for the rounds and clients leakage-rounds and "
                    "leakage-clients named) and score the attacks against the clients' real "
                    "data. Writes leakage.jsonl, leakage.json, plots/leakage/ and a 'What "
                    "leaked' section in summary.md; the same seed gives the same numbers.")
    attack.add_argument("run_dir", type=Path, metavar="RUN_FOLDER")
    attack.add_argument("--attack", metavar="NAME", action="append", default=[],
                        help="attack to run (repeatable or comma-separated): "
                             f"{', '.join(ATTACKS.names)} (default: the run's attacks key)")
    attack.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="change an attack setting, e.g. --set invert-iterations=500 "
                             "(only the leakage keys; the rest are facts of the run)")
    attack.add_argument("--round", type=int, action="append", metavar="R",
                        help="only this observed round (repeatable)")
    attack.add_argument("--client", type=int, action="append", metavar="C",
                        help="only this observed client's partition id (repeatable)")


def _add_dp_test(sub: argparse._SubParsersAction) -> None:
    from ..neighbour_mechanisms import MECHANISMS

    mechanisms = "; ".join(f"{name}: {info.help}" for name, info in MECHANISMS.items())
    test = sub.add_parser(
        "dp-test", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="test a configuration's DP claim on neighbouring datasets (black box)",
        description="Run the configuration's DP mechanism, as the product runs it, many "
                    "times on a dataset D and on a neighbour D', and bound its epsilon from "
                    "below with 95% confidence from how well simple statistics of the "
                    "outputs tell D from D' (docs/DP_TESTER.md). PASS (exit 0) when the bound "
                    "stays under the epsilon the configuration claims, FAIL (exit 1) when it "
                    "refutes it. A configuration without DP has no claim and is refused.",
        epilog=textwrap.dedent("""\
            example (local DP-SGD, 50 vs 51 real MNIST records, one local epoch):
              fedpriv dp-test --set dp=local --set noise-multiplier=4 --set batch-size=5 \\
                  --set model=linear --set delta=1e-5 --runs 200 --records 50
            """))
    test.add_argument("preset", nargs="?", metavar="PRESET",
                      help=f"a preset TOML file, or the name of one in {configs.PRESETS}")
    test.add_argument("--config", metavar="PRESET", help="the preset, as an option")
    test.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                      help="override one run-config key (repeatable), as for fedpriv run")
    test.add_argument("--mechanism", metavar="NAME",
                      help=f"which mechanism to test (default: the one the configuration "
                           f"claims DP for): {mechanisms}")
    test.add_argument("--runs", type=int, default=200, metavar="N",
                      help="runs on each of D and D' (default 200; half choose the tests, "
                           "half score them)")
    test.add_argument("--records", type=int, metavar="N",
                      help="records in D (default 50; D' has one more, or one replaced). "
                           "DP-FedAvg's D' is the num-clients clients and D one fewer: set "
                           "num-clients rather than this")
    test.add_argument("--confidence", type=float, default=0.95,
                      help="confidence of the lower bound (default 0.95)")
    test.add_argument("--seed", type=int, default=0,
                      help="first run's seed (D's run i has seed + 2i, D''s seed + 2i + 1)")
    test.add_argument("--json", type=Path, metavar="FILE",
                      help="also write the report (every statistic, claim, verdict) as JSON")
