"""A run's worker processes compute each epsilon once and read back the same bits."""

from __future__ import annotations

import math
import multiprocessing
import os
import stat
import time

import pytest

from privacy.dp import accounting, shared_memo

from .conftest import ledger_json, only_run, run_cli
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


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_local_dp_run_reports_its_epsilons_whoever_answers_the_clients(tmp_path, workers):
    # the CLI names the memo folder for its runtime either way; the clients in threads of
    # the runtime's own process use it too
    res = run_cli("run", "--set", "dp=local", "--set", "noise-multiplier=1.0", "--set",
                  f"client-workers={workers}", "--set", "num-clients=2", "--set",
                  "num-server-rounds=2", "--set", f"results-dir={tmp_path}")
    assert res.returncode == 0, res.stdout + res.stderr
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
    from dp_accounting.pld import PLDAccountant

    for record in ledger_json(only_run(tmp_path)):
        for client in record["clients"]:  # dp-accounting's own accountant, directly
            acc = PLDAccountant()
            acc.compose(PoissonSampledDpEvent(client["sample-rate"], GaussianDpEvent(1.0)),
                        client["dp-steps"])
            assert client["epsilon"] == float(acc.get_epsilon(client["delta"]))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_another_local_user_cannot_plant_an_epsilon(tmp_path, monkeypatch):
    # the adversary: another account on the machine, writing the value a run's clients
    # would read for their next epsilon into the runtime's memo folder
    import tempfile

    folder = tempfile.mkdtemp(prefix="fedpriv-epsilon-", dir=tmp_path)  # as serve() does
    os.chmod(tmp_path, 0o755)  # the adversary can reach the folder's parent
    key = ("epsilon", ((1.0, 0.08, 13),), 1e-5, "pld", "add-remove")
    name = shared_memo._path(folder, key).name
    pid = os.fork()
    if pid == 0:  # the other user: nobody
        try:
            os.setgid(65534)
            os.setuid(65534)
            with open(os.path.join(folder, name), "w") as f:
                f.write('{"value": 0.001}')
            os._exit(0)  # planted
        except OSError:
            os._exit(1)  # refused
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    monkeypatch.setenv(shared_memo.MEMO_ENV, folder)
    assert shared_memo.shared(key, lambda: 2.5) == 2.5
