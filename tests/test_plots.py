"""Plots fit for a paper: each checked on the matplotlib objects it
draws, not on a file's existence. Small synthetic ledgers and cells; one real run."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from experiments.leakage.plots import roc_figure
from experiments.leakage.release_plot import release_figure
from experiments.leakage.roc import PAD
from experiments.sweep.plots import sweep_plots
from experiments.sweep.spec import Cell, cell_folder
from privacy.dp.tradeoff import Claim
from tasks.config import validate
from tasks.results.folder import default_run_name, settings_title
from tasks.results.ledger import RoundRecord
from tasks.results.plots import budget, run_figures, wants_log

from .conftest import only_run, run_cli


def _record(rnd: int, acc: float, loss: float, train_loss: float | None = None,
            privacy: dict | None = None) -> RoundRecord:
    return RoundRecord(rnd, {"accuracy": acc, "loss": loss},
                       {} if train_loss is None else {"loss": train_loss, "accuracy": 0.5},
                       [0, 1], [], [], {"round-s": 1.0}, privacy=privacy)


def _local(rnd: int, eps: float) -> RoundRecord:
    """A local-DP round where every client spent the same (max == mean)."""
    return _record(rnd, 0.1 * rnd, 2.0, privacy={"mode": "local", "epsilon-max": eps,
                                                 "epsilon-mean": eps, "target-epsilon": 5.0})


def _ax(fig: Figure):
    (ax,) = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    return ax


def _visible_ticks(axis, lo: float, hi: float) -> list[float]:
    return [t for t in axis.get_majorticklocs() if lo - 1e-9 <= t <= hi + 1e-9]


def _legend_covers_nothing(fig: Figure) -> None:
    """Every legend lies outside its axes and over none of the data points drawn."""
    FigureCanvasAgg(fig).draw()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent()
        assert not box.overlaps(ax.get_window_extent()), ax.get_title()
        for line in ax.lines:
            pts = line.get_transform().transform(np.column_stack(line.get_data()))
            assert not any(box.contains(x, y) for x, y in pts), line.get_label()


def test_round_axes_have_integer_ticks_only():
    figs = run_figures([_local(r, 3.0 + r) for r in (1, 2, 3)], {"accuracy": 0.1,
                                                                "loss": 2.3}, "t")
    for name, fig in figs.items():
        ax = _ax(fig)
        ticks = _visible_ticks(ax.xaxis, *ax.get_xlim())
        assert ticks and all(float(t).is_integer() for t in ticks), (name, ticks)


def test_losses_spanning_decades_get_a_log_axis_and_nonfinite_values_are_left_out():
    # a diverging dp=central run: test loss 30 -> 342, train loss 5e31, then inf and nan
    ledger = [_record(1, 0.1, 30.0, 5e31), _record(2, 0.1, 120.0, math.inf),
              _record(3, 0.1, 342.0, math.nan)]
    fig = run_figures(ledger, None, "t")["loss.png"]
    ax = _ax(fig)
    assert ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("2 non-finite not drawn" in x for x in labels), labels
    lo, hi = ax.get_ylim()
    assert math.isfinite(lo) and math.isfinite(hi) and lo > 0 and hi >= 5e31
    FigureCanvasAgg(fig).draw()  # non-finite values do not break drawing


def test_losses_within_two_decades_stay_linear_and_accuracy_stays_0_to_1():
    figs = run_figures([_record(r, 0.3 * r, 2.3 - 0.2 * r, 2.0) for r in (1, 2, 3)],
                       None, "t")
    assert _ax(figs["loss.png"]).get_yscale() == "linear"
    assert _ax(figs["accuracy.png"]).get_ylim() == (0.0, 1.0)
    assert not wants_log([1.0, 50.0]) and wants_log([1.0, 500.0])
    assert not wants_log([0.0, 1e6]) and wants_log([math.inf, 1.0, 1e3])


def test_the_epsilon_plot_starts_at_0_draws_the_target_and_keeps_max_and_mean_apart():
    fig = run_figures([_local(1, 3.6), _local(2, 4.4), _local(3, 5.0)], None, "t")[
        "epsilon.png"]
    ax = _ax(fig)
    assert ax.get_ylim()[0] == 0.0
    target = [line for line in ax.lines if "target" in line.get_label()]
    assert len(target) == 1 and set(target[0].get_ydata()) == {5.0}
    assert "5" in target[0].get_label()
    assert ax.get_ylim()[1] > 5.0  # the target is inside the axes
    max_, mean = (next(line for line in ax.lines if line.get_label() == label)
                  for label in ("max over clients", "mean over clients"))
    assert list(max_.get_ydata()) == list(mean.get_ydata())  # same values ...
    assert max_.get_linestyle() != mean.get_linestyle()  # ... told apart by style
    assert max_.get_marker() != mean.get_marker()
    _legend_covers_nothing(fig)


def test_central_dp_epsilon_plot_draws_the_budget_from_the_run_config(tmp_path):
    (tmp_path / "config.toml").write_text('dp = "central"\nmax-epsilon = 8.0\n')
    assert budget(tmp_path) == 8.0
    (tmp_path / "config.toml").write_text('dp = "central"\nmax-epsilon = 0.0\n')
    assert budget(tmp_path) is None
    assert budget(tmp_path / "nowhere") is None
    central = [_record(r, 0.5, 1.0, privacy={"mode": "central", "epsilon": r * 2.0})
               for r in (1, 2)]
    ax = _ax(run_figures(central, None, "t", target_epsilon=8.0)["epsilon.png"])
    assert [set(line.get_ydata()) for line in ax.lines if "target" in line.get_label()] == \
        [{8.0}]
    ax = _ax(run_figures(central, None, "t")["epsilon.png"])
    assert not [line for line in ax.lines if "target" in line.get_label()]


def test_run_plot_legends_cover_no_data():
    figs = run_figures([_record(r, 0.9, 0.1 * r, 0.1 * r) for r in range(1, 6)],
                       {"accuracy": 0.1, "loss": 2.3}, "t")
    for fig in figs.values():
        _legend_covers_nothing(fig)


def _curve(members: int, nonmembers: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    m, n = rng.normal(1, 1, members), rng.normal(0, 1, nonmembers)
    thresholds = np.sort(np.concatenate([m, n]))[::-1]
    fpr = [0.0] + [float((n >= t).mean()) for t in thresholds]
    tpr = [0.0] + [float((m >= t).mean()) for t in thresholds]
    return {"auc": 0.7, "members": members, "nonmembers": nonmembers,
            "roc": {"fpr": fpr, "tpr": tpr}}


def test_roc_axes_stop_at_what_8_members_can_measure_and_say_so():
    fig = roc_figure({"loss": _curve(8, 8)}, "t", Claim(2.0, 1e-5, "test"))
    ax = _ax(fig)
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert ax.get_xlim() == pytest.approx((1 / 8 / PAD, PAD))
    assert ax.get_ylim() == pytest.approx((1 / 8 / PAD, PAD)) and PAD < 1.1
    for line in ax.lines:
        x, y = (np.asarray(v, dtype=float) for v in line.get_data())
        assert len(x) and x.min() >= 1 / 8 - 1e-12 and y.min() >= 1 / 8 - 1e-12, \
            line.get_label()
    assert "1/8 non-members" in ax.get_xlabel() and "1/8 members" in ax.get_ylabel()
    _legend_covers_nothing(fig)


def test_roc_of_samples_of_different_sizes_is_limited_to_the_largest_and_each_to_its_own():
    fig = roc_figure({"a": _curve(100, 1000), "b": _curve(8, 8, seed=1)}, "t")
    ax = _ax(fig)
    assert ax.get_xlim() == pytest.approx((1e-3 / PAD, PAD))
    assert ax.get_ylim() == pytest.approx((1e-2 / PAD, PAD))
    small = next(line for line in ax.lines if line.get_label().startswith("b "))
    assert np.min(small.get_xdata()) >= 1 / 8 - 1e-12
    assert "own sample" in ax.get_xlabel()


def test_the_release_scatter_has_a_class_legend():
    rng = np.random.default_rng(0)
    fig = release_figure(rng.normal(size=(30, 2)), np.arange(30) % 3,
                         rng.normal(size=(20, 2)), np.arange(20) % 3, 10, "original",
                         "released", "t")
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1
    assert legends[0].get_title().get_text() == "class"
    assert [t.get_text() for t in legends[0].get_texts()] == ["0", "1", "2"]


def _cell(index: int, params: dict, status: str = "finished", eps: float | None = None,
          acc: float = 0.8, seed: int | None = None) -> Cell:
    privacy = {"mode": "local", "epsilon-max": eps} if eps is not None else {"mode": "none"}
    return Cell(index, params, None, status, None, None,
                result={"final": {"accuracy": acc}, "privacy": privacy}, seed=seed)


def test_final_accuracy_mentions_unfinished_cells_only_when_there_are_some(tmp_path):
    done = [_cell(1, {"lr": 0.1}), _cell(2, {"lr": 0.2})]
    ax = _ax(sweep_plots(tmp_path / "a", "s", done)["final_accuracy.png"])
    assert "did not finish" not in ax.get_xlabel()
    failed = [_cell(1, {"lr": 0.1}), _cell(2, {"lr": 0.2}, status="failed", acc=0.1)]
    ax = _ax(sweep_plots(tmp_path / "b", "s", failed)["final_accuracy.png"])
    assert "1 cell(s) did not finish" in ax.get_xlabel()


def test_the_privacy_accuracy_legend_covers_neither_the_no_dp_line_nor_the_points(tmp_path):
    cells = [_cell(1, {"dp": "none"}, acc=0.93),
             *(_cell(i + 2, {"dp": "local", "target-epsilon": e}, eps=e, acc=0.5 + 0.08 * i)
               for i, e in enumerate((1, 2, 5)))]
    figs = sweep_plots(tmp_path, "s", cells)
    ax = _ax(figs["privacy_accuracy.png"])
    assert any(line.get_label().startswith("no DP") for line in ax.lines)
    for fig in figs.values():
        _legend_covers_nothing(fig)
    assert {p.name for p in tmp_path.glob("*.png")} >= {"privacy_accuracy.png",
                                                       "final_accuracy.png"}


def test_the_trade_off_draws_one_line_per_setting_with_seed_means(tmp_path):
    """Cells that differ only in target-epsilon form one line; each point is the mean over
    seeds (epsilon and accuracy) with its 95% interval; a diverged seed is left out."""
    from experiments.sweep.tradeoff import setting_of, tradeoff_points

    cells, i = [], 0
    for mech, base in (("gaussian", 0.5), ("banded-mf", 0.6)):
        for e in (1.0, 8.0):
            for seed, jitter in ((1, -0.02), (2, 0.02)):
                i += 1
                cells.append(_cell(i, {"central-mechanism": mech, "target-epsilon": e},
                                   eps=e * (1 + jitter), acc=base + 0.03 * e + jitter,
                                   seed=seed))
    cells.append(_cell(99, {"central-mechanism": "banded-mf", "target-epsilon": 8.0},
                       status="failed", eps=8.0, acc=0.1, seed=3))
    assert setting_of("central-mechanism=tree, target-epsilon=4.0, lr=0.1") == \
        "central-mechanism=tree, lr=0.1"
    lines = tradeoff_points(cells)
    assert set(lines) == {"central-mechanism=gaussian", "central-mechanism=banded-mf"}
    (e1, a1, h1, n1), (e8, a8, _, n8) = lines["central-mechanism=banded-mf"]
    assert (e1, n1, n8) == (pytest.approx(1.0), 2, 2)
    assert a1 == pytest.approx(0.63) and a8 == pytest.approx(0.84)  # the failed seed left out
    assert h1 == pytest.approx(12.706 * 0.02, rel=1e-3)  # t(0.975, 1 dof) x standard error
    figs = sweep_plots(tmp_path, "s", cells)
    ax = _ax(figs["privacy_accuracy_lines.png"])
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [
        "central-mechanism=banded-mf", "central-mechanism=gaussian"]
    _legend_covers_nothing(figs["privacy_accuracy_lines.png"])
    assert (tmp_path / "privacy_accuracy_lines.png").exists()


def test_a_seeded_sweep_without_ledgers_draws_without_a_legend_warning(tmp_path):
    cells = [_cell(1, {"lr": 0.1}, seed=1, status="failed"),
             _cell(2, {"lr": 0.1}, seed=2, status="failed")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figs = sweep_plots(tmp_path, "s", cells)
    assert _ax(figs["accuracy_vs_round.png"]).get_legend() is None


@pytest.mark.parametrize("values, name, title", [
    ({}, "mnist-fedavg-iid", "iid"),
    ({"partitioner": "dirichlet", "dirichlet-alpha": 0.3, "dp": "local",
      "target-epsilon": 5}, "mnist-fedavg-dirichlet0.3-dp-local-eps5",
     "Dirichlet \u03b1=0.3 \u00b7 local DP \u03b5=5"),
    ({"dp": "local", "noise-multiplier": 1.1}, "mnist-fedavg-iid-dp-local-z1.1",
     "local DP z=1.1"),
    ({"dp": "central", "max-epsilon": 3}, "mnist-fedavg-iid-dp-central-z1-eps3",
     "central DP z=1, \u03b5\u22643"),
    ({"secure-aggregation": "secagg+"}, "mnist-fedavg-iid-secagg", "SecAgg+"),
    ({"features": "embeddings", "anonymizer": "ksame", "k": 10},
     "mnist-fedavg-iid-ksame-k10", "ksame k=10"),
    ({"features": "embeddings", "anonymizer": "density", "density-classwise": True},
     "mnist-fedavg-iid-density-eps3-classwise", "density eps=3 classwise"),
])
def test_run_folder_names_and_titles_carry_the_settings(values, name, title):
    cfg = validate(values)
    assert default_run_name(cfg) == name
    assert title in settings_title(cfg)


def test_sweep_cell_folders_are_named_by_their_keys_after_an_index():
    assert cell_folder(1, {"dp": "local", "target-epsilon": 5}) == "01-dp-local-eps5"
    assert cell_folder(2, {"secure-aggregation": "secagg+"}) == "02-secagg"
    assert cell_folder(3, {"anonymizer": "ksame", "k": 10}) == "03-ksame-k10"
    assert cell_folder(8, {"anonymizer": "density", "dbscan-eps": 3.0, "dbscan-min-samples": 3,
                           "density-classwise": True}) == "08-density-eps3-minpts3-classwise"
    assert cell_folder(12, {"test-noise": "0.1,0.5 / x"}) == "12-test-noise-0.1-0.5---x"
    assert cell_folder(4, {}) == "04"
    assert len(cell_folder(5, {f"key-{i}": "v" * 20 for i in range(20)})) <= 51
    assert cell_folder(5, {"secure-aggregation": True, "leakage-clients": "aggregate",
                           "attacks": "mia,decompose,lira,rmia", "canaries": 0}) == \
        "05-secagg-leakage-clients-aggregate-attacks-mia"
    assert Cell(7, {"lr": 0.1}, None, seed=3).folder == "07-lr0.1-seed3"


def test_a_real_run_is_named_and_titled_by_its_settings(tmp_path, results):
    res = run_cli("run", "--set", "num-server-rounds=2", "--set", "num-clients=2",
                  "--set", "dp=local", "--set", "target-epsilon=5",
                  "--set", f"results-dir={results}", "--set", "save-model=false",
                  cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = only_run(results)
    assert run.name.endswith("-mnist-fedavg-iid-dp-local-eps5"), run.name
    assert {p.name for p in (run / "plots").glob("*.png")} >= {"accuracy.png", "loss.png",
                                                               "epsilon.png"}
    assert budget(run) == 5.0


def test_more_series_than_matplotlibs_ten_colours_stay_told_apart():
    from tasks.results.plots import line_plot

    fig = line_plot(None, {f"cell {i}": ([1, 2], [0.1, 0.2 + i / 100]) for i in range(21)},
                    "round", "accuracy", "t", ylim=(0, 1))
    looks = {(line.get_color(), line.get_linestyle(), line.get_marker())
             for line in _ax(fig).lines}
    assert len(looks) == 21


def test_a_run_ends_with_a_pdf_beside_every_png_and_pngs_fit_for_print(tmp_path):
    """plot_run (what a run's last plot hook writes): each figure as a 150-dpi PNG and a
    vector PDF; the periodic redraws during a run write the PNGs only."""
    import matplotlib.image

    from tasks.results.plots import PNG_DPI, plot_run

    ledger = [_local(r, 3.0 + r) for r in (1, 2, 3)]
    for folder in ("end", "during"):
        (tmp_path / folder).mkdir()
    pngs = plot_run(tmp_path / "end", ledger, {"accuracy": 0.1, "loss": 2.3}, "t")
    assert {p.name for p in pngs} == {"accuracy.png", "loss.png", "epsilon.png"}
    for png in pngs:
        pdf = png.with_suffix(".pdf")
        assert pdf.read_bytes().startswith(b"%PDF"), pdf
        width = matplotlib.image.imread(png).shape[1]
        assert width >= 0.8 * 6.4 * PNG_DPI, (png.name, width)  # a 6.4-inch-wide figure
    during = plot_run(tmp_path / "during", ledger, None, "t", vector=False)
    assert during and not list((tmp_path / "during").glob("*.pdf"))


def test_a_factorial_sweep_draws_its_design_and_curves_start_at_round_0(tmp_path):
    """2 x 2 x 2 cells: colour follows the first key, dashes the second, the marker the
    third (not eight unrelated colours); each accuracy curve starts at round 0, the model
    the cell's run started from (its run.json)."""
    import json
    from itertools import product

    from experiments.sweep.plots import _curves, _initial
    from experiments.sweep.styles import factor_styles

    cells, ledgers = [], {}
    for i, (dp, lr, batch) in enumerate(product(("none", "local"), (0.1, 0.2), (16, 32)), 1):
        c = _cell(i, {"dp": dp, "lr": lr, "batch-size": batch})
        c.run_dir = tmp_path / f"c{i}"
        c.run_dir.mkdir()
        (c.run_dir / "run.json").write_text(json.dumps({"initial": {"accuracy": 0.1}}))
        cells.append(c)
        ledgers[c.label] = [_record(r, 0.5 + 0.1 * r, 1.0) for r in (1, 2)]
    styles = factor_styles({c.label: c.params for c in cells})
    colour = {c.params["dp"]: styles[c.label]["color"] for c in cells}
    dashes = {c.params["lr"]: styles[c.label]["ls"] for c in cells}
    marks = {c.params["batch-size"]: styles[c.label]["marker"] for c in cells}
    assert len(set(colour.values())) == len(set(dashes.values())) == len(set(marks.values())) == 2
    assert all(styles[c.label]["color"] == colour[c.params["dp"]] for c in cells)
    series, drawn = _curves(cells, ledgers, lambda r: r.accuracy, _initial)
    assert all(xs[0] == 0 and ys[0] == 0.1 and xs[1:] == [1, 2] for xs, ys in series.values())
    assert drawn[cells[0].label]["marker"] == marks[16]
    assert factor_styles({"a": {"lr": 0.1}, "b": {"lr": 0.2}}) == {}  # one factor: the cycle


def test_runs_showing_the_same_label_plot_share_one_drawing_and_each_gets_a_copy(tmp_path):
    """A sweep's cells on one partition (lr and seed are not in the plot's title) draw it
    once; closing one cell's plot leaves the others' intact; another partition is drawn
    on its own."""
    from experiments.runtime.runner import GroundTruthPlot

    counts = [[3, 1], [2, 2]]
    cfgs = [validate({"lr": lr}) for lr in (0.05, 0.1)]
    a, b = (GroundTruthPlot(c, counts) for c in cfgs)
    other = GroundTruthPlot(cfgs[0], [[1, 3], [2, 2]])
    assert a.drawing is b.drawing and other.drawing is not a.drawing
    folder = a.drawing.path.parent
    a.place(tmp_path / "a" / "label_distribution.png")
    a.close()
    a.close()  # twice is harmless, as a sweep's finally may
    b.place(tmp_path / "b" / "label_distribution.png")
    other.place(tmp_path / "c" / "label_distribution.png")
    for plot in (b, other):
        plot.close()
    for name in ("label_distribution.png", "label_distribution.pdf"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    assert not folder.exists() and not GroundTruthPlot._drawings


def _picture(path):
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGBA")).astype(int)


@pytest.mark.parametrize("extra", [None, "suptitle", "long-legend"])
def test_save_figure_writes_the_picture_savefig_tight_writes_and_leaves_the_figure_as_it_was(
        tmp_path, extra):
    """One draw gives the tight box and the PNG (:func:`_png_and_tight_box`): the same
    picture as ``savefig(bbox_inches="tight")`` at the PNG's dpi (its crop to whole
    pixels), the PDF cropped to the same box; a figure-level title, or a legend wider
    than the room drawn around the figure, takes savefig's way."""
    from tasks.results.plots import PNG_DPI, _png_and_tight_box, save_figure

    ledger = [_record(r, 0.1 * r, 2.0 / r, 1.9 / r) for r in range(1, 6)]
    fig = run_figures(ledger, {"accuracy": 0.1, "loss": 2.3}, "a title · lr 0.05")["loss.png"]
    ax = fig.axes[0]
    if extra == "suptitle":
        fig.suptitle("a figure title")
    if extra == "long-legend":  # a legend reaching further right than the room drawn
        ax.plot([1, 5], [1, 1], label="a very long series name " * 4)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    size, dpi, where, canvas = fig.get_size_inches().copy(), fig.dpi, ax.get_position(), fig.canvas
    fig.savefig(tmp_path / "savefig.png", dpi=PNG_DPI, bbox_inches="tight")
    assert (_png_and_tight_box(fig, None) is None) == (extra is not None)
    save_figure(fig, tmp_path / "mine.png")
    theirs, mine = _picture(tmp_path / "savefig.png"), _picture(tmp_path / "mine.png")
    assert mine.shape == theirs.shape
    differ = (mine != theirs).any(-1)
    assert differ.mean() < 0.05 and np.abs(mine - theirs).mean() < 1.5  # sub-pixel offsets
    assert (tmp_path / "mine.pdf").read_bytes().startswith(b"%PDF")
    assert (fig.get_size_inches() == size).all() and fig.dpi == dpi and fig.canvas is canvas
    assert ax.get_position().bounds == pytest.approx(where.bounds, abs=1e-12)
