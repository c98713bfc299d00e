"""`fedpriv sweep`: every combination of a grid, on one SuperLink, compared in one table.

A sweep file names an optional base ``preset``, ``[fixed]`` keys for every cell and
a ``[grid]`` of lists. Every cell is checked against the schema before anything
starts; a cell whose data check or run fails is recorded and the sweep goes on.
"""

from __future__ import annotations

import csv
import itertools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.ledger import outcome as run_outcome
from server.ledger import read_ledger
from server.privacy_log import headline_epsilon
from server.results import new_run_dir, read_run_info
from tasks.config import ConfigError, RunConfig, parse_assignment, validate

from .app_bundle import app_dir
from .configs import SWEEPS, absolutize, find_file, read_preset, read_toml
from .leakage_sweep import sweep_rows, write_leakage_table
from .preflight import preflight_isolated
from .runner import execute
from .superlink import LocalSuperLink
from .sweep_plots import sweep_plots


@dataclass
class SweepSpec:
    name: str
    path: Path
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    extra: list[dict[str, Any]] = field(default_factory=list)

    def cells(self) -> list[dict[str, Any]]:
        """Every combination of the grid, then the explicitly listed [[cells]]."""
        keys = list(self.grid)
        combos = itertools.product(*self.grid.values()) if keys else iter(())
        return [dict(zip(keys, combo, strict=True)) for combo in combos] + [
            dict(c) for c in self.extra]

    @property
    def keys(self) -> list[str]:
        """The keys that vary between cells, for table columns."""
        out = list(self.grid)
        for cell in self.extra:
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

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items())


def load_sweep(name: str, overrides: Sequence[str] = (),
               values: Mapping[str, Any] | None = None) -> SweepSpec:
    """Read and check a sweep file (schema errors in any cell stop the sweep before it starts)."""
    path = find_file(name, SWEEPS, "sweep")
    raw = read_toml(path)
    unknown = set(raw) - {"name", "preset", "fixed", "grid", "cells"}
    if unknown:
        raise ConfigError(f"sweep {path}: unknown top-level entries {sorted(unknown)}; allowed: "
                          "name, preset, [fixed], [grid], [[cells]].")
    grid = raw.get("grid", {})
    extra = raw.get("cells", [])
    if not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError(f"sweep {path}: [grid] must map keys to non-empty lists, e.g. "
                          "num-clients = [5, 10].")
    if not isinstance(extra, list) or not all(isinstance(c, dict) and c for c in extra):
        raise ConfigError(f"sweep {path}: [[cells]] entries must be tables of keys.")
    if not grid and not extra:
        raise ConfigError(f"sweep {path}: give a [grid] of lists and/or [[cells]] tables.")
    base: dict[str, Any] = {}
    if "preset" in raw:
        base.update(read_preset(str(raw["preset"])))
    base.update(raw.get("fixed", {}))
    for text in overrides:
        key, value = parse_assignment(text)
        base[key] = value
    base.update(values or {})  # typed overrides (the Python API's)
    spec = SweepSpec(str(raw.get("name", path.stem)), path, base, grid, extra)
    errors = []
    for params in spec.cells():
        try:
            validate({**base, **params})
        except ConfigError as exc:
            errors.append(f"cell {params}: {exc}")
    if errors:
        raise ConfigError(f"sweep {path} has invalid cells:\n" + "\n".join(errors[:5]))
    return spec


def _write_table(out: Path, spec: SweepSpec, cells: Sequence[Cell]) -> None:
    keys = spec.keys
    head = ["cell", *keys, "status", "final-acc", "best-acc", "best-round", "rounds",
            "target-round", "epsilon", "delta", "reid-top1", "mia-auc", "steady-round-s",
            "wall-s", "run-dir", "error"]
    rows = []
    for c in cells:
        r = c.result
        privacy = r.get("privacy", {})
        eps = headline_epsilon(privacy)
        delta = privacy.get("delta", privacy.get("delta-max"))
        rows.append([c.index, *[c.params.get(k, "") for k in keys], c.status,
                     _fmt(r.get("final", {}).get("accuracy")),
                     _fmt(r.get("best", {}).get("accuracy")), r.get("best", {}).get("round", ""),
                     r.get("rounds", ""), r.get("target-reached-round", ""),
                     _fmt(eps, 3), "" if delta is None else f"{delta:.2g}",
                     _fmt(_anon(r, "reid-top1"), 3), _fmt(_anon(r, "mia-auc"), 3),
                     _fmt(r.get("steady-round-s"), 3),
                     _fmt(r.get("wall-s"), 1),
                     str(c.run_dir.relative_to(out)) if c.run_dir else "", c.error or ""])
    with open(out / "sweep.csv", "w", newline="") as f:
        csv.writer(f).writerows([head, *rows])
    md = [f"# Sweep {spec.name}", "", f"From `{spec.path}`; fixed keys: "
          + (", ".join(f"`{k}={v}`" for k, v in spec.base.items()) or "none"), "",
          "| " + " | ".join(head[:-2]) + " |", "|" + "---|" * (len(head) - 2)]
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
              verbose: bool = False) -> SweepRun:
    """Run a sweep file (with --set ``overrides`` and typed ``values`` in every cell)."""
    spec = load_sweep(name, overrides, values)
    cells = [Cell(i + 1, p, absolutize(validate({**spec.base, **p})))
             for i, p in enumerate(spec.cells())]
    print(f"sweep {spec.name}: {len(cells)} cells over {', '.join(spec.grid)}")
    for c in cells:
        print(f"  {c.index:>3}. {c.label}")
    if dry_run:
        return SweepRun(None, cells)
    results_dir = cells[0].config.results.results_dir
    out = new_run_dir(Path(results_dir) / "sweeps", spec.name)
    (out / "plots").mkdir()
    (out / "sweep.json").write_text(json.dumps(
        {"name": spec.name, "file": str(spec.path), "fixed": spec.base, "grid": spec.grid,
         "cells": spec.extra}, indent=2))
    app = app_dir()
    t0 = time.perf_counter()
    try:
        with LocalSuperLink() as link:
            for c in cells:
                print(f"\n[{c.index}/{len(cells)}] {c.label}", flush=True)
                try:
                    pre = preflight_isolated(c.config)
                except ConfigError as exc:
                    c.status, c.error = "invalid", str(exc)
                    print(f"  skipped: {exc}")
                    continue
                except Exception as exc:  # a broken cell must not end the sweep
                    c.status, c.error = "crashed", f"pre-flight check: {exc}"
                    print(f"  cell {c.index} crashed: {exc}")
                    continue
                c.run_dir = out / "cells" / f"{c.index:02d}"
                c.run_dir.mkdir(parents=True)
                try:
                    res = execute(link, app, c.config, c.run_dir, cuda=pre.cuda,
                                  verbose=verbose, label_counts=pre.label_counts)
                except KeyboardInterrupt:
                    c.status, c.error = "interrupted", "interrupted by the user"
                    raise
                except Exception as exc:
                    c.status, c.error = "crashed", f"{type(exc).__name__}: {exc}"
                    print(f"  cell {c.index} crashed: {c.error}")
                    continue
                c.status, c.error = res.status, res.error
                ledger = read_ledger(c.run_dir)
                c.result = {**run_outcome(ledger), "rounds": len(ledger), "wall-s": res.wall_s,
                            "target-reached-round": res.info.get("target-reached-round", ""),
                            "privacy": res.info.get("privacy", {}),
                            "anonymization": res.info.get("anonymization")}
                if not res.ok:
                    print(f"  cell {c.index} {res.status}: {res.error}")
                _write_table(out, spec, cells)
    finally:
        _write_table(out, spec, cells)
        sweep_plots(out / "plots", spec.name, cells)
    failed = sum(c.status != "finished" for c in cells)
    print(f"\nsweep finished in {time.perf_counter() - t0:.0f} s: {len(cells) - failed} of "
          f"{len(cells)} cells finished · {out / 'sweep.md'}")
    return SweepRun(out, cells)


def replot(out: Path) -> None:
    """Redraw a finished sweep's comparison plots from its folder (sweep.csv + cells)."""
    spec = json.loads((out / "sweep.json").read_text())
    keys = list(spec["grid"]) + [k for c in spec.get("cells", []) for k in c]
    cells = []
    with open(out / "sweep.csv", newline="") as f:
        for row in csv.DictReader(f):
            params = {k: row[k] for k in dict.fromkeys(keys) if row.get(k, "") != ""}
            cell = Cell(int(row["cell"]), params, None, row["status"], row["error"] or None,
                        out / row["run-dir"] if row["run-dir"] else None)
            if cell.run_dir:
                info = read_run_info(cell.run_dir)
                cell.result = {**run_outcome(read_ledger(cell.run_dir)),
                               "privacy": info.get("privacy", {}),
                               "anonymization": info.get("anonymization")}
            cells.append(cell)
    sweep_plots(out / "plots", spec["name"], cells)
    leaked = sweep_rows(cells)
    if leaked:  # the attacks may have been re-run since (fedpriv attack on a cell)
        write_leakage_table(out, leaked)
    wrote = sorted(p.name for p in (out / "plots").glob("*.png"))
    print(f"redrew {len(wrote)} plots in {out / 'plots'}"
          + (" and the leakage table (leakage.md, leakage.csv)" if leaked else ""))
