"""A sweep's comparison table: sweep.csv, sweep.md (with the mean over seeds) and, when
cells were attacked, the leakage table beside them."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tasks.files import damaged, read_text, write_atomic
from tasks.markdown import drop_empty_columns, markdown_table
from tasks.results.ledger import headline_epsilon

from .settings import effective
from .spec import Cell, SweepSpec
from .stats import fmt_ci

# run.json entries a sweep's table and plots read besides the ledger's outcome and privacy
REPORTED = ("anonymization", "aggregation", "model-selection", "robustness", "diverged")
# the columns of sweep.csv every reader needs
REQUIRED = ("cell", "status", "run-dir")


def cell_settings(c: Cell, keys: Iterable[str]) -> dict[str, Any]:
    """The settings ``keys`` of the cell as it ran: the value the cell set itself, else the
    one it got from the sweep's fixed keys (or the preset, or the default); a key the
    cell's mode never reads is left out (:mod:`experiments.sweep.settings`). A sweep over
    seeds gives each run's seed itself (``Cell.seed``)."""
    keys = list(keys)
    ran = effective(c.config, keys) if c.config is not None else {}
    out = {}
    for k in keys:
        value = c.params[k] if k in c.params else ran.get(k)
        if value is not None:
            out[k] = value
    return out


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


def _neighbours(privacy: dict[str, Any]) -> str:
    """The relation a cell's epsilon is stated for: one record (added/removed or replaced)
    of a client under local DP, one client under central DP."""
    if privacy.get("mode") == "local":
        return f"{privacy.get('dp-relation', 'add-remove')} record"
    if privacy.get("mode") == "central":
        return "add-remove client"
    if privacy.get("mode") == "distributed":
        return "zero-out client"
    return ""


def comparison(out: Path, spec: SweepSpec, cells: Sequence[Cell]
               ) -> tuple[list[str], list[list[Any]]]:
    """The sweep's table, one row per run: the head and the rows (run-dir and error last)."""
    # with matplotlib (0.3 s): imported here, not before a sweep's runtime starts
    from .memorization import exposure_text

    keys = spec.keys + (["seed"] if spec.seeds else [])
    head = ["cell", *keys, "status", "final-acc", "best-acc", "best-round", "rounds",
            "target-round", "epsilon", "delta", "neighbours", "accountant", "server-sees",
            "reid-top1", "mia-auc", "exposure",
            "selected-round",
            "auroc", "noise-auroc", "steady-round-s", "wall-s", "run-dir", "error"]
    rows = []
    for c in cells:
        r = c.result
        privacy = r.get("privacy", {})
        eps = headline_epsilon(privacy)
        delta = privacy.get("delta", privacy.get("delta-max"))
        given = {**cell_settings(c, keys), **({} if c.seed is None else {"seed": c.seed})}
        rows.append([c.index, *[given.get(k, "") for k in keys], c.status,
                     _fmt(r.get("final", {}).get("accuracy")),
                     _fmt(r.get("best", {}).get("accuracy")), r.get("best", {}).get("round", ""),
                     r.get("rounds", ""), r.get("target-reached-round", ""),
                     _fmt(eps, 3), "" if delta is None else f"{delta:.2g}",
                     _neighbours(privacy), privacy.get("accountant", ""),
                     _server_sees(r),
                     _fmt(_anon(r, "reid-top1"), 3), _fmt(_anon(r, "mia-auc"), 3),
                     exposure_text(c), *_reported(r),
                     _fmt(r.get("steady-round-s"), 3),
                     _fmt(r.get("wall-s"), 1),
                     str(c.run_dir.relative_to(out)) if c.run_dir else "", c.error or ""])
    return head, rows


def shown(out: Path, spec: SweepSpec, cells: Sequence[Cell]) -> tuple[list[str], list[list[Any]]]:
    """The columns sweep.md and the terminal show: without run-dir and error (they have
    their own lines) and without a column that is empty in every row."""
    head, rows = comparison(out, spec, cells)
    return drop_empty_columns(head[:-2], [row[:-2] for row in rows], keep=("cell", "status"))


def print_table(out: Path, spec: SweepSpec, cells: Sequence[Cell]) -> None:
    """The comparison table on the terminal (rich), as Markdown when not on one (or on
    one too narrow for it)."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    head, rows = shown(out, spec, cells)
    console = Console(highlight=False)
    if console.is_terminal:  # a header word a line ("best-round": "best" over "round"), so
        # that the columns fit a terminal's width without cutting the names short
        table = Table(*[h.replace("-", "\n") for h in head], box=box.SIMPLE_HEAD,
                      header_style="bold", pad_edge=False, collapse_padding=True)
        for row in rows:
            table.add_row(*[str(x) for x in row])
        wide = console.options.update_width(10_000)
        if console.measure(table, options=wide).minimum <= console.width:  # none cut short
            console.print(table)
            return
    # a log, a pipe or a narrow terminal: a Markdown table, every column at full width
    table = Table(*head, box=box.MARKDOWN)
    for row in rows:
        table.add_row(*[str(x) for x in row])
    plain = io.StringIO()
    Console(file=plain, width=1000, color_system=None, highlight=False).print(table)
    print("\n".join(line.rstrip() for line in plain.getvalue().splitlines() if line.strip()))


def write_table(out: Path, spec: SweepSpec, cells: Sequence[Cell]) -> None:
    # the leakage tables need scipy: imported when a sweep has its first results, not
    # before its cells start
    from ..leakage.malicious import write_malicious_table
    from ..leakage.sweep import sweep_rows, write_leakage_table
    from ..leakage.tables import write_attack_tables

    head, rows = comparison(out, spec, cells)
    text = io.StringIO(newline="")
    csv.writer(text).writerows([head, *rows])
    write_atomic(out / "sweep.csv", lambda f: f.write(text.getvalue().encode()))
    md = [f"# Sweep {spec.name}", "", f"From `{spec.path}`; fixed keys: "
          + (", ".join(f"`{k}={v}`" for k, v in spec.base.items()) or "none"), ""]
    if spec.seeds:
        md += _seed_table(spec, cells)
    md += markdown_table(*shown(out, spec, cells))
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
        write_attack_tables(out, cells)
        md += ["## What leaked", "", "See [leakage.md](leakage.md) (one row per cell and "
               "observed round; also leakage.csv; every membership attack and audit in "
               "leakage_membership.csv and leakage_audit.csv).", ""]
    if write_malicious_table(out, cells):
        md += ["## A malicious server", "", "See [leakage.md](leakage.md#a-malicious-server) "
               "(also malicious.csv): per defence, the share of the cohort's records the "
               "trap recovered.", ""]
    write_atomic(out / "sweep.md", lambda f: f.write("\n".join(md).encode()))


def read_table(out: Path, where: str) -> tuple[list[str], list[dict[str, str]]]:
    """sweep.csv read back and checked: the keys that label its cells (the columns between
    ``cell`` and ``status``, ``seed`` aside) and one row per cell. ConfigError naming the
    file when it is empty, lacks a column fedpriv writes, lists a cell that is not a whole
    number (or one twice), a seed that is not one, or a run folder outside the sweep's."""
    path = out / "sweep.csv"
    text = read_text(path, where)

    def bad(why: str) -> Exception:
        return damaged(path, why, where)

    try:
        reader = csv.reader(io.StringIO(text, newline=""))
        lines = [(reader.line_num, row) for row in reader if row]
    except csv.Error as exc:
        raise bad(f"is not a CSV table ({exc})") from None
    if not lines:
        raise bad("is empty (fedpriv writes a header and one row per cell)")
    (_, head), body = lines[0], lines[1:]
    missing = [c for c in REQUIRED if c not in head]
    if missing:
        raise bad(f"has no {' or '.join(missing)} column (its header: {', '.join(head)})")
    if len(set(head)) != len(head):
        raise bad(f"names a column twice (its header: {', '.join(head)})")
    if not body:
        raise bad("lists no cells (only its header)")
    root = out.resolve()
    rows, seen = [], set()
    for n, values in body:
        if len(values) != len(head):
            raise bad(f"line {n} has {len(values)} fields where its header has {len(head)}")
        row = dict(zip(head, values, strict=True))
        cell = row["cell"]
        if not re.fullmatch(r"[0-9]+", cell) or int(cell) < 1:
            raise bad(f"line {n}: cell {cell!r} is not a whole number from 1")
        if int(cell) in seen:
            raise bad(f"line {n}: cell {cell} is listed twice")
        seen.add(int(cell))
        if row.get("seed") and not re.fullmatch(r"-?[0-9]+", row["seed"]):
            raise bad(f"line {n}: cell {cell}'s seed {row['seed']!r} is not a whole number")
        run = row["run-dir"]
        target = (root / run).resolve()
        if run and (Path(run).is_absolute() or target == root
                    or not target.is_relative_to(root)):
            raise bad(f"line {n}: cell {cell}'s run-dir {run!r} lies outside the sweep's "
                      "folder (fedpriv writes cells/<index>-<keys> there)")
        rows.append(row)
    first, last = head.index("cell") + 1, head.index("status")
    labels = [k for k in head[first:last] if k != "seed"]
    return labels, rows


def _seed_table(spec: SweepSpec, cells: Sequence[Cell]) -> list[str]:
    """Per cell, the mean and 95% interval over its seeds' finished runs."""
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        groups.setdefault(c.group, []).append(c)
    rows = []
    for group, runs in groups.items():
        done = [c.result for c in runs if c.status == "finished"]
        rows.append([group, fmt_ci([r.get("final", {}).get("accuracy") for r in done]),
                     fmt_ci([r.get("best", {}).get("accuracy") for r in done]),
                     fmt_ci([headline_epsilon(r.get("privacy")) for r in done], 3),
                     fmt_ci([r.get("steady-round-s") for r in done], 3)])
    head, rows = drop_empty_columns(
        ["cell", "final-acc", "best-acc", "epsilon", "steady-round-s"], rows, keep=("cell",))
    return [f"Mean ± 95% interval (Student's t) over seeds {spec.seeds}, finished runs only:",
            "", *markdown_table(head, rows), "", "Every run:", ""]


def _anon(result: dict[str, Any], key: str) -> float | None:
    return (result.get("anonymization") or {}).get("mean", {}).get(key)


def _fmt(x: Any, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


