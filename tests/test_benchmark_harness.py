"""The benchmarks' harness: timed runs are not sampled for memory (sampling stalls the
process sampled); the peaks come from an extra, untimed sitting. The accounting view
times the epsilons a run reports, which are dp-accounting's."""

from __future__ import annotations

import sys

from experiments.benchmarks.dp_overhead import accounting_times, same_batch_sets
from experiments.benchmarks.fedavg_overhead import DEFAULT_SET, _merge, measured
from experiments.configs import resolve

from .conftest import fresh_epsilon

HOLD = [sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(0.6); print('ok')"]


def test_memory_is_sampled_only_when_asked() -> None:
    wall, rss, pss, out = measured(HOLD, memory=True)
    assert out.strip() == "ok" and wall >= 0.6
    assert rss > 64 << 20 and 0 < pss <= rss
    wall, rss, pss, out = measured(HOLD, memory=False)
    assert out.strip() == "ok" and wall >= 0.6 and rss == pss == 0


def test_peaks_come_from_the_memory_runs_and_times_from_the_timed_ones() -> None:
    timed = [{"total-s": t, "rounds-s": [t / 2, t / 4, t / 4], "peak-rss": 0, "peak-pss": 0,
              "accuracy": [0.5], "loss": [1.0]} for t in (4.0, 8.0)]
    sampled = [{"total-s": 99.0, "rounds-s": [50.0, 49.0], "peak-rss": 7, "peak-pss": 5,
                "accuracy": [0.5], "loss": [1.0]}]
    merged = _merge(timed, sampled)
    assert merged["total-s"] == 6.0 and merged["steady-round-s"] == 1.5
    assert (merged["peak-rss"], merged["peak-pss"]) == (7, 5)
    assert _merge(timed, [])["peak-pss"] == 0


def test_the_accounting_view_times_the_epsilons_a_run_reports() -> None:
    # the MNIST default under local DP: batch 64 of the public 400 records, 7 steps a round
    cfg = resolve(None, [*DEFAULT_SET, "dp=local", "noise-multiplier=1.0"])
    rows = accounting_times(cfg, 3)
    assert [(a["round"], a["steps"]) for a in rows] == [(1, 7), (2, 14), (3, 21)]
    for a in rows:  # an independent dp-accounting computation of the same history
        assert a["epsilon"] == fresh_epsilon([(1.0, 64 / 400, a["steps"])], 1 / 4000, "pld")
        assert a["rdp-epsilon"] > a["epsilon"] > 0
        assert a["fedpriv-s"] >= 0 and a["dp-accounting-s"] > 0 and a["rdp-s"] > 0
    assert rows[0]["epsilon"] < rows[1]["epsilon"] < rows[2]["epsilon"]


def test_plain_sgd_is_also_timed_at_the_settings_dp_sgd_trains_at() -> None:
    """The DP round's own floor: plain SGD at DP-SGD's batch size and learning rate where a
    local-DP run takes settings of its own (MNIST's), and no such variant where it keeps
    the run's (a model without tuned settings, or a batch size the user set)."""
    from experiments.dp_defaults import MNIST_SETTINGS

    own = [f"{k}={MNIST_SETTINGS[k]}" for k in ("batch-size", "lr")]
    for sets in (DEFAULT_SET, [*DEFAULT_SET, "model=mlp"]):
        assert same_batch_sets(resolve(None, sets), None, sets) == own
        plain = resolve(None, [*sets, "dp=none", *own]).training
        dp = resolve(None, [*sets, "dp=local", "noise-multiplier=1.0"]).training
        assert (plain.batch_size, plain.lr) == (dp.batch_size, dp.lr)
    for sets in ([*DEFAULT_SET, "model=cnn"], [*DEFAULT_SET, "batch-size=64"]):
        assert same_batch_sets(resolve(None, sets), None, sets) == []


def test_the_conv_benchmark_times_two_ways_to_the_same_clipping() -> None:
    """Both ways the convolution benchmark times give the same per-example norms and
    clipped sums for every shape it lists, so its table compares like with like."""
    import torch

    from experiments.benchmarks.conv_clipping import SHAPES, ways

    for shape in SHAPES:
        runs = ways(shape)
        (sq_g, sums_g), (sq_i, sums_i) = runs["ghost"](), runs["instantiated"]()
        assert torch.allclose(sq_g, sq_i, rtol=1e-4), shape.name
        for a, b in zip(sums_g, sums_i, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-3), shape.name
        assert runs["sgd"]().shape == shape.layer().weight.shape
