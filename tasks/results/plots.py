"""Plots of one run, redrawn from the ledger (matplotlib's object API: no GUI, thread-safe)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from ..files import replacing
from .ledger import RoundRecord, read_ledger


def _save(fig: Figure, path: Path) -> None:
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")


def line_plot(path: Path, series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
              xlabel: str, ylabel: str, title: str, ylim: tuple[float, float] | None = None
              ) -> None:
    """One line per named series of (x, y) points."""
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.subplots()
    for label, (xs, ys) in series.items():
        if len(xs):
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    _save(fig, path)


def _series(records: Sequence[Mapping[str, Any]], *path: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        value: Any = r
        for p in path:
            value = value.get(p) if isinstance(value, Mapping) else None
        if isinstance(value, (int, float)):
            xs.append(r["round"])
            ys.append(float(value))
    return xs, ys


def plot_run(out_dir: Path, ledger: Sequence[RoundRecord],
             initial: Mapping[str, Any] | None, title: str) -> list[Path]:
    """Accuracy and loss (and epsilon with DP) against round; returns the files written."""
    records = [r.to_json() for r in ledger]
    rows = ([{"round": 0, "test": initial}] if initial else []) + list(records)
    acc = out_dir / "accuracy.png"
    line_plot(acc, {"test (server, held-out)": _series(rows, "test", "accuracy"),
                    "train (clients, weighted)": _series(records, "train", "accuracy")},
              "round", "accuracy", title, ylim=(0.0, 1.0))
    loss = out_dir / "loss.png"
    line_plot(loss, {"test (server, held-out)": _series(rows, "test", "loss"),
                     "train (clients, weighted)": _series(records, "train", "loss")},
              "round", "cross-entropy loss", title)
    files = [acc, loss]
    privacy = [r for r in records if "privacy" in r]
    if privacy:
        eps = out_dir / "epsilon.png"
        if privacy[0]["privacy"]["mode"] == "central":
            series = {"client-level epsilon (central DP)": _series(privacy, "privacy", "epsilon")}
        else:
            series = {"max over clients": _series(privacy, "privacy", "epsilon-max"),
                      "mean over clients": _series(privacy, "privacy", "epsilon-mean")}
        line_plot(eps, series, "round", "cumulative epsilon", title)
        files.append(eps)
    return files


class PlotHook:
    """Redraws a run's plots from its ledger: at most every ``every_s`` seconds, and at the end."""

    def __init__(self, run_dir: Path, info: Mapping[str, Any], title: str,
                 every_s: float = 10.0) -> None:
        self.run_dir = run_dir
        self.info = info
        self.title = title
        self.every_s = every_s
        self.last = 0.0

    def after_round(self, record: RoundRecord, arrays: Any, result: Any) -> None:
        if time.perf_counter() - self.last >= self.every_s:
            self.finish()

    def finish(self) -> None:
        plot_run(self.run_dir / "plots", read_ledger(self.run_dir), self.info.get("initial"),
                 self.title)
        self.last = time.perf_counter()


def _label_heatmap(path: Path, counts: np.ndarray, title: str) -> None:
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig = Figure(figsize=(8.0, 4.0))
    ax = fig.subplots()
    image = ax.imshow(shares.T, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=(-0.5, len(counts) - 0.5, counts.shape[1] - 0.5, -0.5))
    fig.colorbar(image, ax=ax, label="share of the client's examples")
    ax.set_xlabel(f"client (partition id, {len(counts):,} clients)")
    ax.set_ylabel("class")
    ax.set_title(title, fontsize=10)
    _save(fig, path)


def plot_label_distribution(path: Path, partitions: Sequence[Mapping[str, Any]],
                            title: str) -> None:
    """Stacked bars: how many examples of each class every client holds (a heat map of
    class shares beyond 200 clients, where bars would be too thin to see and slow to draw)."""

    counts = np.array([p["label-counts"] for p in partitions], dtype=float)
    n_clients, n_classes = counts.shape
    if n_clients > 200:
        _label_heatmap(path, counts, title)
        return
    fig = Figure(figsize=(max(6.4, min(0.25 * n_clients + 2, 16)), 4.0))
    ax = fig.subplots()
    cmap = colormaps["tab20" if n_classes > 10 else "tab10"]
    bottom = np.zeros(n_clients)
    ids = [p["partition-id"] for p in partitions]
    for c in range(n_classes):
        ax.bar(range(n_clients), counts[:, c], bottom=bottom, width=0.85,
               color=cmap(c % cmap.N), label=str(c) if n_classes <= 20 else None)
        bottom += counts[:, c]
    ax.set_xlabel("client (partition id)")
    ax.set_ylabel("examples")
    ax.set_title(title, fontsize=10)
    step = max(1, n_clients // 20)
    ax.set_xticks(range(0, n_clients, step), [str(i) for i in ids[::step]])
    if n_classes <= 20:
        ax.legend(title="class", fontsize=7, ncols=2 if n_classes > 10 else 1,
                  bbox_to_anchor=(1.01, 1), loc="upper left")
    _save(fig, path)
