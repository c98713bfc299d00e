"""The Secret Sharer in a real run: canaries planted in clients' text, their exposure in
the global model every round, recomputed here from the saved log-perplexities."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import skewnorm

import fedpriv
from tasks.config import ConfigError, validate
from tasks.results.exposure import headline, read_exposure


def test_canaries_need_text_and_sound_settings():
    with pytest.raises(ConfigError, match="mnist is image data"):
        validate({"secret-canaries": 2})
    with pytest.raises(ConfigError, match="secret-repetitions = '0,3'"):
        validate({"dataset": "shakespeare", "partitioner": "natural",
                  "secret-canaries": 2, "secret-repetitions": "0,3"})
    with pytest.raises(ConfigError, match="secret-clients = 4 is more than num-clients = 3"):
        validate({"dataset": "shakespeare", "partitioner": "natural", "num-clients": 3,
                  "secret-canaries": 2, "secret-clients": 4})


def test_headline_is_the_last_rounds_mean_per_repetition_count():
    rows = [{"round": 1, "repetitions": 1, "exposure": 9.0},
            {"round": 2, "repetitions": 1, "exposure": 1.0},
            {"round": 2, "repetitions": 1, "exposure": 2.0},
            {"round": 2, "repetitions": 10, "exposure": 7.0}]
    assert headline(rows) == {1: 1.5, 10: 7.0}


@pytest.mark.slow
def test_a_run_measures_each_canary_every_round_and_the_files_recompute_it(tmp_path):
    res = fedpriv.run(dataset="shakespeare", partitioner="natural", num_clients=4,
                      num_server_rounds=2, local_steps=3, batch_size=10, lr=0.8,
                      secret_canaries=3, secret_length=3, secret_repetitions="1,50",
                      secret_samples=100, results_dir=str(tmp_path), echo=None)
    assert res.ok, res.error
    run = Path(res.run_dir)
    rows = read_exposure(run)
    assert [(r["round"], r["canary"]) for r in rows] == [(1, 0), (1, 1), (1, 2),
                                                          (2, 0), (2, 1), (2, 2)]
    assert [r["repetitions"] for r in rows[:3]] == [1, 50, 1]
    for r in rows:
        assert r["method"] == "exact" and r["space"] == 1000
        saved = np.load(run / "exposure" / f"round-{r['round']:04d}.npz")
        every = saved[f"canary{r['canary']}-all"]
        assert len(every) == 1000 and every[int(r["secret"])] == pytest.approx(
            r["log-perplexity"])
        rank = 1 + int(np.sum(every < r["log-perplexity"]))  # ties go to the canary
        assert r["rank"] == rank
        assert r["exposure"] == pytest.approx(math.log2(1000) - math.log2(rank))
        sample = saved[f"canary{r['canary']}-sample"]
        a, loc, scale = r["skewnorm"]["a"], r["skewnorm"]["loc"], r["skewnorm"]["scale"]
        fitted = skewnorm.fit(sample)
        assert np.allclose((a, loc, scale), fitted, rtol=1e-6, atol=1e-9)
        assert r["exposure-extrapolated"] == pytest.approx(
            -skewnorm.logcdf(r["log-perplexity"], a, loc, scale) / math.log(2), rel=1e-6)
    assert (run / "plots" / "exposure.png").is_file()
    summary = (run / "summary.md").read_text()
    assert "memorization (Secret Sharer" in summary and "plots/exposure.png" in summary
    lines = [json.loads(line) for line in (run / "exposure.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all("sample-log-perplexity" not in line for line in lines)


def _cell(tmp_path, index, params, eps, exposures, seed=None, status="finished"):
    from experiments.sweep.spec import Cell

    run = tmp_path / f"c{index}"
    run.mkdir()
    lines = [json.dumps({"round": 3, "canary": i, "repetitions": reps, "space": 10**6,
                         "exposure": value})
             for i, (reps, value) in enumerate(exposures)]
    (run / "exposure.jsonl").write_text("\n".join(lines) + "\n")
    privacy = {"mode": "none"} if eps is None else {"mode": "central", "epsilon": eps}
    return Cell(index, params, None, status, run_dir=run, seed=seed,
                result={"privacy": privacy, "final": {"accuracy": 0.3}})


def test_a_sweep_tabulates_and_draws_exposure_against_epsilon(tmp_path):
    from experiments.sweep.memorization import exposure_plots, exposure_text

    cells = [_cell(tmp_path, 1, {"dp": "none"}, None, [(1, 2.0), (100, 15.0)], seed=1),
             _cell(tmp_path, 2, {"dp": "none"}, None, [(1, 3.0), (100, 17.0)], seed=2),
             _cell(tmp_path, 3, {"dp": "central"}, 1.0, [(1, 1.0), (100, 1.5)]),
             _cell(tmp_path, 4, {"dp": "central", "x": 1}, 8.0, [(1, 1.2), (100, 9.0)],
                   status="failed")]
    assert exposure_text(cells[0]) == "1x=2.0 100x=15.0"
    fig = exposure_plots("t", cells)["exposure_privacy.png"]
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    hundred = lines["100 repetitions"]
    assert list(hundred.get_ydata()) == [1.5, 16.0]  # epsilon 1, then no DP (mean of seeds)
    secagg = _cell(tmp_path, 5, {"dp": "none", "secure-aggregation": "secagg+"}, None,
                   [(1, 1.0), (100, 4.0)])
    fig = exposure_plots("t", [*cells, secagg])["exposure_privacy.png"]
    ys = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].get_lines()}
    assert sorted(ys["100 repetitions"]) == [1.5, 4.0, 16.0]  # a cell each, never merged
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "no DP"]
    assert any("failed" in label and "not drawn" in label for label in lines)
    assert exposure_plots("t", [_cell(tmp_path, 9, {}, None, [])]) == {}
