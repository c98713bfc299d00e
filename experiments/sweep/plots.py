"""Comparison plots across the cells of a sweep."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from tasks.config import ConfigError, RunConfig, validate
from tasks.results.folder import read_run_info, run_settings
from tasks.results.ledger import headline_epsilon, read_ledger
from tasks.results.plots import (
    integer_rounds,
    label_points,
    line_plot,
    place_legend,
    save_figure,
    shorten,
    wrap_title,
)

from ..leakage.sweep import leakage_plots, sweep_rows
from .memorization import exposure_plots
from .outcome import named, trouble
from .pareto import pareto_front
from .stats import mean_ci
from .styles import factor_styles
from .tradeoff import tradeoff_plot


def sweep_plots(out: Path, name: str, cells: Sequence[Any]) -> dict[str, Figure]:
    """accuracy_vs_round, final_accuracy and, when cells used DP, privacy_accuracy and
    epsilon_vs_round (and privacy_accuracy_lines when settings were run at several privacy
    levels; and the anonymization and leakage plots); returns the accuracy,
    privacy and anonymization figures by file name."""
    out.mkdir(parents=True, exist_ok=True)
    ledgers = {c.label: ledger for c in cells
               if c.run_dir and (ledger := read_ledger(c.run_dir))}
    groups: dict[str, list[Any]] = {}
    for c in cells:
        groups.setdefault(c.group, []).append(c)
    title = sweep_title(name, cells)
    if any(c.seed is not None for c in cells):
        figs = _seed_plots(title, groups, ledgers)
    else:
        figs = _accuracy_plots(title, cells, ledgers)
    figs |= _anonymization_plots(title, cells)
    figs |= _privacy_plots(title, cells, ledgers)
    figs |= tradeoff_plot(title, cells)
    figs |= exposure_plots(title, cells)
    for file, fig in figs.items():  # a full disk: WriteFailed, no half-written file
        save_figure(fig, out / file)
    leaked = sweep_rows(cells)
    if leaked:
        leakage_plots(out, name, leaked)
    return figs


def _config(cell: Any) -> RunConfig | None:
    """The cell's config: given, or read back from its run folder (--replot)."""
    if cell.config is not None:
        return cell.config
    try:
        with open(Path(cell.run_dir) / "config.toml", "rb") as f:
            return validate(tomllib.load(f))
    except (OSError, TypeError, tomllib.TOMLDecodeError, ConfigError):
        return None


def sweep_title(name: str, cells: Sequence[Any]) -> str:
    """'sweep NAME · mnist · fedavg · Dirichlet α=0.3 · ...': the settings every cell
    shares (what varies is in the legend)."""
    configs = [cfg for c in cells if (cfg := _config(c)) is not None]
    if not configs:
        return f"sweep {name}"
    pieces = [[cfg.data.dataset, cfg.federation.strategy, *(t for _, t in run_settings(cfg))]
              for cfg in configs]
    common = [p for p in pieces[0] if all(p in other for other in pieces[1:])]
    return " \u00b7 ".join([f"sweep {name}", *common])


def _initial(cell: Any) -> float | None:
    """The accuracy of the model the cell's run started from (round 0), from its run.json."""
    if not cell.run_dir:
        return None
    try:
        value = (read_run_info(cell.run_dir).get("initial") or {}).get("accuracy")
    except ConfigError:  # a damaged run.json: that cell's curve starts at round 1
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _curves(cells: Sequence[Any], ledgers: dict[str, list[Any]], value: Any,
            start: Any = None
            ) -> tuple[dict[str, tuple[list[int], list[Any]]], dict[str, dict[str, Any]]]:
    """One series per cell with a ledger (``value`` of each record; ``start(cell)`` its
    round-0 value, when there is one), styled by the sweep's factors, and labelled with
    what became of a cell that failed or diverged (drawn dotted, with crosses)."""
    series, styles = {}, {}
    factors = factor_styles({c.label: c.params for c in cells if c.label in ledgers})
    for c in cells:
        if c.label not in ledgers:
            continue
        why = trouble(c)
        label = named(c.label, why)
        first = start(c) if start is not None else None
        series[label] = ([*([0] if first is not None else []), *(r.round for r in
                                                                  ledgers[c.label])],
                         [*([first] if first is not None else []),
                          *(value(r) for r in ledgers[c.label])])
        styles[label] = dict(factors.get(c.label, {}))
        if why is not None:
            styles[label].update({"ls": ":", "marker": "x"})
    return series, styles


def _accuracy_plots(title: str, cells: Sequence[Any], ledgers: dict[str, list[Any]]
                    ) -> dict[str, Figure]:
    """One run per cell: accuracy per round, and each cell's final accuracy as a bar (red,
    and saying so, for a cell that failed or diverged)."""
    series, styles = _curves(cells, ledgers, lambda r: r.accuracy, _initial)
    figs = {"accuracy_vs_round.png": line_plot(None, series, "round", "test accuracy", title,
                                               ylim=(0.0, 1.0), styles=styles)}
    fig = Figure(figsize=(7.0, 0.35 * max(len(cells), 3) + 1.2))
    ax = fig.subplots()
    values = [c.result.get("final", {}).get("accuracy", 0.0) for c in cells]
    colors = ["tab:blue" if trouble(c) is None else "tab:red" for c in cells]
    ax.barh(range(len(cells)), values, color=colors)
    ax.set_yticks(range(len(cells)), [named(c.label, trouble(c), 80) for c in cells],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    unfinished = sum(c.status != "finished" for c in cells)
    diverged = sum(c.status == "finished" and trouble(c) is not None for c in cells)
    red = [f"{unfinished} cell(s) did not finish" if unfinished else "",
           f"{diverged} cell(s) diverged" if diverged else ""]
    ax.set_xlabel("final test accuracy" + (f" (red: {', '.join(filter(None, red))})"
                                           if unfinished or diverged else ""))
    ax.set_title(wrap_title(title), fontsize=10)
    for i, v in enumerate(values):
        ax.text(min(v, 0.9) + 0.01, i, f"{v:.3f}", va="center", fontsize=7)
    figs["final_accuracy.png"] = fig
    return figs


def _privacy_plots(title: str, cells: Sequence[Any], ledgers: dict[str, list[Any]]
                   ) -> dict[str, Figure]:
    """When cells used DP: final accuracy against epsilon spent (the trade-off line and the
    no-DP baselines from sound cells only; a cell that failed or diverged is a red cross, or
    a legend entry when it has no point, saying what became of it), and epsilon per
    round."""
    private = [(c, headline_epsilon(c.result.get("privacy"))) for c in cells]
    drawn = [(c, eps) for c, eps in private if eps is not None and c.result.get("final")]
    if not drawn:
        return {}
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    points = sorted((eps, c.result["final"]["accuracy"], c.label) for c, eps in drawn
                    if trouble(c) is None)
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color="tab:blue",
                label="with DP (epsilon spent)")
    for c, eps in drawn:
        if (why := trouble(c)) is not None:
            ax.plot([eps], [c.result["final"]["accuracy"]], ls="none", marker="x", ms=8,
                    color="tab:red", label=named(f"DP ({c.label})", why))
    styles = ["--", "-.", ":", (0, (5, 1))]
    plain = [c for c, eps in private if eps is None and _without_dp(c)]
    for i, c in enumerate(p for p in plain if trouble(p) is None and p.result.get("final")):
        ax.axhline(c.result["final"]["accuracy"], ls=styles[i % len(styles)], color="gray",
                   label=shorten(f"no DP ({c.label})"))
    for c in plain:  # never a baseline: named in the legend, not drawn
        if (why := trouble(c)) is not None:
            ax.plot([], [], ls="none", marker="x", color="tab:red",
                    label=named(f"no DP ({c.label})", f"{why}; not drawn"))
    for c, eps in private:  # a DP cell that failed before it spent anything
        if eps is None and not _without_dp(c) and (why := trouble(c)) is not None:
            ax.plot([], [], ls="none", marker="x", color="tab:red",
                    label=named(f"DP ({c.label})", f"{why}; not drawn"))
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    label_points(ax, [(label, (eps, acc)) for eps, acc, label in points])
    ax.set_xlabel("epsilon spent (local: max over clients; central: client-level)")
    ax.set_ylabel("final test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, which="both")
    place_legend(ax, fontsize=7)
    ax.set_title("privacy-accuracy trade-off\n" + wrap_title(title), fontsize=10)
    series, styles = _curves(cells, ledgers, lambda r: headline_epsilon(r.privacy),
                             lambda c: 0.0 if headline_epsilon(c.result.get("privacy"))
                             is not None else None)  # no DP: no epsilon, not even at 0
    curves = {}
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if pts:
            curves[label] = ([x for x, _ in pts], [y for _, y in pts])
    return {"privacy_accuracy.png": fig,
            "epsilon_vs_round.png": line_plot(None, curves, "round", "cumulative epsilon",
                                              title, ylim=(0.0, None), styles=styles)}


def _without_dp(cell: Any) -> bool:
    """Whether the cell ran (or was to run) without DP: its config says so, or, without
    one, it recorded no privacy mode."""
    cfg = _config(cell)
    if cfg is not None:
        return cfg.privacy.dp == "none"
    return (cell.result.get("privacy") or {}).get("mode", "none") == "none"


def _seed_plots(title: str, groups: dict[str, list[Any]], ledgers: dict[str, list[Any]]
                ) -> dict[str, Figure]:
    """Over seeds: the mean accuracy per round with its 95% interval shaded, and the mean
    final accuracy with its interval and each seed's value."""
    fig = Figure(figsize=(6.8, 4.2))
    ax = fig.subplots()
    factors = factor_styles({g: runs[0].params for g, runs in groups.items()})
    for group, runs in groups.items():
        kept = [c for c in runs if c.label in ledgers and trouble(c) is None]
        curves = [[(0, first)] if (first := _initial(c)) is not None else []
                  for c in kept]  # round 0: the model each seed started from
        curves = [[*start, *((r.round, r.accuracy) for r in ledgers[c.label])]
                  for start, c in zip(curves, kept, strict=True)]
        rounds = sorted({k for curve in curves for k, _ in curve})
        left = _left_out(runs)
        if not rounds:
            if any(c.label in ledgers for c in runs):  # its seeds' rounds are all left out
                ax.plot([], [], ls="none", marker="x", color="tab:red",
                        label=named(group, f"n=0; {left}"))
            continue
        stats = [mean_ci([a for curve in curves for k2, a in curve if k2 == k])
                 for k in rounds]
        mean = [m for m, _ in stats]
        half = [0.0 if math.isnan(h) else h for _, h in stats]
        line = ax.plot(rounds, mean, **{"marker": "o", "markersize": 3,
                                        **factors.get(group, {})},
                       label=named(group, f"n={len(curves)}" + (f"; {left}" if left else "")))
        ax.fill_between(rounds, [m - h for m, h in zip(mean, half, strict=True)],
                        [m + h for m, h in zip(mean, half, strict=True)],
                        color=line[0].get_color(), alpha=0.2)
    ax.set(xlabel="round", ylabel="test accuracy (mean, 95% interval over seeds)", ylim=(0, 1))
    integer_rounds(ax)
    ax.set_title(wrap_title(title), fontsize=10)
    ax.grid(alpha=0.3)
    place_legend(ax, fontsize=7)
    figs = {"accuracy_vs_round.png": fig}

    fig = Figure(figsize=(7.0, 0.4 * max(len(groups), 3) + 1.2))
    ax = fig.subplots()
    for i, runs in enumerate(groups.values()):
        finals = [c.result["final"]["accuracy"] for c in runs
                  if trouble(c) is None and c.result.get("final")]
        mean, half = mean_ci(finals)
        if math.isnan(mean):
            continue
        ax.barh(i, mean, color="tab:blue", alpha=0.6,
                xerr=None if math.isnan(half) else half, capsize=3)
        ax.plot(finals, [i] * len(finals), "k.", markersize=4)
        ax.text(min(mean, 0.85) + 0.01, i - 0.3, f"{mean:.3f}"
                + ("" if math.isnan(half) else f" ± {half:.3f}"), fontsize=7)
    ax.set_yticks(range(len(groups)), [named(g, _left_out(runs) or None, 80)
                                       for g, runs in groups.items()], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("final test accuracy: mean ± 95% interval over seeds (dots: each seed; "
                  "seeds that failed or diverged left out)")
    ax.set_title(wrap_title(title), fontsize=10)
    figs["final_accuracy.png"] = fig
    return figs


def _left_out(runs: Sequence[Any]) -> str:
    """The seeds of a group left out of its mean, and why: 'seed=2 diverged at round 3'."""
    out = [(f"seed={c.seed} " if c.seed is not None else "") + why
           for c in runs if (why := trouble(c)) is not None]
    return ", ".join(out)


def _short(label: str) -> str:
    """'anonymizer=ksame, k=10' -> 'k=10' (the anonymizer is shown by colour)."""
    parts = [p for p in label.split(", ") if not p.startswith("anonymizer=")]
    return ", ".join(p.replace("density-classwise=True", "classwise")
                     .replace("ksame-classwise=True", "classwise") for p in parts)


def _anonymization_plots(title: str, cells: Sequence[Any]) -> dict[str, Figure]:
    """Accuracy against re-identification and against membership inference, one point per
    setting: the mean over its seeds with 95% intervals on both axes (a single seed: the
    cell itself), the Pareto front drawn through the means; failed or diverged cells are
    red crosses, never on the front."""
    from matplotlib import colormaps

    rows = [(c, c.result.get("anonymization") or {}) for c in cells if c.result.get("final")]
    rows = [(c, a) for c, a in rows if a]
    names = sorted({a["anonymizer"] for _, a in rows})
    colour = {n: colormaps["tab20"](i % 20) for i, n in enumerate(names)}
    seeded = any(c.seed is not None for c, _ in rows)
    figs = {}
    for key, fname, xlabel in (
            ("reid-top1", "reid_accuracy.png", "re-identification, top-1 (mean over clients)"),
            ("mia-auc", "mia_accuracy.png", "membership-inference AUC (mean over clients)")):
        every = [(c, a) for c, a in rows if a.get("mean", {}).get(key) is not None]
        if not every:
            continue
        groups: dict[str, list[tuple[float, float]]] = {}
        anonymizer: dict[str, str] = {}
        fig = Figure(figsize=(7.2, 4.8))
        ax = fig.subplots()
        for c, a in every:
            x, y = a["mean"][key], c.result["final"]["accuracy"]
            if (why := trouble(c)) is not None:
                ax.scatter([x], [y], marker="x", color="tab:red", s=30, zorder=3,
                           label=named(c.label, f"{why}; not on the front"))
                continue
            groups.setdefault(c.group, []).append((x, y))
            anonymizer[c.group] = a["anonymizer"]
        pts = []  # (x mean, y mean, x half-width, y half-width, group)
        for group, xy in groups.items():
            (mx, hx), (my, hy) = (mean_ci([p[0] for p in xy]), mean_ci([p[1] for p in xy]))
            pts.append((mx, my, 0.0 if math.isnan(hx) else hx, 0.0 if math.isnan(hy) else hy,
                        group))
        for n in names:
            mine = [p for p in pts if anonymizer[p[4]] == n]
            if not mine:
                continue
            ax.scatter([p[0] for p in mine], [p[1] for p in mine], color=colour[n], s=22,
                       label=n, zorder=3)
            if seeded:
                ax.errorbar([p[0] for p in mine], [p[1] for p in mine],
                            xerr=[p[2] for p in mine], yerr=[p[3] for p in mine],
                            fmt="none", ecolor=colour[n], elinewidth=0.8, capsize=2, zorder=2)
        front = [pts[i] for i in pareto_front([(p[0], p[1]) for p in pts])]
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="black",
                lw=0.8, label="Pareto front" + (" (of the means)" if seeded else ""),
                zorder=2)
        if key == "reid-top1":
            ax.set_xscale("log")
        label_points(ax, [(_short(p[4]), (p[0], p[1])) for p in front if _short(p[4])])
        ax.set_xlabel(xlabel + ("; means over seeds, bars: 95% intervals" if seeded else ""))
        ax.set_ylabel("final test accuracy (real test embeddings)")
        ax.grid(alpha=0.3, which="both")
        place_legend(ax, fontsize=6, ncols=1 if len(names) < 12 else 2)
        ax.set_title(f"accuracy vs {key} (lower x = more private)\n" + wrap_title(title),
                     fontsize=10)
        figs[fname] = fig
    return figs
