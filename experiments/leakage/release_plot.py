"""Draw one client's original vs released embeddings in 2-D (PCA fitted on the originals).

    python -m experiments.leakage.release_plot RUN_DIR [--client 0]

Reads the run's config.toml, takes the client's embeddings and its release exactly as
the run computed them (both are cached on disk) and writes
``RUN_DIR/plots/release_scatter.png``. `fedpriv run` and `fedpriv sweep` call it after
every run that anonymized embeddings.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any


def release_scatter(run_dir: Path, client: int = 0) -> Path:
    # torch, scikit-learn and matplotlib: this runs in a child process (plot_in_child)
    from sklearn.decomposition import PCA

    from clients.anonymized import holdout_split, released_data
    from tasks.config import validate
    from tasks.results.folder import read_run_info, settings_title
    from tasks.results.plots import save_figure
    from tasks.seeding import derive_seed
    from tasks.splits import client_split

    with open(run_dir / "config.toml", "rb") as f:
        cfg = validate(tomllib.load(f))
    anon = cfg.anonymization
    n = int(read_run_info(run_dir).get("num-clients", cfg.federation.num_clients))
    split = client_split(cfg, client, n)
    seed = derive_seed(cfg.training.seed, client)
    if anon.anonymizer == "cvae-federated":
        released = _federated_release(run_dir, anon, split, seed)
    else:
        released = released_data(anon, split, seed)
    members, _ = holdout_split(len(split), anon.privacy_holdout, seed)
    x, y = split.x.numpy()[members], split.y.numpy()[members]
    pca = PCA(n_components=2, random_state=0).fit(x)
    s = released.scores
    fig = release_figure(pca.transform(x), y, pca.transform(released.x.numpy()),
                         released.y.numpy(), split.num_classes,
                         f"client {client}: original", f"released by {anon.anonymizer}",
                         f"{cfg.data.dataset} · {settings_title(cfg)}\n"
                         f"re-identification top-1 {s.get('reid-top1', float('nan')):.3f} · "
                         f"MIA AUC {s.get('mia-auc', float('nan')):.3f} · k-level "
                         f"{s.get('k-level')}")
    out = run_dir / "plots" / "release_scatter.png"
    out.parent.mkdir(exist_ok=True)
    save_figure(fig, out)
    return out


def release_figure(a: Any, labels_a: Any, b: Any, labels_b: Any, num_classes: int,
                   left: str, right: str, title: str) -> Any:
    """Originals (``a``, 2-D) beside the release (``b``) on shared axes, coloured by class,
    with a class legend beside them; returns the matplotlib Figure."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(10, 4.6), layout="constrained")  # the suptitle clear of the axes
    axes = fig.subplots(1, 2, sharex=True, sharey=True)
    cmap = colormaps["tab10" if num_classes <= 10 else "tab20"]
    for ax, pts, labels, name in ((axes[0], a, labels_a, left), (axes[1], b, labels_b, right)):
        ax.scatter(pts[:, 0], pts[:, 1], c=[cmap(int(c) % cmap.N) for c in labels], s=6,
                   alpha=0.7, linewidths=0)
        ax.set_title(f"{name} ({len(pts)})", fontsize=10)
        ax.set_xlabel("PC 1")
    axes[0].set_ylabel("PC 2 (PCA of the originals)")
    shown = sorted({int(c) for c in [*labels_a, *labels_b]})
    if len(shown) <= 20:
        axes[1].legend([Line2D([], [], ls="", marker="o", ms=5, color=cmap(c % cmap.N))
                        for c in shown], [str(c) for c in shown], title="class", fontsize=7,
                       loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                       ncols=2 if len(shown) > 10 else 1)
    fig.suptitle(title, fontsize=9)
    return fig


def _federated_release(run_dir: Path, anon, split, seed: int):
    import torch
    from flwr.app import ArrayRecord, Context, RecordDict

    from clients.anonymized import federated_cvae_release

    decoder = torch.load(run_dir / "cvae_decoder.pt", weights_only=True)
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    return federated_cvae_release(anon, context, split, seed, ArrayRecord(decoder))


def plot_in_child(run_dir: Path, client: int = 0) -> bool:
    """Run :func:`release_scatter` in a child process (it imports torch); True if drawn."""
    proc = subprocess.run([sys.executable, "-m", "experiments.leakage.release_plot", str(run_dir),
                           "--client", str(client)], capture_output=True, text=True)
    return proc.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--client", type=int, default=0)
    args = parser.parse_args()
    print(release_scatter(args.run_dir, args.client))


if __name__ == "__main__":
    main()
