"""Pictures of what leaked: reconstruction grids and membership-inference ROC curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from privacy.analysis.leakage_metrics import to_pixels
from privacy.dp.tradeoff import Claim
from tasks.results.plots import place_legend, save_figure, wrap_title

from .roc import RocCurve, draw_roc


def reconstruction_grid(path: Path, original: torch.Tensor, recon: torch.Tensor,
                        matched: Sequence[int], mean: Sequence[float], std: Sequence[float],
                        title: str, max_images: int = 16) -> Path:
    """Originals (top row) above the reconstruction matched to each (bottom row)."""
    a = to_pixels(original, mean, std)
    b = to_pixels(recon, mean, std)
    order = list(range(len(b)))[:max_images]
    cols = len(order)
    fig = Figure(figsize=(max(2.0, 1.1 * cols), 2.6))
    axes = np.atleast_2d(fig.subplots(2, cols, squeeze=False))
    for j, i in enumerate(order):
        for row, img in ((0, a[matched[i]]), (1, b[i])):
            ax = axes[row, j]
            pic = img.permute(1, 2, 0).numpy()
            ax.imshow(pic[..., 0] if pic.shape[-1] == 1 else pic, cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_ylabel("original", fontsize=8)
    axes[1, 0].set_ylabel("reconstructed", fontsize=8)
    fig.suptitle(title, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, vector=False)  # an image grid: the PNG is the figure
    return path


def roc_figure(curves: Mapping[str, Mapping[str, Any]], title: str,
               claim: Claim | None = None) -> Figure:
    """Every membership attack's ROC curve for one observation on axes that stop at the
    lowest rates its members and non-members measure, above the highest curve the run's
    DP claim allows (when it has one)."""
    fig = Figure(figsize=(5.2, 4.4))
    ax = fig.subplots()
    x0, y0 = draw_roc(ax, [RocCurve(f"{label} (AUC {c['auc']:.3f})", c["roc"]["fpr"],
                                    c["roc"]["tpr"], int(c["members"]), int(c["nonmembers"]))
                           for label, c in curves.items()])
    if claim is not None:
        grid = np.logspace(np.log10(x0), 0, 200)
        bound = np.asarray(claim.curve(grid), dtype=float)
        keep = bound >= y0
        ax.plot(grid[keep], bound[keep], color="crimson", lw=1.6,
                label=f"DP bound: \u03b5 = {claim.epsilon:.3g}, \u03b4 = {claim.delta:.2g}")
    ax.set_title(wrap_title(title, 56), fontsize=9)
    place_legend(ax, fontsize=7)
    return fig


def roc_plot(path: Path, curves: Mapping[str, Mapping[str, Any]], title: str,
             claim: Claim | None = None) -> Path:
    """:func:`roc_figure`, saved to ``path``."""
    fig = roc_figure(curves, title, claim)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path
