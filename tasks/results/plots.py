"""Plots of one run, redrawn from the ledger (matplotlib's object API: no GUI, thread-safe).

Every plot is drawn for a paper: integer round ticks, a log axis when the values span
decades, non-finite values left out (and said so), legends outside the axes."""

from __future__ import annotations

import io
import math
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps, rcParams
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Bbox

from ..files import write_atomic
from .ledger import RoundRecord, read_ledger

LOG_DECADES = 2.0  # positive values spanning more decades than this get a log axis
PNG_DPI = 150  # sharp on screen and in slides; the PDF beside it is for print
# zlib's fastest level: a plot's PNG 25% larger (about 48 KB against 38) and its
# encoding a third faster, at every cell of a sweep
PNG_COMPRESSION = {"compress_level": 1}
VECTOR = ".pdf"  # written beside every PNG a run, sweep or study ends with


def save_figure(fig: Figure, path: Path, vector: bool = True, **kwargs: Any) -> None:
    """``path`` as a PNG at :data:`PNG_DPI` and, with ``vector``, a PDF of the same name
    beside it (for papers); each written whole or not at all (a full disk: WriteFailed).
    The tight crop is laid out once, at the PNG's dpi, and the PDF reuses its box; a
    figure whose artists all lie in axes is drawn once for both the box and the PNG
    (:func:`_png_and_tight_box`)."""
    options = {"bbox_inches": "tight", **kwargs}
    png = None
    if options["bbox_inches"] == "tight":
        pad = options.pop("pad_inches", None)
        drawn = _png_and_tight_box(fig, pad) if not options.keys() - {"bbox_inches"} \
            else None
        if drawn is None:
            options["bbox_inches"] = _tight_box(fig, pad)
        else:
            png, options["bbox_inches"] = drawn
    if png is not None:
        write_atomic(path, lambda f: f.write(png))
    else:
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=PNG_DPI,
                                                 pil_kwargs=PNG_COMPRESSION, **options))
    if vector:
        write_atomic(path.with_suffix(VECTOR), lambda f: fig.savefig(f, format="pdf",
                                                                     **options))


def _tight_box(fig: Figure, pad: float | None) -> Bbox:
    """The box, in inches, that ``savefig(dpi=PNG_DPI, bbox_inches="tight")`` crops to."""
    dpi = fig.dpi
    fig.set_dpi(PNG_DPI)  # text is laid out at the dpi it is drawn at
    try:
        fig.draw_without_rendering()
        box = fig.get_tightbbox()
    finally:
        fig.set_dpi(dpi)
    return box.padded(rcParams["savefig.pad_inches"] if pad is None else pad)


# inches of canvas drawn left, below, right and above a figure, for what its tight box
# holds outside it (legends go right of the axes)
ROOM = (1.0, 1.0, 4.0, 1.0)


def _png_and_tight_box(fig: Figure, pad: float | None) -> tuple[bytes, Bbox] | None:
    """The PNG ``savefig(dpi=PNG_DPI, bbox_inches="tight")`` writes (the same picture, its
    crop rounded to whole pixels) and that box, from one draw where savefig needs two
    (the box's layout, then the picture's): the figure is drawn with :data:`ROOM` inches
    of canvas around it, its axes the same size and place in inches, so that labels and
    legends outside it are drawn too; the box comes from that draw's renderer (text
    extents cached) and the picture is its pixels. None (savefig's own way) for a figure
    with anything but axes in it (figure text, legends, sub-figures), a layout engine,
    axes placed by a locator, or a box larger than the room."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    axes = fig.axes
    if fig.get_layout_engine() is not None or any(
            c is not fig.patch and not isinstance(c, Axes) for c in fig.get_children()) \
            or any(ax.get_axes_locator() is not None for ax in axes):
        return None
    width, height = fig.get_size_inches()
    left, bottom, right, top = ROOM
    wide, high = width + left + right, height + bottom + top
    dpi = fig.dpi
    placed = [(ax, ax.get_position(original=True), ax.get_position()) for ax in axes]
    canvas = fig.canvas
    try:
        fig.set_size_inches(wide, high)
        fig.set_dpi(PNG_DPI)
        for ax, original, active in placed:
            for box, which in ((original, "original"), (active, "active")):
                ax.set_position([(box.x0 * width + left) / wide,
                                 (box.y0 * height + bottom) / high,
                                 box.width * width / wide, box.height * height / high],
                                which=which)
        agg = FigureCanvasAgg(fig)
        agg.draw()
        tight = fig.get_tightbbox(agg.get_renderer())
        tight = tight.padded(rcParams["savefig.pad_inches"] if pad is None else pad)
        if tight.x0 < 0 or tight.y0 < 0 or tight.x1 > wide or tight.y1 > high:
            return None
        pixels = np.asarray(agg.buffer_rgba())
        x0, y0 = round(tight.x0 * PNG_DPI), round(tight.y0 * PNG_DPI)
        cols, rows = int(tight.width * PNG_DPI), int(tight.height * PNG_DPI)
        y1 = pixels.shape[0] - y0 - rows
        crop = np.ascontiguousarray(pixels[y1:y1 + rows, x0:x0 + cols])
        out = io.BytesIO()
        Image.fromarray(crop).save(out, format="png", dpi=(PNG_DPI, PNG_DPI),
                                   **PNG_COMPRESSION)
    finally:
        fig.set_size_inches(width, height)
        fig.set_dpi(dpi)
        for ax, original, active in placed:
            ax.set_position(original, which="original")
            ax.set_position(active, which="active")
        fig.set_canvas(canvas)
    return out.getvalue(), tight.translated(-left, -bottom)


def _save(fig: Figure, path: Path, vector: bool = True) -> None:
    save_figure(fig, path, vector)


def place_legend(ax: Axes, **kwargs: Any) -> Legend | None:
    """The legend outside the axes, right of them, where it covers no data; None (and no
    matplotlib warning) when nothing is labelled."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return None
    return ax.legend(handles, labels, **{"fontsize": 8, "loc": "upper left",
                                         "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
                                         **kwargs})


def label_points(ax: Axes, points: Sequence[tuple[str, tuple[float, float]]]) -> None:
    """Label each point beside it, on whichever side (right, left, below, above) keeps
    the label inside the axes and off the labels already placed and the points; call it
    once the axes' scales and limits are set."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = ax.get_figure()
    if fig.canvas is None or not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    ax.get_xlim(), ax.get_ylim()  # settle autoscaling before reading the transform
    frame = ax.get_window_extent(renderer)
    dots = [ax.transData.transform(xy) for _, xy in points]
    placed: list[Any] = []
    sides = [((3, 3), "left", "bottom"), ((3, -3), "left", "top"),
             ((-3, 3), "right", "bottom"), ((-3, -3), "right", "top")]
    for text, xy in points:
        best, best_cost = None, math.inf
        for offset, ha, va in sides:
            label = ax.annotate(text, xy, fontsize=6, xytext=offset, textcoords="offset points",
                                ha=ha, va=va)
            box = label.get_window_extent(renderer)
            cost = (sum(box.overlaps(other) for other in placed) * 10
                    + sum(box.contains(*d) for d in dots) * 3
                    + (0 if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
                       else 5))
            if cost < best_cost:
                if best is not None:
                    best.remove()
                best, best_cost = label, cost
            else:
                label.remove()
            if cost == 0:
                break
        placed.append(best.get_window_extent(renderer))


def shorten(label: str, width: int = 60) -> str:
    """A legend label cut to ``width`` characters, with an ellipsis when cut."""
    return label if len(label) <= width else label[:width - 1].rstrip(", ") + "\u2026"


def integer_rounds(ax: Axes) -> None:
    """Round ticks on whole numbers only (matplotlib would put them at 0.5)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def wrap_title(title: str, width: int = 64) -> str:
    """A long title broken into lines at its ' · ' separators, none much over ``width``."""
    lines: list[str] = []
    for part in title.split(" \u00b7 "):
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " \u00b7 " + part
        else:
            lines.append(part)
    return "\n".join(lines)


def wants_log(values: Sequence[float], decades: float = LOG_DECADES) -> bool:
    """Whether a log axis shows ``values`` better: all finite ones positive and spanning
    more than ``decades`` decades."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2 or min(finite) <= 0:
        return False
    return math.log10(max(finite) / min(finite)) > decades


def _finite(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float], int]:
    """The points whose y is finite, and how many were not."""
    keep = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
    return [x for x, _ in keep], [y for _, y in keep], len(xs) - len(keep)


def line_plot(path: Path | None, series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
              xlabel: str, ylabel: str, title: str,
              ylim: tuple[float | None, float | None] | None = None,
              styles: Mapping[str, Mapping[str, Any]] | None = None,
              levels: Sequence[tuple[float, str]] = ()) -> Figure:
    """One line per named series of (x, y) points against round, saved to ``path`` (when
    given) and returned. Non-finite y values are left out and counted in the legend; the
    y axis is logarithmic when the positive values span more than two decades (unless
    ``ylim`` fixes it); ``levels`` are labelled horizontal lines (e.g. a target)."""
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.subplots()
    drawn: list[float] = []
    many = len(series) > 10  # beyond matplotlib's 10 colours: 20, and markers, and dashes
    for i, (label, (xs, ys)) in enumerate(series.items()):
        xs, ys, dropped = _finite(xs, [float(y) for y in ys])
        look = {"color": colormaps["tab20"](i % 20), "marker": "os^vD"[i % 5],
                "ls": "-" if i < 20 else "--"} if many else {}
        if xs or dropped:
            ax.plot(xs, ys, label=shorten(label) + (f" ({dropped} non-finite not drawn)"
                                                    if dropped else ""),
                    **{"marker": "o", "markersize": 3, **look,
                       **(styles or {}).get(label, {})})
        drawn += ys
    for y, label in levels:
        ax.axhline(y, color="crimson", ls=":", lw=1.4, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(wrap_title(title), fontsize=10)
    integer_rounds(ax)
    if ylim is None and wants_log(drawn + [y for y, _ in levels]):
        ax.set_yscale("log")
    elif ylim:
        top = ylim[1]
        if top is None and levels:  # room above a target line, off the axes' edge
            top = 1.08 * max([*drawn, *(y for y, _ in levels)])
        ax.set_ylim(ylim[0], top)
    ax.grid(alpha=0.3)
    if ax.get_yscale() == "log":
        ax.grid(alpha=0.1, which="minor", axis="y")
    place_legend(ax)
    if path is not None:
        _save(fig, path)
    return fig


def _series(records: Sequence[Mapping[str, Any]], *path: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        value: Any = r
        for p in path:
            value = value.get(p) if isinstance(value, Mapping) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(r["round"])
            ys.append(float(value))
    return xs, ys


# max and mean over clients are often equal: a solid line with filled circles under a
# dashed one with open squares keeps both visible
EPSILON_STYLES = {"max over clients": {"ls": "-", "marker": "o", "markersize": 6, "lw": 2.0,
                                       "color": "tab:blue", "zorder": 2},
                  "mean over clients": {"ls": "--", "marker": "s", "markersize": 7,
                                        "mfc": "none", "lw": 1.2, "color": "tab:orange",
                                        "zorder": 3}}


def run_figures(ledger: Sequence[RoundRecord], initial: Mapping[str, Any] | None, title: str,
                target_epsilon: float | None = None) -> dict[str, Figure]:
    """Accuracy and loss (and epsilon with DP) against round, by file name; the epsilon
    plot starts at 0 and draws ``target_epsilon`` (the run's budget) when there is one."""
    records = [r.to_json() for r in ledger]
    rows = ([{"round": 0, "test": initial}] if initial else []) + list(records)
    figs = {
        "accuracy.png": line_plot(
            None, {"test (server, held-out)": _series(rows, "test", "accuracy"),
                   "train (clients, weighted)": _series(records, "train", "accuracy")},
            "round", "accuracy", title, ylim=(0.0, 1.0)),
        "loss.png": line_plot(
            None, {"test (server, held-out)": _series(rows, "test", "loss"),
                   "train (clients, weighted)": _series(records, "train", "loss")},
            "round", "cross-entropy loss", title)}
    privacy = [r for r in records if "privacy" in r]
    if privacy:
        if privacy[0]["privacy"]["mode"] == "central":
            series = {"client-level epsilon (central DP)": _series(privacy, "privacy", "epsilon")}
        else:
            series = {"max over clients": _series(privacy, "privacy", "epsilon-max"),
                      "mean over clients": _series(privacy, "privacy", "epsilon-mean")}
            if target_epsilon is None:
                target_epsilon = privacy[-1]["privacy"].get("target-epsilon")
        levels = ([(float(target_epsilon), f"target \u03b5 = {target_epsilon:g}")]
                  if target_epsilon else [])
        figs["epsilon.png"] = line_plot(None, series, "round", "cumulative epsilon", title,
                                        ylim=(0.0, None), styles=EPSILON_STYLES,
                                        levels=levels)
    return figs


def plot_run(out_dir: Path, ledger: Sequence[RoundRecord],
             initial: Mapping[str, Any] | None, title: str,
             target_epsilon: float | None = None, vector: bool = True) -> list[Path]:
    """Accuracy and loss (and epsilon with DP) against round, as PNG (and PDF with
    ``vector``); returns the PNGs written."""
    files = []
    with _DRAWING:
        for name, fig in run_figures(ledger, initial, title, target_epsilon).items():
            _save(fig, out_dir / name, vector)
            files.append(out_dir / name)
    return files


# a run's figures are drawn one run at a time: a sweep's cells side by side share the
# process (server.cells), and matplotlib does not promise that two threads may draw at once
_DRAWING = threading.Lock()


def budget(run_dir: Path) -> float | None:
    """The run's epsilon budget from its config.toml: target-epsilon (dp = local) or
    max-epsilon (dp = central); None without DP, a budget or the file."""
    try:
        with open(run_dir / "config.toml", "rb") as f:
            cfg = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    key = {"local": "target-epsilon", "central": "max-epsilon"}.get(cfg.get("dp"))
    value = cfg.get(key) if key else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


class PlotHook:
    """Redraws a run's plots from its ledger: at most every ``every_s`` seconds, and at the end."""

    def __init__(self, run_dir: Path, info: Mapping[str, Any], title: str,
                 every_s: float = 10.0) -> None:
        self.run_dir = run_dir
        self.info = info
        self.title = title
        self.every_s = every_s
        self.last = time.perf_counter()  # a run shorter than every_s draws once, at the end

    def after_round(self, record: RoundRecord, arrays: Any, result: Any) -> None:
        if time.perf_counter() - self.last >= self.every_s:
            self._draw(vector=False)  # the PDFs once, at the end

    def finish(self) -> None:
        self._draw(vector=True)

    def _draw(self, vector: bool) -> None:
        plot_run(self.run_dir / "plots", read_ledger(self.run_dir), self.info.get("initial"),
                 self.title, budget(self.run_dir), vector)
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
    ax.set_title(wrap_title(title), fontsize=10)
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
    ax.set_title(wrap_title(title), fontsize=10)
    step = max(1, n_clients // 20)
    ax.set_xticks(range(0, n_clients, step), [str(i) for i in ids[::step]])
    if n_classes <= 20:
        ax.legend(title="class", fontsize=7, ncols=2 if n_classes > 10 else 1,
                  bbox_to_anchor=(1.01, 1), loc="upper left")
    _save(fig, path)
