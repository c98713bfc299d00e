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
from server.memorization import headline, read_exposure
from tasks.config import ConfigError, validate


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
