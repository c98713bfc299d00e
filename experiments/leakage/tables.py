"""A sweep's membership and audit tables: every attack, its interval, and whether the
cell's DP claim survives what was measured.

``leakage_membership.csv`` has one row per cell, observed round (or observation) and
membership attack: AUC and TPR at 1% and 0.1% FPR, each with its 95% bootstrap interval,
the members and non-members scored, and "claim consistent?" (empty without DP).
``leakage_audit.csv`` has one row per audit line: the claimed epsilon and the three
estimators side by side (Steinke et al.'s one-run bound, Mahloujifar et al.'s f-DP bound,
the Gaussian-DP estimate). Both are appended to ``leakage.md`` as Markdown tables.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from privacy.attacks.registry import ATTACKS
from tasks.markdown import markdown_table

from .sweep import defence, setting

MEMBERSHIP = ("cell", "defence", "setting", "round", "client", "attack", "auc", "auc-ci95",
              "tpr-at-1%fpr", "tpr-at-1%fpr-ci95", "tpr-at-0.1%fpr", "tpr-at-0.1%fpr-ci95",
              "members", "nonmembers", "claim-epsilon", "claim-consistent")
AUDIT = ("cell", "defence", "setting", "round", "client", "scope", "canaries",
         "epsilon-claimed", "epsilon-lower-bound", "epsilon-lower-bound-fdp",
         "epsilon-estimate-gdp", "claim-consistent")


def _kind(attack: str) -> str | None:
    return ATTACKS.info(attack).scored_as if attack in ATTACKS else None


def attack_rows(cells: Sequence[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(membership rows, audit rows) of a sweep's finished, attacked cells."""
    from .sweep import _read_config

    members, audits = [], []
    for c in cells:
        path = None if c.run_dir is None else c.run_dir / "leakage.jsonl"
        if path is None or not path.exists():
            continue
        cfg = c.config if c.config is not None else _read_config(c.run_dir)
        base = {"cell": c.index, "defence": defence(cfg), "setting": setting(cfg)}
        for x in map(json.loads, path.read_text().splitlines()):
            if "skipped" in x:
                continue
            where = {**base, "round": x["round"], "client": x["client"]}
            if _kind(x["attack"]) == "membership":
                for variant, s in x.get("attacks", {}).items():
                    checks = x.get("claim-checks", {})
                    members.append({**where, "attack": f"{x['attack']}: {variant}", **s,
                                    "claim-epsilon": (x.get("claim") or {}).get("epsilon"),
                                    "claim-consistent": None if variant not in checks else
                                    not any(p["violated"] for p in checks[variant])})
            elif _kind(x["attack"]) == "audit":
                audits.append({**where, **{k: x.get(k) for k in AUDIT if k in x},
                               "scope": x.get("scope", "round")})
    return members, audits


def write_attack_tables(out: Path, cells: Sequence[Any]) -> bool:
    """leakage_membership.csv, leakage_audit.csv and their sections in leakage.md."""
    members, audits = attack_rows(cells)
    if not members and not audits:
        return False
    md = []
    for rows, columns, name, title, note in (
            (members, MEMBERSHIP, "leakage_membership.csv", "Membership inference",
             "Every membership attack on every observation (the loss drop is the baseline; "
             "decomposition, LiRA and RMIA are calibrated or white-box). Intervals: 95% "
             "bootstrap. TPR at an FPR needs at least 1/FPR non-members (else empty). "
             "claim-consistent: no measured point above the DP claim's curve (95%)."),
            (audits, AUDIT, "leakage_audit.csv", "Audits",
             "epsilon-lower-bound: Steinke et al. 2023; -fdp: Mahloujifar et al. 2024 "
             "(f-DP, one run); epsilon-estimate-gdp: Gaussian-DP estimation (Nasr et al. "
             "2023; an estimate that assumes independent canaries). scope 'run': the "
             "client's canaries over all its observed rounds.")):
        if not rows:
            continue
        with open(out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows({k: _cell(r.get(k)) for k in columns} for r in rows)
        shown = [c for c in columns if c != "setting"]
        md += ["", f"## {title}", "", note, "",
               *markdown_table(shown, [[_cell(r.get(c)) for c in shown] for r in rows])]
    page = out / "leakage.md"
    text = page.read_text() if page.exists() else "# What leaked\n"
    page.write_text(text.split("\n## Membership inference\n")[0].split("\n## Audits\n")[0]
                    .rstrip() + "\n" + "\n".join(md) + "\n")
    return True


def _cell(x: Any) -> str:
    if x is None:
        return ""
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 1e4 else f"{x:.3g}"
    if isinstance(x, (list, tuple)) and len(x) == 2:
        return f"{_cell(x[0])}-{_cell(x[1])}"
    return str(x)
