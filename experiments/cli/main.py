"""The `fedpriv` command line: run a configuration, run a sweep, attack a run's
observations, test a configuration's DP claim (dp-test), deploy across hosts, list keys
and presets.

Each command imports what it needs when it runs, so --help and bad input stay fast (no
torch, no Flower: tests/test_layers.py checks it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from privacy.attacks.registry import ATTACKS
from tasks.config import ConfigError, defaults, to_toml, validate
from tasks.files import WriteFailed

from . import deploy
from .keys import config_markdown, keys_reference
from .parser import build_parser

EXIT_BAD_INPUT = 2


def _cmd_run(args: argparse.Namespace) -> int:
    # Each command imports what it needs, so --help and bad input stay fast.
    from ..api import resume, run_config
    from ..configs import resolve

    t0 = time.perf_counter()
    if args.preset is not None and args.config is not None:
        raise ConfigError(f"the preset is given twice ({args.preset!r} and --config "
                          f"{args.config!r}); give it once, e.g. fedpriv run {args.config}.")
    args.config = args.config if args.preset is None else args.preset
    if args.resume is not None:
        others = [flag for flag, given in (("--config", args.config), ("--set", args.set),
                                           ("--name", args.name),
                                           ("--supernodes", args.supernodes)) if given]
        if others:
            raise ConfigError(
                f"--resume continues a run with the config it started with, so "
                f"{', '.join(others)} cannot be combined with it. Drop "
                f"{'them' if len(others) > 1 else 'it'}, or start a new run instead.")
        result = resume(args.resume, verbose=args.verbose)
    else:
        result = run_config(resolve(args.config, args.set), name=args.name,
                            supernodes=args.supernodes, verbose=args.verbose)
    if result.ok:
        # the folder was named when the run started ("results: ..."), once
        print(f"finished in {time.perf_counter() - t0:.1f} s; the results folder holds:")
        print(f"  {list_results(result.run_dir)}")
        return 0
    print(f"run {result.status}: {result.error}\n  partial results and the full log "
          f"(flwr.log) are in {result.run_dir}", file=sys.stderr)
    refused = "ResumeError" in (result.error or "")  # --resume again would be refused too
    if (result.run_dir / "checkpoint" / "server.npz").is_file() and not refused:
        print(f"  continue from its last finished round with: fedpriv run --resume "
              f"{result.run_dir}", file=sys.stderr)
    return 1


def list_results(run_dir: Path) -> str:
    """The files a run wrote, as one line (what is there, not what might be)."""
    files = sorted(p.name for p in run_dir.iterdir() if p.is_file() and p.name != "flwr.log")
    plots = sorted(p.stem for p in (run_dir / "plots").glob("*.png"))
    both = plots and all((run_dir / "plots" / f"{p}.pdf").is_file() for p in plots)
    kinds = "{png,pdf}" if both else "png"
    return ", ".join(files + ([f"plots/{{{','.join(plots)}}}.{kinds}"] if plots else []))


def _cmd_presets() -> int:
    """List the bundled presets and sweeps, checking each (exit 2 if one is invalid)."""
    from .. import configs
    from ..sweep.spec import load_sweep

    bad = 0
    for folder, kind in ((configs.PRESETS, "presets"), (configs.SWEEPS, "sweeps")):
        print(f"{kind} ({folder}):")
        for path in sorted(folder.glob("*.toml")):
            first = path.read_text().splitlines()[0] if path.read_text() else ""
            note = first.lstrip("# ").strip() if first.startswith("#") else ""
            try:
                if kind == "presets":
                    validate(configs.read_preset(str(path)))
                else:
                    load_sweep(str(path))
            except ConfigError as exc:
                bad += 1
                note = f"INVALID: {str(exc).splitlines()[-1].strip()}"
            print(f"  {path.stem:<28} {note}")
    return EXIT_BAD_INPUT if bad else 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    if args.replot:
        from ..sweep.replot import replot

        replot(Path(args.file))
        return 0
    from ..sweep.run import run_sweep

    return run_sweep(args.file, args.set, dry_run=args.dry_run, verbose=args.verbose,
                     separate=args.separate, repeat=args.repeat,
                     at_once=args.cells_at_once).exit_code


def _cmd_attack(args: argparse.Namespace) -> int:
    from ..leakage.attack import run_attacks

    names = [a.strip() for text in args.attack for a in text.split(",") if a.strip()]
    if args.attack and not names:
        raise ConfigError(f"--attack was given but names no attack; choose from "
                          f"{', '.join(ATTACKS.names)}, or leave --attack out to run the "
                          "run's own attacks key.")
    run_attacks(args.run_dir, names or None, args.set, args.round, args.client, echo=print)
    return 0


def _cmd_dp_test(args: argparse.Namespace) -> int:
    """`fedpriv dp-test`: the neighbouring-datasets test of the configuration's DP claim."""
    import json

    from ..configs import resolve
    from ..neighbour_mechanisms import mechanism_for, test_config

    if args.preset is not None and args.config is not None:
        raise ConfigError(f"the preset is given twice ({args.preset!r} and --config "
                          f"{args.config!r}); give it once.")
    if args.runs < 4:
        raise ConfigError(f"--runs {args.runs}: the test needs at least 4 runs a side (half "
                          "choose each statistic's threshold, half score it); 200 is usual.")
    if not 0 < args.confidence < 1:
        raise ConfigError(f"--confidence {args.confidence} must be between 0 and 1, e.g. 0.95.")
    cfg = resolve(args.preset if args.preset is not None else args.config, args.set)
    name = mechanism_for(cfg, args.mechanism)  # refuses a configuration without a claim
    print(f"dp-test: mechanism {name!r}, {args.runs} runs on D and on D' ...")
    from tasks.progress import Bar

    with Bar("dp-test runs (a side)", args.runs) as bar:
        report = test_config(cfg, mechanism=name, runs=args.runs, records=args.records,
                             confidence=args.confidence, seed=args.seed,
                             progress=lambda done, total: bar.advance())
    print(report.table())
    print()
    print(report.describe())
    if args.json is not None:
        from tasks.files import explain

        claim = report.claim
        text = json.dumps(
            {"mechanism": report.mechanism, "neighbours": report.neighbours,
             "runs": report.runs, "confidence": report.confidence, "delta": report.delta,
             "epsilon-lower-bound": report.epsilon, "best": report.best.name,
             "claim": None if claim is None else {"epsilon": claim.epsilon,
                                                  "delta": claim.delta,
                                                  "relation": claim.relation},
             "passed": report.passed, "statistics": report.rows(),
             "verdict": report.describe()}, indent=2) + "\n"
        try:
            args.json.write_text(text)
        except OSError as exc:  # said in a sentence (main), after the report was printed
            raise explain(args.json, exc) from None
    return 0 if report.passed is not False else 1


def _cmd_keys(args: argparse.Namespace) -> int:
    if args.toml:
        print(to_toml(defaults()), end="")
    elif args.markdown:
        print(config_markdown(), end="")
    else:
        print(keys_reference().lstrip("\n"))
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    """The runs under a results folder, one line each (oldest first)."""
    from ..past_runs import past_runs, runs_table

    root = Path(args.results_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder. Give the results folder your runs went to "
                          "(results-dir; default: results, under the folder you ran in).")
    if args.last < 0:
        raise ConfigError(f"--last {args.last}: give a number of runs >= 1, or leave it out "
                          "for all of them.")
    found = past_runs(root)
    shown = found[-args.last:] if args.last else found
    if not found:
        print(f"no runs under {root}")
        return 0
    print("\n".join(runs_table(shown, root)))
    print(f"{len(shown)} of {len(found)} run(s) under {root}; epsilon: local DP the largest "
          "over clients, central DP client-level")
    return 0


COMMANDS = {"run": _cmd_run, "sweep": _cmd_sweep, "attack": _cmd_attack, "deploy": deploy.run,
            "dp-test": _cmd_dp_test, "keys": _cmd_keys, "presets": lambda args: _cmd_presets(),
            "runs": _cmd_runs}


def _terminate(signum: int, frame: object) -> None:
    from ..runtime.procs import Terminated

    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fedpriv` console script."""
    # A plugin (run-config key plugins) in the current folder is found as with `python -m`:
    # first (Opacus, for one, installs a package named `examples`).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = build_parser().parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress shows up at once, even in a pipe
    from tasks.progress import relay_to_children

    from ..runtime.procs import PipeGuard

    sys.stdout = PipeGuard(sys.stdout)  # a closed pipe stops a run as Ctrl-C does
    relay_to_children()  # on a terminal, the apps' progress bars are drawn here
    signal.signal(signal.SIGTERM, _terminate)  # run the same cleanup as Ctrl-C
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"fedpriv: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except WriteFailed as exc:  # a full disk or a read-only folder: said, not a traceback
        print(f"fedpriv: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        from ..runtime.procs import OutputClosed, Terminated, interruption

        if isinstance(exc, OutputClosed):  # e.g. `fedpriv keys | head`: nothing was cut
            if args.command in ("run", "sweep"):
                print(f"fedpriv: {interruption(exc)}; every process fedpriv started has "
                      "been stopped.", file=sys.stderr)
                return 141
            return 0
        term = isinstance(exc, Terminated)
        print(f"\nfedpriv: {'stopped by SIGTERM' if term else 'interrupted'}; every process "
              "fedpriv started has been stopped.", file=sys.stderr)
        run_dir = getattr(exc, "run_dir", None)
        if run_dir is not None and (run_dir / "checkpoint" / "server.npz").is_file():
            print(f"  its rounds so far are in {run_dir} (summary.md, plots/); continue it "
                  f"with: fedpriv run --resume {run_dir}", file=sys.stderr)
        return 143 if term else 130
    except BrokenPipeError:  # e.g. `fedpriv keys | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
