"""The benchmarks' harness: timed runs are not sampled for memory (sampling stalls the
process sampled); the peaks come from an extra, untimed sitting."""

from __future__ import annotations

import sys

from experiments.benchmarks.fedavg_overhead import _merge, measured

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
