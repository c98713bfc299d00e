"""A sweep's cells side by side: the schedule (order, how many at once, cells that run
alone, an error that stops it), which configs run alone, and the bad values refused."""

from __future__ import annotations

import threading
import time

import pytest

from experiments import api
from server.cells import alone_reason, schedule
from tasks.config import ConfigError, validate

from .conftest import run_cli


def _recording(pairs: tuple[tuple[int, int], ...] = (), fail: int | None = None):
    """A cell runner that records when each cell started and ended (an event count) and
    the most cells running at once. The cells of each of ``pairs`` meet at a barrier (30 s
    at most: run one after the other they never meet, and the schedule raises); ``fail``
    raises once its partner is running, the partner ending well after it."""
    lock = threading.Lock()
    clock = iter(range(10**6))
    spans: dict[int, list[int]] = {}
    running: set[int] = set()
    most = [0]
    meet = {c: b for pair in pairs for b in [threading.Barrier(2, timeout=30)] for c in pair}
    failed = threading.Event()

    def run(cell: int) -> None:
        with lock:
            spans[cell] = [next(clock)]
            running.add(cell)
            most[0] = max(most[0], len(running))
        if cell in meet:
            meet[cell].wait()
        if cell == fail:
            failed.set()
            raise KeyboardInterrupt(f"cell {cell}")
        if fail is not None and failed.wait(30):
            time.sleep(0.5)  # ends well after the failure was recorded
        with lock:
            running.discard(cell)
            spans[cell].append(next(clock))

    def beside(a: int, b: int) -> bool:
        return spans[a][0] < spans[b][-1] and spans[b][0] < spans[a][-1]

    return run, spans, beside, most


def test_cells_run_in_order_at_most_n_at_once_and_the_alone_ones_by_themselves():
    run, spans, beside, most = _recording(pairs=((1, 2), (4, 5)))
    schedule([1, 2, 3, 4, 5, 6], 2, lambda c: c == 3, run)  # 1 and 2, 4 and 5 meet
    started = sorted(spans, key=lambda c: spans[c][0])
    assert started[:3] == [1, 2, 3] and sorted(started) == [1, 2, 3, 4, 5, 6]
    assert not any(beside(3, c) for c in spans if c != 3)  # the alone cell, by itself
    assert most[0] == 2  # never more than two at once
    run, spans, beside, most = _recording()
    schedule([1, 2, 3], 1, lambda c: False, run)
    assert sorted(spans, key=lambda c: spans[c][0]) == [1, 2, 3] and most[0] == 1


def test_an_error_in_one_cell_lets_the_running_end_starts_no_other_and_is_raised():
    run, spans, beside, most = _recording(pairs=((1, 2),), fail=1)
    with pytest.raises(KeyboardInterrupt, match="cell 1"):
        schedule([1, 2, 3, 4, 5], 2, lambda c: False, run)
    # cell 2, running beside cell 1, ended; no cell started after cell 1 failed
    assert len(spans[2]) == 2 and set(spans) == {1, 2}


@pytest.mark.parametrize("values, reason", [
    ({}, None),
    ({"dp": "local", "noise-multiplier": 1.0}, None),
    ({"dp": "central"}, None),
    ({"secure-aggregation": "secagg+"}, "secure aggregation"),
    ({"leakage-rounds": "1"}, "the leakage study"),
    ({"resume": True}, "a resumed run"),
])
def test_cells_whose_server_does_more_than_plain_or_dp_fedavg_run_alone(values, reason):
    assert alone_reason(validate(values)) == reason


def test_a_bad_number_of_cells_at_once_is_refused_before_anything_runs(tmp_path):
    res = run_cli("sweep", "nothing.toml", "--cells-at-once", "0", cwd=tmp_path)
    assert res.returncode == 2 and "--cells-at-once 1" in res.stderr
    assert not list(tmp_path.iterdir())
    for bad in (0, 65, "2", 1.5, True):
        with pytest.raises(ConfigError, match="cells_at_once"):
            api.sweep(grid={"lr": [0.1]}, cells_at_once=bad, echo=None)
