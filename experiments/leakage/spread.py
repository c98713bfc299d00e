"""Reconstruction judged over many updates: the mean with a 95% interval, n, and the
per-update spread, in a run (many observed clients) and across a sweep's seeds.

The unit is one observed update: its reconstruction's PSNR (SSIM) is the mean over the
images it was made from, and the interval is Student's t interval for the mean of the
updates (``scipy.stats.t.interval``'s: :func:`experiments.sweep.stats.t_half_width`), as
gradient-inversion papers report their averages over many images (Geiping et al. 2020
over 100 images).
A single update has no interval: it is reported with n = 1 and says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from tasks.results.plots import place_legend, save_figure

from ..sweep.stats import t_half_width

LEVEL = 0.95


def mean_interval(values: Sequence[float], level: float = LEVEL) -> dict[str, Any]:
    """Mean, ``level`` t interval ([lo, hi], None for fewer than two values), n, standard
    deviation, min and max of the finite ``values``."""
    xs = np.array([float(v) for v in values if v is not None and np.isfinite(float(v))])
    if len(xs) == 0:
        return {"mean": None, "ci95": None, "n": 0, "sd": None, "min": None, "max": None}
    mean = float(xs.mean())
    ci = None
    if len(xs) >= 2:
        half = t_half_width(float(xs.std(ddof=1)) / np.sqrt(len(xs)), len(xs), level)
        ci = [mean - half, mean + half]
    return {"mean": mean, "ci95": ci, "n": int(len(xs)),
            "sd": float(xs.std(ddof=1)) if len(xs) >= 2 else None,
            "min": float(xs.min()), "max": float(xs.max())}


def reconstruction_spread(done: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The summary's spread keys for one reconstruction attack's scored lines: ``n``
    (updates), ``psnr-ci95``/``ssim-ci95`` ([lo, hi] or None), ``psnr-sd``,
    ``psnr-min``/``psnr-max`` and every update's PSNR (``psnr-per-update``)."""
    psnr = mean_interval([x["psnr"] for x in done if x.get("psnr") is not None])
    out: dict[str, Any] = {"n": psnr["n"], "psnr-ci95": psnr["ci95"], "psnr-sd": psnr["sd"],
                           "psnr-min": psnr["min"], "psnr-max": psnr["max"],
                           "psnr-per-update": [float(x["psnr"]) for x in done
                                               if x.get("psnr") is not None]}
    if any(x.get("ssim") is not None for x in done):
        out["ssim-ci95"] = mean_interval([x["ssim"] for x in done
                                          if x.get("ssim") is not None])["ci95"]
    return out


def fmt(mean: float | None, ci: Sequence[float] | None, n: int, unit: str = "",
        digits: int = 1) -> str:
    """'27.3 dB (95% CI 25.1-29.5, n = 20)', or the mean alone with 'n = 1'."""
    if mean is None:
        return ""
    head = f"{mean:.{digits}f}{unit}"
    if ci is None:
        return f"{head} (n = {n}: no interval)"
    return f"{head} (95% CI {ci[0]:.{digits}f}-{ci[1]:.{digits}f}, n = {n})"


def describe(s: dict[str, Any]) -> str:
    """summary.md's reconstruction line: the mean with its interval, n and the range."""
    n = s.get("n", 1)
    text = "PSNR **" + fmt(s["psnr"], s.get("psnr-ci95"), n, " dB") + "**"
    if n > 1 and s.get("psnr-min") is not None:
        text += f", per update {s['psnr-min']:.1f}-{s['psnr-max']:.1f} dB"
    if "ssim" in s:
        text += ", SSIM " + fmt(s["ssim"], s.get("ssim-ci95"), n, digits=3)
    return text


# --------------------------------------------------------------------------- plots


def _strip(path: Path, groups: Sequence[tuple[str, Sequence[float]]], title: str,
           random_level: float | None = None) -> Path:
    """A box plot per group with every value drawn over it (jittered), and the mean with
    its 95% interval beside it."""
    fig = Figure(figsize=(max(4.5, 1.6 * len(groups) + 2.0), 4.2), layout="constrained")
    ax = fig.subplots()
    ax.boxplot([list(v) for _, v in groups], showfliers=False, widths=0.5)
    jitter = np.random.default_rng(0)  # only where the dots are drawn
    for i, (_, values) in enumerate(groups, start=1):
        ax.scatter(i + jitter.uniform(-0.12, 0.12, len(values)), values, s=14, alpha=0.7,
                   zorder=3)
        m = mean_interval(values)
        if m["ci95"] is not None:
            ax.errorbar(i + 0.32, m["mean"], yerr=[[m["mean"] - m["ci95"][0]],
                                                   [m["ci95"][1] - m["mean"]]],
                        fmt="D", color="black", capsize=3, ms=4,
                        label="mean, 95% interval" if i == 1 else None)
    if random_level is not None:
        ax.axhline(random_level, color="gray", ls="--", lw=1, label="random images")
    place_legend(ax, fontsize=7)
    ax.set_xticks(range(1, len(groups) + 1),
                  [f"{label}\n(n = {len(v)})" for label, v in groups], fontsize=7)
    ax.set_ylabel("reconstruction PSNR per update (dB)")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, bbox_inches=None)
    return path


def _grid(path: Path, pictures: Sequence[tuple[str, np.ndarray, np.ndarray]], title: str,
          per_row: int = 10) -> Path:
    """Every update's originals above their reconstructions, ``per_row`` images a row;
    ``pictures``: (caption, originals, reconstructions) per update, pixels (n, C, H, W)."""
    images = [(f"{cap}" if len(o) == 1 else f"{cap} #{k}", o[k], r[k])
              for cap, o, r in pictures for k in range(len(o))]
    rows = -(-len(images) // per_row)
    cols = min(per_row, len(images))
    fig = Figure(figsize=(0.95 * cols + 0.4, 2.05 * rows + 0.4), layout="constrained")
    axes = fig.subplots(2 * rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_axis_off()
    for i, (cap, original, recon) in enumerate(images):
        r, c = divmod(i, per_row)
        for k, img in enumerate((original, recon)):
            ax = axes[2 * r + k, c]
            ax.set_axis_on()
            pic = np.moveaxis(img, 0, -1)
            ax.imshow(pic[..., 0] if pic.shape[-1] == 1 else pic, cmap="gray", vmin=0, vmax=1)
        axes[2 * r + 1, c].set_xlabel(cap, fontsize=6)
    fig.suptitle(title + " (each pair: original above, reconstruction below)", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, vector=False, bbox_inches=None)  # an image grid
    return path


def _pictures(run_dir: Path, lines: Sequence[dict[str, Any]], prefix: str = ""
              ) -> list[tuple[str, np.ndarray, np.ndarray]]:
    out = []
    for x in sorted(lines, key=lambda x: (x["round"], str(x["client"]).zfill(9))):
        if x.get("pixels") and (run_dir / x["pixels"]).is_file():
            with np.load(run_dir / x["pixels"]) as f:
                out.append((f"{prefix}c{x['client']} r{x['round']}: {x['psnr']:.1f} dB",
                            f["original"], f["reconstruction"]))
    return out


def run_spread_plots(run_dir: Path, lines: Sequence[dict[str, Any]]) -> list[Path]:
    """For each reconstruction attack with two or more scored updates in a run: the
    per-update PSNR spread per round (``plots/leakage/<attack>-spread.png``) and every
    original beside its reconstruction (``plots/leakage/<attack>-all.png``)."""
    drawn = []
    for attack in dict.fromkeys(x["attack"] for x in lines):
        done = [x for x in lines if x["attack"] == attack and "skipped" not in x
                and x.get("psnr") is not None and "psnr-random" in x]
        if len(done) < 2:
            continue
        rounds = sorted({x["round"] for x in done})
        groups = [(f"round {r}", [x["psnr"] for x in done if x["round"] == r])
                  for r in rounds]
        out = run_dir / "plots" / "leakage"
        drawn.append(_strip(out / f"{attack}-spread.png", groups,
                            f"{attack}: PSNR of every observed update",
                            float(np.mean([x["psnr-random"] for x in done]))))
        pictures = _pictures(run_dir, done)
        if pictures:
            drawn.append(_grid(out / f"{attack}-all.png", pictures,
                               f"{attack}: every observed update"))
    return drawn


# --------------------------------------------------------------------------- sweeps


def row_spread(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A sweep row's reconstruction keys from its round's Inverting Gradients lines."""
    done = [x for x in lines if x["attack"] == "invert" and x.get("psnr") is not None]
    s = reconstruction_spread(done)
    ci = s["psnr-ci95"]
    return {"inverted": s["n"] or None,
            "psnr-ci95": None if ci is None else f"{ci[0]:.1f}-{ci[1]:.1f}",
            "psnr-values": s["psnr-per-update"],
            "ssim-values": [float(x["ssim"]) for x in done if x.get("ssim") is not None],
            "inverted-lines": done}


def pooled(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the same cell (``group``: the cell without its seed) and round, their
    updates pooled: PSNR and SSIM as mean, 95% interval and n over every update. None
    when no cell and round has two or more updates (nothing to spread: the leakage
    table's row says it all)."""
    keys: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("psnr-values"):
            keys.setdefault((r.get("group") or str(r["cell"]), r["round"]), []).append(r)
    out = []
    for (group, rnd), mine in keys.items():
        psnr = mean_interval([v for r in mine for v in r["psnr-values"]])
        ssim = mean_interval([v for r in mine for v in r.get("ssim-values", [])])
        out.append({"defence": mine[0]["defence"], "setting": mine[0]["setting"],
                    "group": group, "round": rnd, "runs": len(mine), "updates": psnr["n"],
                    "psnr": psnr, "ssim": ssim, "rows": mine})
    return out if any(p["updates"] >= 2 for p in out) else []


def pooled_markdown(pools: Sequence[dict[str, Any]]) -> list[str]:
    """leakage.md's section: reconstruction as mean with 95% interval per cell and round."""
    if not pools:
        return []
    md = ["## Reconstruction over many updates", "",
          "Per cell and observed round, every inverted update pooled (over the observed "
          "clients and the sweep's seeds): PSNR and SSIM as mean with Student's t 95% "
          "interval over the updates, n = updates; the range is per update. Spread: "
          "[plots/psnr_spread.png](plots/psnr_spread.png); every reconstruction: "
          "[plots/reconstructions_all.png](plots/reconstructions_all.png).", "",
          "| defence | setting | round | runs | n updates | PSNR (dB) | PSNR range | SSIM |",
          "|---|---|---:|---:|---:|---|---|---|"]
    for p in pools:
        s, q = p["psnr"], p["ssim"]
        md.append(f"| {p['defence']} | {p['setting']} | {p['round']} | {p['runs']} | "
                  f"{p['updates']} | {fmt(s['mean'], s['ci95'], s['n'])} | "
                  f"{s['min']:.1f}-{s['max']:.1f} | "
                  f"{fmt(q['mean'], q['ci95'], q['n'], digits=3)} |")
    return md + [""]


def sweep_spread_plots(out: Path, name: str, pools: Sequence[dict[str, Any]]) -> list[str]:
    """``psnr_spread.png`` (per-update PSNR per cell and round) and
    ``reconstructions_all.png`` (every update's originals and reconstructions)."""
    if not pools:
        return []
    groups = [(f"{p['defence']}\n{p['setting']}, r{p['round']}", [v for r in p["rows"]
                                                                   for v in r["psnr-values"]])
              for p in pools]
    _strip(out / "psnr_spread.png", groups, f"PSNR of every inverted update — sweep {name}")
    pictures = []
    for i, p in enumerate(pools):
        for r in p["rows"]:
            pictures += _pictures(Path(r["run-dir"]), r["inverted-lines"], prefix=f"[{i + 1}] ")
    if not pictures:
        return ["psnr_spread.png"]
    _grid(out / "reconstructions_all.png", pictures,
          f"every inverted update — sweep {name}; [k]: the k-th row of the pooled table")
    return ["psnr_spread.png", "reconstructions_all.png"]


def read_lines(run_dir: Path) -> list[dict[str, Any]]:
    """A run's leakage.jsonl."""
    path = run_dir / "leakage.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
