"""A leakage sweep's cell that failed or diverged is no baseline and no front: its plots
leave it off the DP line, the levels and the Pareto front, and the legend says why."""

from __future__ import annotations

from types import SimpleNamespace

from matplotlib.figure import Figure

from experiments.leakage import sweep as leakage
from experiments.sweep.outcome import named, trouble


def _row(cell: int, defence: str, eps: float | None, psnr: float, acc: float,
         why: str | None = None) -> dict:
    return {"cell": cell, "defence": defence, "setting": "8 ex, batch 8, 1 ep", "round": 1,
            "accuracy": acc, "epsilon-claimed": eps, "psnr": psnr, "psnr-random": 9.0,
            "trouble": why, "note": None, "run-dir": "."}


def _drawn(monkeypatch, tmp_path, draw, rows) -> Figure:
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: saved.append(self))
    draw(tmp_path, "t", rows)
    fig = saved[0]
    assert all(f is fig for f in saved)  # one figure, as PNG and PDF
    return fig


def test_what_became_of_a_cell():
    ok = SimpleNamespace(status="finished", result={"diverged": None})
    assert trouble(ok) is None and named("no DP", None) == "no DP"
    gone = SimpleNamespace(status="finished", result={"diverged": {"round": 3}})
    assert trouble(gone) == "diverged at round 3"
    assert named("no DP", trouble(gone)) == "no DP (diverged at round 3)"
    assert trouble(SimpleNamespace(status="failed", result={})) == "failed"


def test_a_diverged_cell_is_off_the_leakage_front_and_said_so(monkeypatch, tmp_path):
    rows = [_row(1, "none", None, 30.0, 0.10, "diverged at round 2"),  # best PSNR "accuracy"
            _row(2, "local DP-SGD (eps 5)", 5.0, 12.0, 0.80),
            _row(3, "local DP-SGD (eps 1)", 1.0, 10.0, 0.60),
            _row(4, "local DP-SGD (eps 10)", 10.0, 14.0, 0.95, "failed")]
    fig = _drawn(monkeypatch, tmp_path, leakage._accuracy_vs_psnr, rows)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "none (diverged at round 2); not on the front" in labels, labels
    assert "local DP-SGD (eps 10) (failed); not on the front" in labels, labels
    (front,) = [line for line in ax.get_lines() if line.get_label().startswith("Pareto")]
    assert list(front.get_xdata()) == [10.0, 12.0]  # cells 3 and 2 only

    fig = _drawn(monkeypatch, tmp_path, leakage._psnr_vs_epsilon, rows)
    ax = fig.axes[0]
    (dp_line,) = [line for line in ax.get_lines()
                  if line.get_label().startswith("local DP-SGD · ")]
    assert list(dp_line.get_xdata()) == [1.0, 5.0]  # the failed epsilon-10 cell is a cross
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("(diverged at round 2); not drawn" in x for x in labels), labels
    # no level drawn at the diverged baseline's 30 dB (only its legend entry)
    assert not [line for line in ax.get_lines() if 30.0 in list(line.get_ydata())]


def _anon_cell(group: str, seed: int, anonymizer: str, reid: float, acc: float,
               status: str = "finished") -> SimpleNamespace:
    return SimpleNamespace(group=group, seed=seed, label=f"{group}, seed={seed}",
                           status=status, result={
                               "final": {"accuracy": acc}, "diverged": None,
                               "anonymization": {"anonymizer": anonymizer,
                                                 "mean": {"reid-top1": reid}}})


def test_a_seeded_anonymization_sweep_draws_one_point_per_setting_and_its_front_of_means():
    from experiments.sweep.plots import _anonymization_plots

    cells = [_anon_cell("anonymizer=ksame, k=2", 1, "ksame", 0.50, 0.84),
             _anon_cell("anonymizer=ksame, k=2", 2, "ksame", 0.48, 0.86),
             _anon_cell("anonymizer=ksame, k=10", 1, "ksame", 0.08, 0.78),
             _anon_cell("anonymizer=ksame, k=10", 2, "ksame", 0.08, 0.80),
             # one seed of k=20 alone would be on the front; their mean is not
             _anon_cell("anonymizer=ksame, k=20", 1, "ksame", 0.04, 0.95),
             _anon_cell("anonymizer=ksame, k=20", 2, "ksame", 0.04, 0.55),
             _anon_cell("anonymizer=ksame, k=50", 1, "ksame", 0.01, 0.9, status="failed")]
    fig = _anonymization_plots("t", cells)["reid_accuracy.png"]
    ax = fig.axes[0]
    (front,) = [line for line in ax.get_lines() if line.get_label().startswith("Pareto")]
    assert list(front.get_xdata()) == [0.04, 0.08, 0.49]
    assert [round(y, 6) for y in front.get_ydata()] == [0.75, 0.79, 0.85]
    (points,) = [c for c in ax.collections if c.get_label() == "ksame"]
    assert len(points.get_offsets()) == 3  # one per setting, not per seed
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "anonymizer=ksame, k=50, seed=1 (failed; not on the front)" in labels, labels
