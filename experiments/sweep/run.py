"""`fedpriv sweep`: every cell of a sweep file, on one SuperLink, compared in one table.

By default every cell runs inside one Flower simulation; ``--separate`` gives each its
own. A cell whose data check or run fails is recorded and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import ConfigError, RunConfig, parse_assignment, validate
from tasks.config.effect import idle_keys
from tasks.files import WriteFailed, explain, write_atomic
from tasks.progress import track
from tasks.results.folder import new_run_dir, read_run_info, run_identity
from tasks.results.ledger import outcome as run_outcome
from tasks.results.ledger import read_ledger

from ..configs import absolutize, refuse_idle
from ..preflight.isolated import Preflight, preflight_isolated, preflight_many
from ..runtime.app_bundle import app_dir
from ..runtime.choice import choose, likely_inprocess
from ..runtime.inprocess_link import InProcessLink
from ..runtime.procs import interruption
from ..runtime.runner import (
    GroundTruthPlot,
    LogFilter,
    RunOutcome,
    after_run,
    execute,
    federation_config,
    mark_unfinished,
    recorded_outcome,
)
from ..runtime.superlink import LocalSuperLink
from .spec import Cell, SweepSpec, load_sweep
from .table import REPORTED, print_table, write_table


@dataclass
class SweepRun:
    """A sweep's folder (None for a dry run) and its cells, as they ended; ``error``: why
    the sweep stopped before its end (its own files could not be written: a full disk)."""

    out: Path | None
    cells: list[Cell]
    keys: list[str] = field(default_factory=list)  # the keys that vary between cells
    error: WriteFailed | None = None

    @property
    def exit_code(self) -> int:
        """0 when every cell finished (or nothing ran), else 1."""
        return int(self.out is not None and (self.error is not None or any(
            c.status != "finished" for c in self.cells)))


# a write that fails for these stops the sweep: every later cell and file would fail too
_STOPS = (errno.ENOSPC, errno.EDQUOT)


def _stopping(exc: BaseException, out: Path) -> WriteFailed | None:
    """``exc`` as the one-paragraph write error that stops the sweep (a full disk), or
    None for any other error."""
    if not isinstance(exc, OSError) or exc.errno not in _STOPS:
        return None
    failed = exc if isinstance(exc, WriteFailed) else explain(Path(exc.filename or out), exc)
    kept = ("; every finished cell's run folder is kept under "
            f"{out / 'cells'}: free some space, then `fedpriv sweep --replot {out}` redraws "
            "the sweep's plots from them")
    stopped = WriteFailed(f"{failed}{kept}")
    stopped.errno = failed.errno
    return stopped


def run_sweep(name: str | Mapping[str, Any], overrides: Sequence[str] = (), *,
              values: Mapping[str, Any] | None = None, dry_run: bool = False,
              verbose: bool = False, separate: bool = False,
              repeat: int | None = None, at_once: int | None = None) -> SweepRun:
    """Run a sweep file (with --set ``overrides`` and typed ``values`` in every cell).

    By default every cell runs inside one Flower simulation (one SuperLink, one Ray
    start, warm clients; :func:`server.app.run_cells`); ``separate`` gives each cell a
    simulation of its own, as a fallback. ``repeat`` (or the file's ``seeds``) runs every
    cell once per seed. In-process, ``at_once`` cells run side by side in the one
    simulation (None: :func:`cells_at_once`'s default).
    """
    spec = load_sweep(name, overrides, values, repeat)
    cells = build_cells(spec, {**dict(parse_assignment(t) for t in overrides), **(values or {})})
    seeds = f" x {len(spec.seeds)} seeds" if spec.seeds else ""
    print(f"sweep {spec.name}: {len(cells)} runs ({len(cells) // max(len(spec.seeds), 1)} "
          f"cells{seeds}) over {', '.join(spec.keys) or 'nothing'}"
          + ("" if separate else ", in one simulation"))
    for c in cells:
        print(f"  {c.index:>3}. {c.label}")
    keys = spec.keys + (["seed"] if spec.seeds else [])
    if dry_run:
        return SweepRun(None, cells, keys)
    results_dir = cells[0].config.results.results_dir
    out = new_run_dir(Path(results_dir) / "sweeps", spec.name)
    t0 = time.perf_counter()
    stopped: WriteFailed | None = None
    try:
        (out / "plots").mkdir()
        text = json.dumps({"name": spec.name, "file": str(spec.path), "fixed": spec.base,
                           "grid": spec.grid, "cells": spec.extra, "seeds": spec.seeds,
                           "variants": spec.variants}, indent=2)
        write_atomic(out / "sweep.json", lambda f: f.write(text.encode()))
        with Runtimes(cells[0].config.resources.ray_address) as runtimes:
            if separate:
                _run_separately(runtimes, out, spec, cells, verbose)
            else:
                _run_together(runtimes, out, spec, cells, verbose, at_once)
    except OSError as exc:
        if (stopped := _stopping(exc, out)) is None:
            raise
    finally:
        late = _write_results(out, spec, cells)
        stopped = stopped or late
    failed = sum(c.status != "finished" for c in cells)
    print()
    print_table(out, spec, cells)
    if stopped is not None:
        print(f"\nsweep stopped after {time.perf_counter() - t0:.0f} s: {len(cells) - failed} "
              f"of {len(cells)} runs finished · {out}")
        print(f"fedpriv: error: {stopped}", file=sys.stderr)
        return SweepRun(out, cells, keys, stopped)
    print(f"\nsweep finished in {time.perf_counter() - t0:.0f} s: {len(cells) - failed} of "
          f"{len(cells)} runs finished · {out / 'sweep.md'}")
    return SweepRun(out, cells, keys)


def _write_results(out: Path, spec: SweepSpec, cells: list[Cell]) -> WriteFailed | None:
    """sweep.csv, sweep.md and the plots; the error that stops the sweep when they cannot
    be written (a full disk), which the finished cells' folders outlive."""
    from .plots import sweep_plots  # matplotlib and scipy: not before the cells start

    try:
        write_table(out, spec, cells)
        sweep_plots(out / "plots", spec.name, cells)
    except OSError as exc:
        if (stopped := _stopping(exc, out)) is None:
            raise
        return stopped
    return None


def build_cells(spec: SweepSpec, user: Mapping[str, Any]) -> list[Cell]:
    """The sweep's runs, each labelled by the keys of its cell that act in it (a grid
    may cross ``target-epsilon`` with ``dp = 'none'``: that cell is not labelled by it).
    A key the user set (``user``: --set, the API's values) that acts in no cell is
    refused, as ``fedpriv run`` refuses it."""
    cells: list[Cell] = []
    acts: set[str] = set()
    for params in spec.cells():
        for seed in spec.seeds or [None]:
            given = {**spec.base, **params, **({} if seed is None else {"seed": seed})}
            cfg = absolutize(validate(given))
            idle = idle_keys(given, cfg)
            acts |= {k for k in user if k not in idle}
            shown = {k: v for k, v in params.items() if k not in idle}
            cells.append(Cell(len(cells) + 1, shown, cfg, seed=seed))
    unused = {k: user[k] for k in user if k not in acts}
    if unused and cells:
        refuse_idle(unused, cells[0].config)
    return cells


class Runtimes:
    """The runtimes a sweep's cells run on (:mod:`experiments.runtime.choice`), each started
    once, when a cell first needs it, and all stopped together."""

    def __init__(self, ray_address: str) -> None:
        self.ray_address = ray_address
        self.stack = contextlib.ExitStack()
        self.links: dict[str, InProcessLink | LocalSuperLink] = {}

    def __enter__(self) -> Runtimes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def link(self, name: str) -> InProcessLink | LocalSuperLink:
        if name not in self.links:
            self.links[name] = self.stack.enter_context(
                InProcessLink() if name == "inprocess" else LocalSuperLink(ray=self.ray_address))
        return self.links[name]


def _runtime(c: Cell, pre: Preflight) -> str | None:
    """The runtime that serves the cell, or None with the cell marked invalid."""
    try:
        return choose(c.config, cuda=pre.cuda).name
    except ConfigError as exc:
        return _checked(c, exc)


def _checked(c: Cell, pre: Preflight | Exception) -> Preflight | None:
    """The cell's pre-flight result, or None with the cell marked invalid or crashed."""
    if isinstance(pre, ConfigError):
        c.status, c.error = "invalid", str(pre)
        print(f"  cell {c.index} skipped: {pre}")
    elif isinstance(pre, Exception):
        c.status, c.error = "crashed", f"pre-flight check: {pre}"
        print(f"  cell {c.index} crashed: {pre}")
    else:
        return pre
    return None


def _record(c: Cell, res: RunOutcome) -> None:
    c.status, c.error = res.status, res.error
    ledger = read_ledger(c.run_dir)
    c.result = {**run_outcome(ledger), "rounds": len(ledger), "wall-s": res.wall_s,
                "target-reached-round": res.info.get("target-reached-round", ""),
                "privacy": res.info.get("privacy", {}),
                **{k: res.info.get(k) for k in REPORTED}}
    if not res.ok:
        print(f"  cell {c.index} {res.status}: {res.error}")


def _run_separately(runtimes: Runtimes, out: Path, spec: SweepSpec, cells: list[Cell],
                    verbose: bool) -> None:
    """The fallback: one simulation per cell (Ray's on the same SuperLink)."""
    app = app_dir()
    for c in track(cells, "sweep: cells done"):
        print(f"\n[{c.index}/{len(cells)}] {c.label}", flush=True)
        try:
            pre = _checked(c, preflight_isolated(c.config))
        except (ConfigError, RuntimeError) as exc:
            pre = _checked(c, exc)
        if pre is None or (runtime := _runtime(c, pre)) is None:
            continue
        link = runtimes.link(runtime)
        c.run_dir = out / "cells" / c.folder
        c.run_dir.mkdir(parents=True)
        try:
            res = execute(link, app, c.config, c.run_dir, cuda=pre.cuda, verbose=verbose,
                          label_counts=pre.label_counts)
        except KeyboardInterrupt as exc:
            c.status, c.error = "interrupted", interruption(exc)
            raise
        except Exception as exc:
            c.status, c.error = "crashed", f"{type(exc).__name__}: {exc}"
            print(f"  cell {c.index} crashed: {c.error}")
            continue
        _record(c, res)
        write_table(out, spec, cells)


def engine_key(cfg: RunConfig, runtime: str) -> tuple[Any, ...]:
    """What must be equal for cells to share one simulation: the runtime and the clients'
    resources."""
    r = cfg.resources
    return (runtime, r.client_cpus, r.client_gpus, r.device, r.train_together)


def cells_at_once(runtime: str, requested: int | None) -> int:
    """How many cells run side by side in one simulation: in-process, ``requested`` or,
    by default, 2 where there are 2 cores or more (one cell's evaluation, aggregation and
    plots overlap the other's training; :mod:`server.cells`); on Ray, one at a time
    (Flower's runtime keeps one Context per node for every cell)."""
    if runtime != "inprocess":
        return 1
    if requested is not None:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    return 2 if cores >= 2 else 1


def _run_together(runtimes: Runtimes, out: Path, spec: SweepSpec, cells: list[Cell],
                  verbose: bool, at_once: int | None = None) -> None:
    """Every cell inside one simulation (one per distinct client resources): the
    ServerApp runs them on the largest cell's federation, in turn or side by side
    (:func:`cells_at_once`)."""
    print("\nchecking every cell (data, model, partitions, privacy)...", flush=True)
    likely = [c.config for c in cells if likely_inprocess(c.config)]
    env, checker = None, None
    if likely:  # it imports torch, the apps and what the cells need, then checks them
        link = runtimes.link("inprocess").start(likely)
        env, checker = link.memo_env(), link.checker()  # the checks' noise calibrations
    checks = preflight_many([c.config for c in cells], env, checker)  # stay for the runtime
    ready = {c.index: pre for c, raw in zip(cells, checks, strict=True)
             if (pre := _checked(c, raw)) is not None}
    groups: dict[tuple[Any, ...], list[Cell]] = {}
    for c in cells:
        if c.index in ready and (runtime := _runtime(c, ready[c.index])) is not None:
            groups.setdefault(engine_key(c.config, runtime), []).append(c)
    app = app_dir()
    for g, (key, group) in enumerate(groups.items(), 1):
        link = runtimes.link(key[0])
        for c in group:
            c.run_dir = out / "cells" / c.folder
            c.run_dir.mkdir(parents=True)
            link.watch_run(c.run_dir)
        plan = out / f"cells-{g}.json"
        side_by_side = min(cells_at_once(key[0], at_once), len(group))
        plan.write_text(json.dumps({"at-once": side_by_side, "cells": [
            {"index": c.index, "label": c.label,
             "config": {**c.config.flat(), "run-dir": str(c.run_dir),
                        "run-id": run_identity(c.run_dir, c.config.results)}}
            for c in group]},
            indent=1))
        host = max(group, key=lambda c: c.config.federation.num_clients)
        cuda = any(ready[c.index].cuda for c in group)
        where = "in-process" if key[0] == "inprocess" else "on Flower's simulation runtime (Ray)"
        beside = f", {side_by_side} at a time" if side_by_side > 1 else ""
        print(f"\nrunning {len(group)} run(s) {where} on "
              f"{host.config.federation.num_clients} clients{beside}...", flush=True)
        log = LogFilter(out / "flwr.log", verbose, print)
        t0 = time.perf_counter()
        labels = {c.index: GroundTruthPlot(c.config, ready[c.index].label_counts)
                  for c in group if ready[c.index].label_counts}  # drawn meanwhile
        try:
            link.submit(app, {**host.config.flat(), "run-dir": "",
                              "sweep-cells": str(plan)},
                        federation_config(host.config, cuda), log)
        except KeyboardInterrupt as exc:
            for c in group:
                if read_run_info(c.run_dir).get("status", "running") == "running":
                    c.status, c.error = "interrupted", interruption(exc)
                    mark_unfinished(c.run_dir, c.status, c.error)
            raise
        finally:
            log.close()
        wall = time.perf_counter() - t0
        try:
            for c in group:
                status, error = recorded_outcome(c.run_dir, out / "flwr.log", link.died())
                mark_unfinished(c.run_dir, status, error)
                res = after_run(c.config, c.run_dir, status, error,
                                float(read_run_info(c.run_dir).get("wall-s",
                                                                   wall / len(group))),
                                print, labels.get(c.index))
                _record(c, res)
        finally:
            for drawing in labels.values():
                drawing.close()
        write_table(out, spec, cells)


