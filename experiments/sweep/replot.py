"""`fedpriv sweep --replot`: a finished sweep's plots (and leakage table) redrawn from its
folder, e.g. after `fedpriv attack` re-ran a cell's attacks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.config import ConfigError
from tasks.files import damaged, read_text
from tasks.results.folder import read_run_info
from tasks.results.ledger import outcome as run_outcome
from tasks.results.ledger import read_ledger

from ..leakage.malicious import write_malicious_table
from ..leakage.sweep import sweep_rows, write_leakage_table
from ..leakage.tables import write_attack_tables
from .plots import sweep_plots
from .spec import Cell
from .table import REPORTED, read_table


def _read_sweep(out: Path) -> tuple[dict[str, Any], list[Cell]]:
    """A finished sweep's sweep.json and its cells from sweep.csv (each with its run's
    outcome); ConfigError naming the damaged file."""
    where = f"fedpriv sweep --replot {str(out)!r}"
    name = "sweep.json"
    try:
        spec = json.loads(read_text(out / name, where))
        own = _own_params(spec)
        name = "sweep.csv"
        keys = list(spec["grid"]) + [k for c in spec.get("cells", []) for k in c]
        cells = []
        for row in read_table(out, where)[1]:
            params = own.get(int(row["cell"])) if own is not None else {
                k: row[k] for k in dict.fromkeys(keys) if row.get(k, "") != ""}
            cell = Cell(int(row["cell"]), params or {}, None, row["status"],
                        row.get("error") or None,
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
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise damaged(out / name, f"is damaged ({type(exc).__name__}: {exc})", where) from None
    return spec, cells


def _own_params(spec: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
    """Each cell's own keys (its label, as the sweep showed it), rebuilt from sweep.json's
    tables; None when they cannot be (an older sweep.json without its variants, or one
    this version's schema no longer accepts): the labels then come from sweep.csv."""
    from .run import build_cells  # the runtimes: only for a sweep.json that has variants
    from .spec import SweepSpec

    if "variants" not in spec:
        return None
    try:
        rebuilt = SweepSpec(str(spec["name"]), Path(str(spec.get("file", ""))),
                            dict(spec["fixed"]), dict(spec["grid"]), list(spec["cells"]),
                            list(spec.get("seeds") or []), list(spec["variants"]))
        return {c.index: c.params for c in build_cells(rebuilt, {})}
    except (ConfigError, ValueError, KeyError, TypeError, AttributeError):
        return None


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
        write_attack_tables(out, cells)
    write_malicious_table(out, cells)
    wrote = sorted(p.name for p in (out / "plots").glob("*.png"))
    print(f"redrew {len(wrote)} plots in {out / 'plots'}"
          + (" and the leakage table (leakage.md, leakage.csv)" if leaked else ""))


