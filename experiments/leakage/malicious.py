"""A sweep's malicious-server table: per defence, what the trap read out of the cohort.

One row per cell with ``server = "malicious"`` and tampered round (from the ledger, so a
round in which every client refused the weights is a row too): the clients that trained
on the trap and those that declined, the cohort's records, the share recovered above
30 dB PSNR, mean PSNR/SSIM (:func:`privacy.attacks.builtin.imprint` as scored in
``leakage.jsonl``), the claimed epsilon, and whether the defence held (under 1% of the
records recovered). Written as ``malicious.csv`` and a section of ``leakage.md``, with a
grid of reconstructions per defence (``plots/malicious_reconstructions.png``).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.markdown import markdown_table
from tasks.results.ledger import headline_epsilon, read_ledger

from .sweep import _cell, _read_config, _reconstructions, defence, setting

COLUMNS = ("cell", "defence", "model", "trap", "round", "trained", "declined", "records",
           "recovered-above-30db", "recovered-ci95", "labels-right", "psnr", "ssim",
           "epsilon-claimed", "holds", "run-dir")
HELD = 0.01  # a defence holds when under 1% of the records are recovered
SECTION = "\n## A malicious server\n"


def malicious_rows(cells: Sequence[Any]) -> list[dict[str, Any]]:
    """The table's rows for a sweep's finished cells (``Cell`` objects of the sweep)."""
    rows = []
    for c in cells:
        if c.run_dir is None or not (c.run_dir / "metrics.jsonl").exists():
            continue
        cfg = c.config if c.config is not None else _read_config(c.run_dir)
        if cfg.leakage.server != "malicious":
            continue
        path = c.run_dir / "leakage.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        for record in read_ledger(c.run_dir):
            if not record.tampered:
                continue
            got = next((x for x in lines if x["round"] == record.round
                        and x["attack"] == "imprint" and "skipped" not in x), None)
            trained = len(record.clients)
            share = (got or {}).get("recovered-above-30db", 0.0 if not trained else None)
            rows.append({
                "cell": c.index, "defence": defence(cfg), "model": _model(cfg),
                "trap": cfg.leakage.server_trap,
                "setting": f"{_model(cfg)}, {cfg.leakage.server_trap} trap, {setting(cfg)}",
                "round": record.round, "trained": trained,
                "declined": len(record.skipped),
                "records": trained * cfg.leakage.observed_examples or None,
                "recovered-above-30db": share,
                "recovered-ci95": _interval(share, trained * cfg.leakage.observed_examples),
                "labels-right": (got or {}).get("label-accuracy-recovered"),
                "psnr": (got or {}).get("psnr"), "ssim": (got or {}).get("ssim"),
                "epsilon-claimed": headline_epsilon(record.privacy),
                "holds": None if share is None else share < HELD,
                "run-dir": str(c.run_dir)})
    return rows


def write_malicious_table(out: Path, cells: Sequence[Any]) -> bool:
    """malicious.csv, its section of leakage.md and the reconstruction grid; False when no
    cell had a malicious server."""
    rows = malicious_rows(cells)
    if not rows:
        return False
    with open(out / "malicious.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: _show(r.get(k)) for k in COLUMNS} for r in rows)
    shown = [c for c in COLUMNS if c != "run-dir"]
    name = out.name.split("-", 2)[-1]  # the sweep's folder: <date>-<time>-<name>
    grid = _reconstructions(out / "plots", name, rows, per_row=6, attack="imprint",
                            file="malicious_reconstructions.png",
                            title="records the trap recovered per defence (binning)")
    md = [SECTION.strip(), "",
          "The server sent trap weights in the observed round (Fowl et al. 2022's binning, "
          "scaled to what the aggregation carries) and read records out of what it held: "
          "the plain aggregate, the SecAgg+ sum or the HE-decrypted sum, before central "
          "DP's noise. recovered-above-30db: share of the cohort's records (the clients "
          "that trained x their records) that some recovered row matches above 30 dB PSNR, "
          "with its 95% Clopper-Pearson interval over those records (one run); "
          "labels-right: of those, the share whose label the server inferred right (from "
          "each bin's bias scale). "
          f"holds: under {HELD:.0%} recovered. declined: clients that sent no update "
          "(their client-screen refused the weights).", "",
          *markdown_table(shown, [[_show(r.get(c)) for c in shown] for r in rows])]
    if grid:
        md += ["", f"![reconstructions per defence](plots/{grid})"]
    page = out / "leakage.md"
    text = page.read_text() if page.exists() else "# What leaked\n"
    page.write_text(text.split(SECTION)[0].rstrip() + "\n\n" + "\n".join(md) + "\n")
    return True


def _interval(share: float | None, records: int) -> str | None:
    """95% Clopper-Pearson interval on the share of ``records`` recovered."""
    if share is None or not records:
        return None
    from scipy.stats import binomtest  # only for malicious-server cells (half a second)

    ci = binomtest(round(share * records), records).proportion_ci(0.95)
    return f"{ci.low:.2f}-{ci.high:.2f}"


def _model(cfg: Any) -> str:
    t = cfg.training
    return f"mlp {t.mlp_hidden}" if t.model == "mlp" else t.model


def _show(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    return _cell(x)
