"""Reconstruction judged over many updates: the interval against independent
computations, and the run's summary and the sweep's table reporting mean, interval and n."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.leakage.report import leakage_section, summarize
from experiments.leakage.spread import mean_interval, pooled, pooled_markdown, run_spread_plots

# 20 PSNRs in dB, as 20 single-image updates might give
SAMPLE = [31.2, 18.0, 39.7, 26.6, 26.7, 32.9, 25.2, 27.8, 29.3, 22.3,
          40.9, 23.5, 30.2, 25.0, 27.6, 11.6, 24.8, 35.1, 28.4, 21.9]
T_975_19 = 2.093024054408263  # Student's t, 97.5% quantile, 19 degrees of freedom (tables)


def test_interval_is_students_t_by_hand():
    xs = np.array(SAMPLE)
    mean, sd = xs.sum() / 20, math.sqrt(((xs - xs.sum() / 20) ** 2).sum() / 19)
    half = T_975_19 * sd / math.sqrt(20)
    got = mean_interval(SAMPLE)
    assert got["n"] == 20 and got["mean"] == pytest.approx(mean)
    assert got["ci95"] == pytest.approx([mean - half, mean + half], rel=1e-9)
    assert got["sd"] == pytest.approx(sd) and (got["min"], got["max"]) == (11.6, 40.9)
    # one value has no interval; non-finite values are not counted
    assert mean_interval([27.0])["ci95"] is None and mean_interval([27.0])["n"] == 1
    assert mean_interval([1.0, float("nan"), 3.0])["n"] == 2
    assert mean_interval([5.0, 5.0, 5.0])["ci95"] == [5.0, 5.0]


def test_interval_agrees_with_a_percentile_bootstrap_and_covers_95_percent():
    # an independent estimate: numpy's percentile bootstrap of the mean (slightly
    # narrower than t for n = 20, as it ignores the t tail)
    rng = np.random.default_rng(0)
    xs = np.array(SAMPLE)
    means = xs[rng.integers(0, 20, size=(20_000, 20))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    t_lo, t_hi = mean_interval(SAMPLE)["ci95"]
    assert abs(t_lo - lo) < 0.6 and abs(t_hi - hi) < 0.6 and t_hi - t_lo > hi - lo
    # and it covers the true mean of normal samples about 95% of the time
    draws = rng.normal(25.0, 6.0, size=(2000, 20))
    covered = np.mean([lo <= 25.0 <= hi for lo, hi in
                       (mean_interval(d)["ci95"] for d in draws)])
    assert 0.935 <= covered <= 0.965


def _lines(psnrs, ssims, rnd=1):
    return [{"round": rnd, "client": c, "attack": "invert", "psnr": p, "ssim": s,
             "psnr-random": 5.0, "label-accuracy": 1.0, "seconds": 20.0, "labels": "recovered"}
            for c, (p, s) in enumerate(zip(psnrs, ssims, strict=True))]


def test_the_summary_reports_mean_interval_and_n_over_observations(tmp_path):
    ssims = [0.5 + 0.02 * i for i in range(20)]
    lines = _lines(SAMPLE, ssims) + [{"round": 1, "client": 20, "attack": "invert",
                                      "skipped": "too many examples"}]
    s = summarize(lines)["invert"]
    assert s["n"] == 20 and s["psnr"] == pytest.approx(np.mean(SAMPLE))
    assert s["psnr-ci95"] == pytest.approx(mean_interval(SAMPLE)["ci95"])
    assert s["ssim-ci95"] == pytest.approx(mean_interval(ssims)["ci95"])
    assert s["psnr-per-update"] == SAMPLE and s["psnr-min"] == 11.6
    text = leakage_section(summarize(lines))
    lo, hi = s["psnr-ci95"]
    assert f"PSNR **{np.mean(SAMPLE):.1f} dB (95% CI {lo:.1f}-{hi:.1f}, n = 20)**" in text
    assert "per update 11.6-40.9 dB" in text
    # one observation: the mean with n = 1 and no interval, said so
    one = leakage_section(summarize(_lines([30.0], [0.8])))
    assert "30.0 dB (n = 1: no interval)" in one
    # the run's spread plot and grid need two or more updates with pixels
    pixels = tmp_path / "reconstructions"
    pixels.mkdir()
    for x in lines[:3]:
        x["pixels"] = f"reconstructions/{x['client']}.npz"
        np.savez(tmp_path / x["pixels"], original=np.zeros((1, 1, 4, 4)),
                 reconstruction=np.ones((1, 1, 4, 4)))
    drawn = run_spread_plots(tmp_path, lines)
    assert [p.name for p in drawn] == ["invert-spread.png", "invert-all.png"]
    assert all(p.stat().st_size > 0 for p in drawn)


def test_a_sweeps_seeds_are_pooled_per_cell_and_round():
    rows = [{"cell": i, "group": "batch-size=8", "round": 1, "defence": "none",
             "setting": "8 ex, batch 8, 1 ep", "psnr-values": [p], "ssim-values": [0.4],
             "run-dir": "x", "inverted-lines": []} for i, p in enumerate([17.0, 15.5, 19.2,
                                                                           14.1, 18.3])]
    rows.append({**rows[0], "cell": 9, "group": "batch-size=32", "psnr-values": [12.0]})
    pools = pooled(rows)
    assert [(p["group"], p["runs"], p["updates"]) for p in pools] == [
        ("batch-size=8", 5, 5), ("batch-size=32", 1, 1)]
    assert pools[0]["psnr"]["ci95"] == pytest.approx(
        mean_interval([17.0, 15.5, 19.2, 14.1, 18.3])["ci95"])
    md = "\n".join(pooled_markdown(pools))
    assert "| none | 8 ex, batch 8, 1 ep | 1 | 5 | 5 | 16.8 (95% CI" in md
    assert "12.0 (n = 1: no interval)" in md
    # a single update per cell: nothing to pool (the table's rows say it all)
    assert pooled(rows[:1] + rows[5:]) == []
