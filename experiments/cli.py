"""The `fedpriv` command line: run a configuration, run a sweep, list keys and presets."""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
import time

from tasks.config import SCHEMA, ConfigError

from .configs import PRESETS, SWEEPS

EXIT_BAD_INPUT = 2


def keys_reference(width: int = 100) -> str:
    """Every run-config key with its default, allowed values and meaning, grouped."""
    lines, group = [], None
    for key in SCHEMA:
        if key.group != group:
            group = key.group
            lines.append(f"\n{group}:")
        default = key.default
        shown = ('""' if default == "" else f'"{default}"') if isinstance(default, str) else (
            str(default).lower() if isinstance(default, bool) else default)
        lines.append(f"  {key.name} = {shown}    [{key.describe_allowed()}]")
        lines += textwrap.wrap(key.help, width=width, initial_indent="      ",
                               subsequent_indent="      ")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="fedpriv",
        description="Federated-learning simulator for privacy research (Flower + Ray).")
    sub = top.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run one configuration in Flower's simulation runtime",
        description="Run one federated configuration: defaults <- --config preset <- --set "
                    "overrides. Results go to a new folder under results-dir.",
        epilog="run-config keys (use with --set key=value; text values may be bare or "
               "quoted):" + keys_reference())
    run.add_argument("--config", metavar="PRESET",
                     help=f"a preset TOML file, or the name of one in {PRESETS}")
    run.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                     help="override one key (repeatable), e.g. --set num-clients=20")
    run.add_argument("--name", help="name for the results folder (default: dataset-strategy-"
                                    "partitioner)")
    run.add_argument("--verbose", action="store_true",
                     help="show Flower's and Ray's full log on the terminal")

    sweep = sub.add_parser(
        "sweep", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run a grid of configurations and compare them",
        description="Run every combination of a sweep file's [grid] on one SuperLink, "
                    "continuing past failed cells; write sweep.csv, sweep.md and comparison "
                    "plots.",
        epilog=textwrap.dedent("""\
            sweep file:
              preset = "mnist"          # optional base preset
              [fixed]                   # keys applied to every cell
              num-server-rounds = 5
              [grid]                    # every combination is one cell
              num-clients = [5, 10]
              partitioner = ["iid", "shard"]
            """))
    sweep.add_argument("file", help=f"a sweep TOML file, or the name of one in {SWEEPS}")
    sweep.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                       help="override a key in every cell")
    sweep.add_argument("--dry-run", action="store_true", help="list the cells and stop")
    sweep.add_argument("--verbose", action="store_true", help="show Flower's full log")

    sub.add_parser("keys", help="print every run-config key with default and allowed values")
    sub.add_parser("presets", help="list the bundled presets and sweeps")
    return top


def _cmd_run(args: argparse.Namespace) -> int:
    from server.results import default_run_name, new_run_dir

    from .app_bundle import app_dir
    from .configs import resolve
    from .preflight import absolutize, preflight
    from .runner import execute
    from .superlink import LocalSuperLink

    t0 = time.perf_counter()
    cfg = absolutize(resolve(args.config, args.set))
    print(f"fedpriv run · {cfg['dataset']} · {cfg['num-clients']} clients ({cfg['partitioner']})"
          f" · {cfg['strategy']} · {cfg['num-server-rounds']} rounds · seed {cfg['seed']}")
    pre = preflight(cfg)
    print(f"checked: {pre.dataset}; model {pre.model} ({pre.parameters:,} parameters); client "
          f"sizes {min(pre.sizes)}–{max(pre.sizes)}")
    run_dir = new_run_dir(cfg["results-dir"], args.name or default_run_name(cfg))
    app = app_dir()
    print("starting Flower SuperLink (simulation runtime, Ray backend)...", flush=True)
    with LocalSuperLink() as link:
        print(f"SuperLink up on 127.0.0.1:{link.port} in {link.started_s:.1f} s; starting "
              f"{cfg['num-clients']} simulated clients...", flush=True)
        outcome = execute(link, app, cfg, run_dir, verbose=args.verbose)
    total = time.perf_counter() - t0
    if outcome.ok:
        print(f"finished in {total:.1f} s · results: {run_dir}")
        print("  summary.md, metrics.jsonl, config.toml, partitions.json, model.pt, "
              "plots/{accuracy,loss,label_distribution}.png")
        return 0
    print(f"run {outcome.status}: {outcome.error}\n  partial results and the full log "
          f"(flwr.log) are in {run_dir}", file=sys.stderr)
    return 1


def _cmd_presets() -> int:
    from .configs import read_toml

    for folder, kind in ((PRESETS, "presets"), (SWEEPS, "sweeps")):
        print(f"{kind} ({folder}):")
        for path in sorted(folder.glob("*.toml")):
            first = path.read_text().splitlines()[0] if path.read_text() else ""
            note = first.lstrip("# ").strip() if first.startswith("#") else ""
            read_toml(path)
            print(f"  {path.stem:<28} {note}")
    return 0


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fedpriv` console script."""
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)  # run the same cleanup as Ctrl-C
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "sweep":
            from .sweep import run_sweep

            return run_sweep(args.file, args.set, dry_run=args.dry_run, verbose=args.verbose)
        if args.command == "keys":
            print(keys_reference().lstrip("\n"))
            return 0
        if args.command == "presets":
            return _cmd_presets()
    except ConfigError as exc:
        print(f"fedpriv: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\nfedpriv: interrupted; every process fedpriv started has been stopped.",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
