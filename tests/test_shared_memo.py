"""A run's worker processes compute each epsilon once and read back the same bits."""

from __future__ import annotations

import math
import multiprocessing
import os
import stat
import time

import pytest

from privacy.dp import accounting, shared_memo

from .test_strategies import _task_identity  # noqa: F401  (fixture)


def _one(folder: str, counter: str, out: str) -> None:
    os.environ[shared_memo.MEMO_ENV] = folder

    def compute() -> float:
        with open(counter, "a") as f:
            f.write("computed\n")
        time.sleep(0.3)  # the other process asks meanwhile
        return math.pi / 7

    value = shared_memo.shared(("test", 1), compute)
    with open(out, "a") as f:
        f.write(f"{value!r}\n")


def test_two_processes_compute_an_epsilon_once_and_get_the_same_bits(tmp_path):
    ctx = multiprocessing.get_context("fork")
    counter, out = str(tmp_path / "count"), str(tmp_path / "values")
    procs = [ctx.Process(target=_one, args=(str(tmp_path), counter, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert open(counter).read().splitlines() == ["computed"]
    assert [float(v) for v in open(out).read().split()] == [math.pi / 7] * 2


def test_an_epsilon_through_the_memo_is_the_accountants(tmp_path, monkeypatch):
    history = ((1.1, 0.08, 26),)
    direct = accounting._compute(history, 1e-5, "pld", "add-remove")
    monkeypatch.setenv(shared_memo.MEMO_ENV, str(tmp_path))
    accounting._epsilon.cache_clear()
    assert accounting.epsilon(history, 1e-5) == direct
    assert len(list(tmp_path.glob("*.json"))) == 1
    accounting._epsilon.cache_clear()


@pytest.mark.parametrize("value", [0.0, 1 / 3, 4.639057123456789, math.inf])
def test_a_shared_value_is_read_back_to_the_bit(tmp_path, monkeypatch, value):
    monkeypatch.setenv(shared_memo.MEMO_ENV, str(tmp_path))
    assert shared_memo.shared(("v", value), lambda: value) == value
    assert shared_memo.shared(("v", value), lambda: pytest.fail("computed twice")) == value


def test_the_runtime_memo_folder_is_private_to_its_user(tmp_path, monkeypatch,
                                                        _task_identity):  # noqa: F811
    # another local user must not be able to plant an epsilon for a run's clients: the
    # runtime's folder is created 0700 (tempfile.mkdtemp), as serve() makes it
    from experiments.runtime import inprocess

    made = []
    real = inprocess.tempfile.mkdtemp

    def noted(*a, **k):
        made.append(real(*a, dir=tmp_path, **{k_: v for k_, v in k.items() if k_ != "dir"}))
        return made[-1]

    monkeypatch.setattr(inprocess.tempfile, "mkdtemp", noted)
    monkeypatch.setattr("clients.app._IN_PROCESS", False)  # restored after the test
    monkeypatch.delenv(shared_memo.MEMO_ENV, raising=False)
    monkeypatch.setattr(inprocess, "WorkerPool", _NoPool)
    monkeypatch.setattr("server.app.app", lambda grid, context: _seen.append(
        stat.S_IMODE(os.stat(os.environ[shared_memo.MEMO_ENV]).st_mode)))
    monkeypatch.setattr(inprocess, "workers", lambda run_config: 2)
    inprocess.serve({"num-clients": 2}, 2)
    assert made and _seen == [0o700]
    assert not os.path.exists(made[0])  # removed when the run ends, and no longer named
    assert shared_memo.MEMO_ENV not in os.environ


_seen: list[int] = []


class _NoPool:
    def __init__(self, app, workers) -> None:
        pass

    def close(self) -> None:
        pass
