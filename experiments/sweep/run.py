"""`fedpriv sweep`: every combination of a grid, on one SuperLink, compared in one table.

A sweep file names an optional base ``preset``, ``[fixed]`` keys for every cell and
a ``[grid]`` of lists. Every cell is checked against the schema before anything
starts; a cell whose data check or run fails is recorded and the sweep goes on.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.ledger import outcome as run_outcome
from server.ledger import read_ledger
from server.privacy_log import headline_epsilon
from server.results import new_run_dir, read_run_info, run_identity
from tasks.config import ConfigError, RunConfig, parse_assignment, validate, validate_partial
from tasks.files import damaged, read_text

from ..configs import SWEEPS, absolutize, find_file, read_preset, read_toml
from ..leakage.sweep import sweep_rows, write_leakage_table
from ..preflight.isolated import Preflight, preflight_isolated, preflight_many
from ..runtime.app_bundle import app_dir
from ..runtime.procs import interruption
from ..runtime.runner import (
    LogFilter,
    RunOutcome,
    after_run,
    execute,
    federation_config,
    mark_unfinished,
    recorded_outcome,
)
from ..runtime.superlink import LocalSuperLink
from .plots import sweep_plots
from .stats import fmt_ci

# run.json entries a sweep's table reads besides the ledger's outcome and the privacy
REPORTED = ("anonymization", "aggregation", "model-selection", "robustness")
MAX_CELLS = 10_000  # a sweep is run cell by cell: beyond this it is a typo, not a plan


@dataclass
class SweepSpec:
    name: str
    path: Path
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    extra: list[dict[str, Any]] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # empty: each cell once, its own seed
    variants: list[dict[str, Any]] = field(default_factory=list)  # crossed with the grid

    def cells(self) -> list[dict[str, Any]]:
        """Every combination of the grid (each once per [[variants]] table, when there are
        any), then the explicitly listed [[cells]]."""
        keys = list(self.grid)
        combos = itertools.product(*self.grid.values()) if keys else iter(((),))
        crossed = [{**dict(zip(keys, combo, strict=True)), **variant}
                   for combo in combos for variant in (self.variants or [{}])]
        crossed = [c for c in crossed if c] if (keys or self.variants) else []
        return crossed + [dict(c) for c in self.extra]

    @property
    def keys(self) -> list[str]:
        """The keys that vary between cells, for table columns."""
        out = list(self.grid)
        for cell in [*self.variants, *self.extra]:
            out += [k for k in cell if k not in out]
        return out


@dataclass
class Cell:
    index: int
    params: dict[str, Any]
    config: RunConfig | None
    status: str = "pending"
    error: str | None = None
    run_dir: Path | None = None
    result: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None  # set when the sweep repeats every cell over seeds

    @property
    def group(self) -> str:
        """The cell without its seed: the runs a table row's mean and interval are over."""
        return ", ".join(f"{k}={v}" for k, v in self.params.items()) or "base"

    @property
    def label(self) -> str:
        return self.group if self.seed is None else f"{self.group}, seed={self.seed}"


def _seeds(path: Path, raw: Mapping[str, Any], base: Mapping[str, Any],
           repeat: int | None) -> list[int]:
    """The sweep's seeds: its ``seeds = [...]``, or ``repeat`` seeds from the run seed on."""
    seeds = raw.get("seeds")
    if seeds is not None and repeat:
        raise ConfigError(f"sweep {path} lists seeds = {seeds} and --repeat {repeat} was given; "
                          "use one of them.")
    if repeat is not None:
        if not isinstance(repeat, int) or not 1 <= repeat <= 1000:
            raise ConfigError(f"--repeat {repeat!r}: give a whole number of seeds from 1 to "
                              "1000, e.g. --repeat 3.")
        first = int(validate_partial({"seed": base.get("seed", 42)})["seed"])
        return [first + k for k in range(repeat)] if repeat > 1 else []
    if seeds is None:
        return []
    if (not isinstance(seeds, list) or not seeds or len(set(map(str, seeds))) != len(seeds)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)):
        raise ConfigError(f"sweep {path}: seeds must be a list of distinct whole numbers, e.g. "
                          f"seeds = [1, 2, 3]; got {seeds!r}.")
    validate_partial({"seed": max(seeds)})
    validate_partial({"seed": min(seeds)})
    return list(seeds)


def load_sweep(name: str, overrides: Sequence[str] = (),
               values: Mapping[str, Any] | None = None, repeat: int | None = None
               ) -> SweepSpec:
    """Read and check a sweep file (schema errors in any cell stop the sweep before it
    starts); ``repeat`` runs every cell with that many seeds."""
    path = find_file(name, SWEEPS, "sweep")
    raw = read_toml(path)
    unknown = set(raw) - {"name", "preset", "fixed", "grid", "cells", "variants", "seeds"}
    if unknown:
        raise ConfigError(f"sweep {path}: unknown top-level entries {sorted(unknown)}; allowed: "
                          "name, preset, seeds, [fixed], [grid], [[variants]], [[cells]].")
    for section, kind in (("fixed", dict), ("grid", dict), ("cells", list), ("variants", list)):
        if section in raw and not isinstance(raw[section], kind):
            example = {"fixed": "[fixed] with num-server-rounds = 5",
                       "grid": "[grid] with num-clients = [5, 10]",
                       "cells": "[[cells]] tables, each with keys",
                       "variants": "[[variants]] tables, each crossed with the grid"}[section]
            raise ConfigError(f"sweep {path}: {section} must be a "
                              f"{'table' if kind is dict else 'list of tables'}, got "
                              f"{type(raw[section]).__name__} {raw[section]!r}; e.g. {example}.")
    grid = raw.get("grid", {})
    extra = raw.get("cells", [])
    if not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError(f"sweep {path}: [grid] must map keys to non-empty lists, e.g. "
                          "num-clients = [5, 10].")
    variants = raw.get("variants", [])
    for name, tables in (("cells", extra), ("variants", variants)):
        if not all(isinstance(c, dict) and c for c in tables):
            raise ConfigError(f"sweep {path}: [[{name}]] entries must be tables of keys.")
    if not grid and not extra and not variants:
        raise ConfigError(f"sweep {path}: give a [grid] of lists and/or [[cells]] tables.")
    size = (math.prod(len(v) for v in grid.values()) if grid else 1 if variants else 0) \
        * max(len(variants), 1)
    if size + len(extra) > MAX_CELLS:
        raise ConfigError(f"sweep {path} has {size + len(extra):,} cells (the [grid] alone "
                          f"{' x '.join(str(len(v)) for v in grid.values())}); at most "
                          f"{MAX_CELLS:,} are allowed. Split it into several sweeps.")
    base: dict[str, Any] = {}
    if "preset" in raw:
        base.update(read_preset(str(raw["preset"])))
    try:  # every fixed value must be valid, even one the grid overrides in every cell
        base.update(validate_partial(raw.get("fixed", {})))
    except ConfigError as exc:
        raise ConfigError(f"sweep {path}, [fixed]: {exc}") from None
    for text in overrides:
        key, value = parse_assignment(text)
        base[key] = value
    base.update(values or {})  # typed overrides (the Python API's)
    spec = SweepSpec(str(raw.get("name", path.stem)), path, base, grid, extra,
                     _seeds(path, raw, base, repeat), variants)
    if spec.seeds and any("seed" in c for c in spec.cells()):
        raise ConfigError(f"sweep {path}: seed varies in [grid] or [[cells]] and the sweep "
                          "also repeats over seeds; use one of them.")
    errors = []
    for params in spec.cells():
        try:
            validate({**base, **params})
        except ConfigError as exc:
            errors.append(f"cell {params}: {exc}")
    if errors:
        raise ConfigError(f"sweep {path} has invalid cells:\n" + "\n".join(errors[:5]))
    return spec


def _server_sees(r: dict[str, Any]) -> str:
    """What the server could read of the clients' updates: each one, or only their sum."""
    agg = r.get("aggregation") or {}
    if "individual-updates-visible" not in agg:
        return ""
    return ("each update" if agg["individual-updates-visible"]
            else f"the sum only ({agg.get('protocol')})")


def _reported(r: dict[str, Any]) -> list[str]:
    """The reported model's round (with validation-fraction), its test AUROC, and its AUROC
    under each test-noise sigma ("sigma=auroc ...")."""
    selection = r.get("model-selection") or {}
    auroc = selection.get("test", {}).get("auroc", r.get("final", {}).get("auroc"))
    noise = " ".join(f"{x['sigma']:g}={x['auroc']:.3f}" for x in r.get("robustness") or []
                     if x.get("auroc") is not None)
    return [str(selection.get("round", "")), _fmt(auroc, 3), noise]


def _write_table(out: Path, spec: SweepSpec, cells: Sequence[Cell]) -> None:
    keys = spec.keys + (["seed"] if spec.seeds else [])
    head = ["cell", *keys, "status", "final-acc", "best-acc", "best-round", "rounds",
            "target-round", "epsilon", "delta", "server-sees", "reid-top1", "mia-auc",
            "selected-round",
            "auroc", "noise-auroc", "steady-round-s", "wall-s", "run-dir", "error"]
    rows = []
    for c in cells:
        r = c.result
        privacy = r.get("privacy", {})
        eps = headline_epsilon(privacy)
        delta = privacy.get("delta", privacy.get("delta-max"))
        given = {**c.params, **({} if c.seed is None else {"seed": c.seed})}
        rows.append([c.index, *[given.get(k, "") for k in keys], c.status,
                     _fmt(r.get("final", {}).get("accuracy")),
                     _fmt(r.get("best", {}).get("accuracy")), r.get("best", {}).get("round", ""),
                     r.get("rounds", ""), r.get("target-reached-round", ""),
                     _fmt(eps, 3), "" if delta is None else f"{delta:.2g}",
                     _server_sees(r),
                     _fmt(_anon(r, "reid-top1"), 3), _fmt(_anon(r, "mia-auc"), 3),
                     *_reported(r),
                     _fmt(r.get("steady-round-s"), 3),
                     _fmt(r.get("wall-s"), 1),
                     str(c.run_dir.relative_to(out)) if c.run_dir else "", c.error or ""])
    with open(out / "sweep.csv", "w", newline="") as f:
        csv.writer(f).writerows([head, *rows])
    md = [f"# Sweep {spec.name}", "", f"From `{spec.path}`; fixed keys: "
          + (", ".join(f"`{k}={v}`" for k, v in spec.base.items()) or "none"), ""]
    if spec.seeds:
        md += _seed_table(spec, cells)
    md += ["| " + " | ".join(head[:-2]) + " |", "|" + "---|" * (len(head) - 2)]
    for row in rows:
        md.append("| " + " | ".join(str(x) for x in row[:-2]) + " |")
    failed = [c for c in cells if c.error]
    if failed:
        md += ["", "Failed cells:", ""] + [f"- cell {c.index} ({c.label}): {c.error}"
                                         for c in failed]
    md += ["", "![accuracy vs round](plots/accuracy_vs_round.png)", "",
           "![final accuracy](plots/final_accuracy.png)", ""]
    if any(c.result.get("anonymization") for c in cells):
        md += ["![accuracy vs re-identification](plots/reid_accuracy.png)", "",
               "![accuracy vs membership inference](plots/mia_accuracy.png)", ""]
    if any(headline_epsilon(c.result.get("privacy")) is not None for c in cells):
        md += ["![privacy-accuracy trade-off](plots/privacy_accuracy.png)", "",
               "![epsilon vs round](plots/epsilon_vs_round.png)", ""]
    leaked = sweep_rows(cells)
    if leaked:
        write_leakage_table(out, leaked)
        md += ["## What leaked", "", "See [leakage.md](leakage.md) (one row per cell and "
               "observed round; also leakage.csv).", ""]
    (out / "sweep.md").write_text("\n".join(md))


def _seed_table(spec: SweepSpec, cells: Sequence[Cell]) -> list[str]:
    """Per cell, the mean and 95% interval over its seeds' finished runs."""
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        groups.setdefault(c.group, []).append(c)
    md = [f"Mean ± 95% interval (Student's t) over seeds {spec.seeds}, finished runs only:",
          "", "| cell | final-acc | best-acc | epsilon | steady-round-s |", "|---|---|---|---|---|"]
    for group, runs in groups.items():
        done = [c.result for c in runs if c.status == "finished"]
        md.append(f"| {group} | {fmt_ci([r.get('final', {}).get('accuracy') for r in done])} | "
                  f"{fmt_ci([r.get('best', {}).get('accuracy') for r in done])} | "
                  f"{fmt_ci([headline_epsilon(r.get('privacy')) for r in done], 3)} | "
                  f"{fmt_ci([r.get('steady-round-s') for r in done], 3)} |")
    return [*md, "", "Every run:", ""]


def _anon(result: dict[str, Any], key: str) -> float | None:
    return (result.get("anonymization") or {}).get("mean", {}).get(key)


def _fmt(x: Any, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


@dataclass
class SweepRun:
    """A sweep's folder (None for a dry run) and its cells, as they ended."""

    out: Path | None
    cells: list[Cell]

    @property
    def exit_code(self) -> int:
        """0 when every cell finished (or nothing ran), else 1."""
        return int(self.out is not None and any(c.status != "finished" for c in self.cells))


def run_sweep(name: str, overrides: Sequence[str] = (), *,
              values: Mapping[str, Any] | None = None, dry_run: bool = False,
              verbose: bool = False, separate: bool = False,
              repeat: int | None = None) -> SweepRun:
    """Run a sweep file (with --set ``overrides`` and typed ``values`` in every cell).

    By default every cell runs inside one Flower simulation (one SuperLink, one Ray
    start, warm clients; :func:`server.app.run_cells`); ``separate`` gives each cell a
    simulation of its own, as a fallback. ``repeat`` (or the file's ``seeds``) runs every
    cell once per seed.
    """
    spec = load_sweep(name, overrides, values, repeat)
    cells = []
    for params in spec.cells():
        for seed in spec.seeds or [None]:
            given = {**spec.base, **params, **({} if seed is None else {"seed": seed})}
            cells.append(Cell(len(cells) + 1, params, absolutize(validate(given)), seed=seed))
    seeds = f" x {len(spec.seeds)} seeds" if spec.seeds else ""
    print(f"sweep {spec.name}: {len(cells)} runs ({len(cells) // max(len(spec.seeds), 1)} "
          f"cells{seeds}) over {', '.join(spec.keys) or 'nothing'}"
          + ("" if separate else ", in one simulation"))
    for c in cells:
        print(f"  {c.index:>3}. {c.label}")
    if dry_run:
        return SweepRun(None, cells)
    results_dir = cells[0].config.results.results_dir
    out = new_run_dir(Path(results_dir) / "sweeps", spec.name)
    (out / "plots").mkdir()
    (out / "sweep.json").write_text(json.dumps(
        {"name": spec.name, "file": str(spec.path), "fixed": spec.base, "grid": spec.grid,
         "cells": spec.extra, "seeds": spec.seeds}, indent=2))
    t0 = time.perf_counter()
    try:
        with LocalSuperLink(ray=cells[0].config.resources.ray_address) as link:
            if separate:
                _run_separately(link, out, spec, cells, verbose)
            else:
                _run_together(link, out, spec, cells, verbose)
    finally:
        _write_table(out, spec, cells)
        sweep_plots(out / "plots", spec.name, cells)
    failed = sum(c.status != "finished" for c in cells)
    print(f"\nsweep finished in {time.perf_counter() - t0:.0f} s: {len(cells) - failed} of "
          f"{len(cells)} runs finished · {out / 'sweep.md'}")
    return SweepRun(out, cells)


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


def _run_separately(link: LocalSuperLink, out: Path, spec: SweepSpec, cells: list[Cell],
                    verbose: bool) -> None:
    """The fallback: one simulation per cell, on the same SuperLink."""
    app = app_dir()
    for c in cells:
        print(f"\n[{c.index}/{len(cells)}] {c.label}", flush=True)
        try:
            pre = _checked(c, preflight_isolated(c.config))
        except (ConfigError, RuntimeError) as exc:
            pre = _checked(c, exc)
        if pre is None:
            continue
        c.run_dir = out / "cells" / f"{c.index:02d}"
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
        _write_table(out, spec, cells)


def engine_key(cfg: RunConfig) -> tuple[Any, ...]:
    """What must be equal for cells to share one simulation: the clients' resources."""
    r = cfg.resources
    return (r.client_cpus, r.client_gpus, r.device)


def _run_together(link: LocalSuperLink, out: Path, spec: SweepSpec, cells: list[Cell],
                  verbose: bool) -> None:
    """Every cell inside one simulation (one per distinct client resources): the
    ServerApp runs them in turn on the largest cell's federation."""
    print("\nchecking every cell (data, model, partitions, privacy)...", flush=True)
    checks = preflight_many([c.config for c in cells])
    ready = {c.index: pre for c, raw in zip(cells, checks, strict=True)
             if (pre := _checked(c, raw)) is not None}
    groups: dict[tuple[Any, ...], list[Cell]] = {}
    for c in cells:
        if c.index in ready:
            groups.setdefault(engine_key(c.config), []).append(c)
    app = app_dir()
    for g, group in enumerate(groups.values(), 1):
        for c in group:
            c.run_dir = out / "cells" / f"{c.index:02d}"
            c.run_dir.mkdir(parents=True)
            link.watch_run(c.run_dir)
        plan = out / f"cells-{g}.json"
        plan.write_text(json.dumps({"cells": [
            {"index": c.index, "label": c.label,
             "config": {**c.config.flat(), "run-dir": str(c.run_dir),
                        "run-id": run_identity(c.run_dir, c.config.results)}}
            for c in group]},
            indent=1))
        host = max(group, key=lambda c: c.config.federation.num_clients)
        cuda = any(ready[c.index].cuda for c in group)
        print(f"\nstarting one simulation for {len(group)} run(s) on "
              f"{host.config.federation.num_clients} clients...", flush=True)
        log = LogFilter(out / "flwr.log", verbose, print)
        t0 = time.perf_counter()
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
        for c in group:
            status, error = recorded_outcome(c.run_dir, out / "flwr.log", link.died())
            mark_unfinished(c.run_dir, status, error)
            res = after_run(c.config, c.run_dir, status, error,
                            float(read_run_info(c.run_dir).get("wall-s", wall / len(group))),
                            print, ready[c.index].label_counts)
            _record(c, res)
        _write_table(out, spec, cells)


def _read_sweep(out: Path) -> tuple[dict[str, Any], list[Cell]]:
    """A finished sweep's sweep.json and its cells from sweep.csv (each with its run's
    outcome); ConfigError naming the damaged file."""
    where = f"fedpriv sweep --replot {str(out)!r}"
    name = "sweep.json"
    try:
        spec = json.loads(read_text(out / name, where))
        name = "sweep.csv"
        keys = list(spec["grid"]) + [k for c in spec.get("cells", []) for k in c]
        cells = []
        for row in csv.DictReader(io.StringIO(read_text(out / name, where), newline="")):
            params = {k: row[k] for k in dict.fromkeys(keys) if row.get(k, "") != ""}
            cell = Cell(int(row["cell"]), params, None, row["status"], row["error"] or None,
                        out / row["run-dir"] if row["run-dir"] else None,
                        seed=int(row["seed"]) if row.get("seed") else None)
            if cell.run_dir:
                info = read_run_info(cell.run_dir, where)
                cell.result = {**run_outcome(read_ledger(cell.run_dir, where)),
                               "privacy": info.get("privacy", {}),
                               **{k: info.get(k) for k in REPORTED}}
            cells.append(cell)
        if not isinstance(spec["name"], str):
            raise TypeError(f"its name is a {type(spec['name']).__name__}")
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, csv.Error) as exc:
        raise damaged(out / name, f"is damaged ({type(exc).__name__}: {exc})", where) from None
    if not cells:
        raise damaged(out / "sweep.csv", "lists no cells", where)
    return spec, cells


def replot(out: Path) -> None:
    """Redraw a finished sweep's comparison plots from its folder (sweep.csv + cells)."""
    if not (out / "sweep.json").is_file() or not (out / "sweep.csv").is_file():
        raise ConfigError(f"{out} is not a finished sweep's folder (no sweep.json and "
                          "sweep.csv there). Give the folder `fedpriv sweep` printed, e.g. "
                          "results/sweeps/20261122-101500-dp-epsilon-mnist.")
    spec, cells = _read_sweep(out)
    sweep_plots(out / "plots", spec["name"], cells)
    leaked = sweep_rows(cells)
    if leaked:  # the attacks may have been re-run since (fedpriv attack on a cell)
        write_leakage_table(out, leaked)
    wrote = sorted(p.name for p in (out / "plots").glob("*.png"))
    print(f"redrew {len(wrote)} plots in {out / 'plots'}"
          + (" and the leakage table (leakage.md, leakage.csv)" if leaked else ""))
