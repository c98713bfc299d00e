"""A sweep's leakage study: one table of what each defence let leak, and its plots.

For every cell that observed rounds (``leakage-rounds``), one row per observed round:
the run's final accuracy, the epsilon its accountant claims at that round, the epsilon
the audit proves at least, and the attacks' scores (means over the observed clients).
Written as ``leakage.csv`` and ``leakage.md`` beside the sweep's table, with
``plots/psnr_vs_epsilon.png``, ``plots/accuracy_vs_psnr.png`` (Pareto front),
``plots/roc_by_defence.png`` and ``plots/reconstructions.png``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from tasks.config import RunConfig
from tasks.markdown import markdown_table
from tasks.results.ledger import headline_epsilon, read_ledger
from tasks.results.plots import label_points, place_legend, save_figure

from ..sweep.outcome import named, trouble
from ..sweep.pareto import pareto_front
from .roc import RocCurve, draw_roc
from .spread import pooled, pooled_markdown, row_spread, sweep_spread_plots

COLUMNS = ("cell", "defence", "setting", "round", "accuracy", "epsilon-claimed",
           "epsilon-audited", "psnr", "psnr-ci95", "inverted", "ssim", "psnr-random",
           "label-accuracy", "mia-auc",
           "mia-auc-ci95", "mia-members", "tpr-at-1%fpr", "tpr-at-0.1%fpr", "mia-attack",
           "note", "run-dir")


def defence(cfg: RunConfig) -> str:
    """A short name for what protects the observed client's update in a run."""
    parts = []
    p = cfg.privacy
    if p.dp == "local":
        parts.append(f"local DP-SGD (sigma {p.noise_multiplier:g})" if not p.target_epsilon
                     else f"local DP-SGD (eps {p.target_epsilon:g})")
    elif p.dp == "central":
        parts.append(f"central DP (z {p.noise_multiplier:g}, S {p.clipping_norm:g})")
    if cfg.secagg.enabled:
        parts.append("SecAgg+" if cfg.secagg.protocol == "secagg+" else "HE (CKKS)")
    if cfg.leakage.prune_update:
        parts.append(f"pruning {cfg.leakage.prune_update:.0%}")
    if cfg.privacy.client_screen != "none":
        parts.append(f"client screen ({cfg.privacy.client_screen})")
    if cfg.anonymization.enabled:
        what = "embeddings" if cfg.embeddings.enabled else "inputs"
        parts.append(f"{what}: {cfg.anonymization.anonymizer}")
    elif cfg.embeddings.enabled:
        parts.append("embeddings")
    return " + ".join(parts) or "none"


def setting(cfg: RunConfig) -> str:
    """What the observed client trained on: examples, batch size and local epochs."""
    lk, t = cfg.leakage, cfg.training
    n = f"{lk.observed_examples} ex" if lk.observed_examples else "all ex"
    return f"{n}, batch {t.batch_size}, {t.local_epochs} ep"


def rows_for(index: int, cfg: RunConfig, run_dir: Path, accuracy: float | None,
             group: str | None = None) -> list[dict[str, Any]]:
    """The leakage table's rows of one finished cell (none if nothing was attacked);
    ``group``: the cell without its seed (rows of one group are pooled over seeds)."""
    path = run_dir / "leakage.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    ledger = {r.round: r for r in read_ledger(run_dir)}
    rows = []
    for rnd in sorted({x["round"] for x in lines}):
        mine = [x for x in lines if x["round"] == rnd and "skipped" not in x]
        skipped = [x["skipped"] for x in lines if x["round"] == rnd and "skipped" in x]
        record = ledger.get(rnd)

        def mean(attack: str, key: str, mine: list = mine) -> float | None:
            vals = [x[key] for x in mine if x["attack"] == attack and x.get(key) is not None]
            return float(np.mean(vals)) if vals else None

        audits = [x for x in mine if x["attack"] == "audit"]
        mias = [x for x in mine if x["attack"] == "mia"]
        rows.append({
            "cell": index, "defence": defence(cfg), "setting": setting(cfg), "round": rnd,
            "accuracy": accuracy,
            # with an audit, the epsilon it is bounded by (the audited client's, and for
            # central DP record-level); else the ledger's headline epsilon
            "epsilon-claimed": audits[0].get("epsilon-claimed") if audits
            else headline_epsilon(record.privacy) if record else None,
            "epsilon-audited": max(x["epsilon-lower-bound"] for x in audits) if audits
            else None,
            "psnr": mean("invert", "psnr"), "ssim": mean("invert", "ssim"),
            "psnr-random": mean("invert", "psnr-random"),
            "label-accuracy": mean("labels", "label-accuracy"),
            "mia-auc": mean("mia", "auc"), "mia-members": _int(mean("mia", "members")),
            "tpr-at-1%fpr": mean("mia", "tpr-at-1%fpr"),
            "tpr-at-0.1%fpr": mean("mia", "tpr-at-0.1%fpr"),
            "mia-auc-ci95": "{:.2f}-{:.2f}".format(*mias[0]["auc-ci95"])
            if len(mias) == 1 and "auc-ci95" in mias[0] else None,
            "mia-attack": mias[0].get("attack-used") if mias else None,
            "note": None if mine or not skipped else f"not attacked: {skipped[0]}",
            "run-dir": str(run_dir), "group": group, **row_spread(mine)})
    return rows


def sweep_rows(cells: Sequence[Any]) -> list[dict[str, Any]]:
    """The leakage rows of a sweep's finished cells (``Cell`` objects of the sweep)."""
    rows = []
    for c in cells:
        if c.run_dir is None or not (c.run_dir / "leakage.jsonl").exists():
            continue
        cfg = c.config if c.config is not None else _read_config(c.run_dir)
        why = trouble(c)
        for row in rows_for(c.index, cfg, c.run_dir,
                            (c.result.get("final") or {}).get("accuracy"), c.group):
            row["trouble"] = why  # what became of the cell: said in every plot's legend
            if why and not row["note"]:
                row["note"] = f"cell {why}"
            rows.append(row)
    return rows


def _read_config(run_dir: Path) -> RunConfig:
    import tomllib

    from tasks.config import validate

    with open(run_dir / "config.toml", "rb") as f:
        return validate(tomllib.load(f))


def write_leakage_table(out: Path, rows: Sequence[dict[str, Any]]) -> None:
    """leakage.csv and leakage.md."""
    with open(out / "leakage.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows({k: _cell(r.get(k)) for k in COLUMNS} for r in rows)
    shown = [c for c in COLUMNS if c not in ("run-dir", "psnr-random", "tpr-at-0.1%fpr")]
    md = ["# What leaked", "",
          "One row per cell and observed round. epsilon-claimed: the accountant's epsilon "
          "at that round (local: the largest over clients; central: client-level; in "
          "audited cells, what the audit is bounded by: the audited client's epsilon, "
          "record-level for central DP); epsilon-audited: the one-run audit's lower bound "
          "(95% confidence, jointly over the cell's audited rounds); PSNR/SSIM: "
          "Inverting Gradients' reconstructions of the observed client's examples; MIA: "
          "the loss-drop membership attack (fixed in advance), its AUC and TPR at 1% FPR. "
          "Empty: not "
          "measured in that cell.", "",
          *markdown_table(shown, [[_cell(r.get(c)) for c in shown] for r in rows])]
    md += ["", "![PSNR vs epsilon](plots/psnr_vs_epsilon.png)", "",
           "![accuracy vs PSNR](plots/accuracy_vs_psnr.png)", "",
           "![ROC per defence](plots/roc_by_defence.png)", "",
           "![reconstructions](plots/reconstructions.png)", ""]
    md += pooled_markdown(pooled(rows))
    (out / "leakage.md").write_text("\n".join(md))


def _int(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def _cell(x: Any) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 1e4 else f"{x:.3g}"
    return str(x)


def _label(row: dict[str, Any]) -> str:
    """A row's legend label, with what became of its cell when it failed or diverged."""
    return named(f"{row['defence']} · {row['setting']} · r{row['round']}",
                 row.get("trouble"), 90)


def leakage_plots(out: Path, name: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """The study's plots (those with data to show); returns their file names."""
    out.mkdir(parents=True, exist_ok=True)
    drawn = []
    inverted = [r for r in rows if r["psnr"] is not None]
    if inverted:
        drawn += [_psnr_vs_epsilon(out, name, inverted), _accuracy_vs_psnr(out, name, inverted)]
    roc = _roc_by_defence(out, name, rows)
    if roc:
        drawn.append(roc)
    grids = _reconstructions(out, name, inverted)
    if grids:
        drawn.append(grids)
    return drawn + sweep_spread_plots(out, name, pooled(inverted))


def _psnr_vs_epsilon(out: Path, name: str, rows: Sequence[dict[str, Any]]) -> str:
    """Local DP's PSNR against its epsilon, one line per update shape and round, with the
    undefended and other non-DP cells of the same shape and round as dashed levels."""
    rows = [r for r in rows if r["psnr-random"] is not None]  # images only (dB comparable)
    fig = Figure(figsize=(8.5, 4.6), layout="constrained")
    ax = fig.subplots()
    cmap = colormaps["tab10"]
    styles = ["--", "-.", ":", (0, (5, 1))]
    for i, (setting, rnd) in enumerate(sorted({(r["setting"], r["round"]) for r in rows})):
        mine = [r for r in rows if r["setting"] == setting and r["round"] == rnd]
        color = cmap(i % 10)
        local = [r for r in mine
                 if r["epsilon-claimed"] is not None and r["defence"].startswith("local")]
        pts = sorted((r["epsilon-claimed"], r["psnr"]) for r in local if not r.get("trouble"))
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", color=color,
                    label=f"local DP-SGD · {setting} · round {rnd}")
        for r in (r for r in local if r.get("trouble")):  # on no line: a marked cross
            ax.plot([r["epsilon-claimed"]], [r["psnr"]], "x", color="tab:red",
                    label=_label(r))
        others = [r for r in mine if r["epsilon-claimed"] is None and not r.get("trouble")]
        for j, r in enumerate(others):
            ax.axhline(r["psnr"], ls=styles[j % len(styles)], lw=0.9, color=color,
                       label=f"{r['defence']} · {setting} · round {rnd}")
        for r in (r for r in mine if r["epsilon-claimed"] is None and r.get("trouble")):
            ax.plot([], [], "x", color="tab:red", label=_label(r) + "; not drawn")
    ax.axhline(float(np.mean([r["psnr-random"] for r in rows])), color="gray", lw=1.5,
               label="random images")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon claimed at the observed round (log)")
    ax.set_ylabel("reconstruction PSNR (dB)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"gradient inversion vs privacy budget — sweep {name}", fontsize=10)
    save_figure(fig, out / "psnr_vs_epsilon.png", bbox_inches=None)
    return "psnr_vs_epsilon.png"


def _accuracy_vs_psnr(out: Path, name: str, rows: Sequence[dict[str, Any]]) -> str:
    """Each image cell once: its final accuracy against the PSNR at its first observed
    round (the untrained model, where inversion is strongest)."""
    first: dict[Any, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["round"]):
        if r["accuracy"] is not None and r["psnr-random"] is not None:
            first.setdefault(r["cell"], r)
    rows = list(first.values())
    fig = Figure(figsize=(7.0, 4.6))
    ax = fig.subplots()
    sound = [r for r in rows if not r.get("trouble")]
    defences = sorted({r["defence"] for r in sound})
    cmap = colormaps["tab10"]
    for i, d in enumerate(defences):
        mine = [r for r in sound if r["defence"] == d]
        ax.scatter([r["psnr"] for r in mine], [r["accuracy"] for r in mine], color=cmap(i % 10),
                   label=d, zorder=3, s=24)
    for r in (r for r in rows if r.get("trouble")):  # its accuracy is not its settings'
        ax.scatter([r["psnr"]], [r["accuracy"]], color="tab:red", marker="x", zorder=3,
                   s=30, label=named(r["defence"], r["trouble"]) + "; not on the front")
    points = [(r["psnr"], r["accuracy"]) for r in sound]
    front = [sound[i] for i in pareto_front(points)]
    ax.step([r["psnr"] for r in front], [r["accuracy"] for r in front], where="post",
            color="black", lw=0.8, label="Pareto front (less leakage, more accuracy)")
    label_points(ax, [(r["setting"], (r["psnr"], r["accuracy"])) for r in front])
    ax.set_xlabel("reconstruction PSNR at the first observed round (dB; lower = less "
                  "leaked)")
    ax.set_ylabel("final test accuracy")
    ax.grid(alpha=0.3)
    place_legend(ax, fontsize=6)
    ax.set_title(f"accuracy vs leakage — sweep {name}", fontsize=10)
    save_figure(fig, out / "accuracy_vs_psnr.png")
    return "accuracy_vs_psnr.png"


def _roc_by_defence(out: Path, name: str, rows: Sequence[dict[str, Any]]) -> str | None:
    """The headline attack's ROC per cell and round; when some cells score 100 members or
    more, only those (a curve from a few members is a staircase that says little)."""
    enough = [r for r in rows if (r.get("mia-members") or 0) >= 100]
    curves = []
    for r in enough or rows:
        path = Path(r["run-dir"]) / "leakage.jsonl"
        for x in map(json.loads, path.read_text().splitlines()):
            if x["attack"] == "mia" and x["round"] == r["round"] and "roc-curve" in x:
                curves.append((_label(r), x))
                break
    if not curves:
        return None
    fig = Figure(figsize=(9.0, 5.2), layout="constrained")
    ax = fig.subplots()
    draw_roc(ax, [RocCurve(f"{label} ({x.get('attack-used')}, AUC {x['auc']:.2f})",
                           x["roc-curve"]["fpr"], x["roc-curve"]["tpr"],
                           _sample(x, "members", "tpr"), _sample(x, "nonmembers", "fpr"))
                  for label, x in curves], colors=colormaps["tab20"])
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"membership inference per defence (loss drop) — sweep {name}",
                 fontsize=9)
    save_figure(fig, out / "roc_by_defence.png")
    return "roc_by_defence.png"


def _sample(line: dict[str, Any], key: str, rate: str) -> int:
    """How many members (non-members) a membership line scored; for a line written before
    it said so, what its curve's smallest non-zero rate implies."""
    if line.get(key):
        return int(line[key])
    steps = [v for v in line["roc-curve"][rate] if v > 0]
    return max(1, round(1 / min(steps))) if steps else 1


def _reconstructions(out: Path, name: str, rows: Sequence[dict[str, Any]],
                     per_row: int = 8, file: str = "reconstructions.png",
                     attack: str = "invert",
                     title: str = "reconstructions per defence (Inverting Gradients)"
                     ) -> str | None:
    """For each cell and observed round, originals above ``attack``'s reconstructions."""
    pictures = []
    for r in rows:
        lines = Path(r["run-dir"]) / "leakage.jsonl"
        for x in map(json.loads, lines.read_text().splitlines() if lines.exists() else []):
            if x["attack"] == attack and x["round"] == r["round"] and x.get("pixels"):
                with np.load(Path(r["run-dir"]) / x["pixels"]) as f:
                    pictures.append((_label(r), f["original"][:per_row],
                                     f["reconstruction"][:per_row], x["psnr"]))
                break
    if not pictures:
        return None
    cols = max(len(p[1]) for p in pictures)
    fig = Figure(figsize=(0.9 * cols + 0.6, 2.0 * len(pictures) + 0.4), layout="constrained")
    for sub, (label, original, recon, psnr) in zip(fig.subfigures(len(pictures), 1,
                                                                  squeeze=False)[:, 0],
                                                   pictures, strict=True):
        axes = sub.subplots(2, cols, squeeze=False)
        for row, images in ((0, original), (1, recon)):
            for j in range(cols):
                ax = axes[row, j]
                ax.set_xticks([])
                ax.set_yticks([])
                if j >= len(images):
                    ax.set_axis_off()
                    continue
                img = np.moveaxis(images[j], 0, -1)
                ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray", vmin=0,
                          vmax=1)
        axes[0, 0].set_ylabel("original", fontsize=7)
        axes[1, 0].set_ylabel(f"{psnr:.1f} dB", fontsize=7)
        sub.suptitle(label, fontsize=8, x=0.01, ha="left")
    fig.suptitle(f"{title} — sweep {name}", fontsize=10)
    save_figure(fig, out / file, vector=False, bbox_inches=None)  # an image grid
    return file
