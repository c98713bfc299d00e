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
    import tempfile

    from experiments.runtime import inprocess

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr("clients.app._IN_PROCESS", False)  # restored after the test
    monkeypatch.delenv(shared_memo.MEMO_ENV, raising=False)
    monkeypatch.setattr(inprocess, "WorkerPool", _NoPool)
    monkeypatch.setattr("server.app.app", lambda grid, context: _seen.append((
        os.environ[shared_memo.MEMO_ENV],
        stat.S_IMODE(os.stat(os.environ[shared_memo.MEMO_ENV]).st_mode))))
    monkeypatch.setattr(inprocess, "workers", lambda run_config: 2)
    _seen.clear()
    inprocess.serve({"num-clients": 2}, 2)
    [(folder, mode)] = _seen
    assert mode == 0o700 and os.path.dirname(folder) == str(tmp_path)
    assert not os.path.exists(folder)  # removed when the run ends, and no longer named
    assert shared_memo.MEMO_ENV not in os.environ


_seen: list[tuple[str, int]] = []


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


def test_an_epsilon_asked_for_does_not_wait_for_another_being_computed(monkeypatch):
    # a client's epsilon for this round, while the next round's is computed ahead (here,
    # or in another process holding its memo lock): it is answered, not queued behind it
    import threading

    ahead, now = ((1.37, 0.05, 11),), ((1.37, 0.05, 12),)
    started, release = threading.Event(), threading.Event()
    real = accounting._compute

    def compute(history, delta, accountant, relation):
        if history == ahead:
            started.set()
            release.wait(60)
        return real(history, delta, accountant, relation)

    monkeypatch.setattr(accounting, "_compute", compute)
    monkeypatch.delenv(shared_memo.MEMO_ENV, raising=False)
    accounting._epsilon.cache_clear()
    slow = threading.Thread(target=accounting.epsilon, args=(ahead, 1e-5))
    slow.start()
    try:
        assert started.wait(30)
        answered: list[float] = []
        asker = threading.Thread(target=lambda: answered.append(accounting.epsilon(now, 1e-5)))
        asker.start()
        asker.join(30)
        assert answered == [real(now, 1e-5, "pld", "add-remove")]
    finally:
        release.set()
        slow.join(60)
        accounting._epsilon.cache_clear()


def _client_accounting_without_building(cfg, rounds: list[int], out: str) -> None:
    """In a forked worker: the client's ledger and its epsilons after ``rounds``, with
    dp-accounting's PLD construction and the calibration made to fail if reached."""
    from dp_accounting.pld import privacy_loss_distribution as pld_module

    from clients.local_dp import new_ledger, schedule
    from tasks.splits import expected_partition_size

    os.environ.pop(shared_memo.MEMO_ENV, None)

    def refused(*args, **kwargs):
        raise AssertionError("built in the worker")

    pld_module.from_gaussian_mechanism = refused
    accounting._calibrate_pld = refused
    n = expected_partition_size(cfg, 10)
    ledger = new_ledger(cfg, schedule(cfg, n, n), 10)
    steps = math.ceil(n / cfg.training.batch_size)
    values = [accounting.epsilon([(ledger.noise_multiplier, ledger.sample_rate, r * steps)],
                                 ledger.delta) for r in rounds]
    with open(out, "w") as f:
        f.write(" ".join(repr(v) for v in values))


def test_workers_forked_after_the_warm_up_calibrate_and_build_nothing(tmp_path):
    # what the in-process runtime does before forking its client workers: calibrate the
    # noise and build each grid's one-step PLD once; the workers' accounting then reaches
    # neither, on any round of the planned run (epsilon 25: three grids)
    from clients.local_dp import warm_accounting
    from experiments.configs import resolve

    cfg = resolve(None, ["dp=local", "target-epsilon=25", "num-clients=10",
                         "num-server-rounds=30"])
    warm_accounting(cfg, 10)
    out = str(tmp_path / "eps")
    child = multiprocessing.get_context("fork").Process(
        target=_client_accounting_without_building, args=(cfg, [1, 15, 30], out))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    first, middle, last = (float(v) for v in open(out).read().split())
    assert first < 10 < middle < 20 < last <= 25 * (1 + 1e-9)  # one value on each grid


def test_the_runtime_reads_back_the_noise_the_preflight_check_calibrated(tmp_path,
                                                                        monkeypatch):
    # the pre-flight check calibrates a target-epsilon run's noise (~2 s under the PLD) in
    # its own process; given the runtime's folder, it leaves the value there, and the
    # runtime's clients read it back to the bit instead of calibrating again
    from clients.local_dp import new_ledger, schedule
    from experiments.configs import resolve
    from experiments.preflight.isolated import preflight_isolated
    from tasks.splits import expected_partition_size

    cfg = resolve(None, ["dp=local", "target-epsilon=3.7", "num-clients=10"])
    folder = tmp_path / "epsilon"
    pre = preflight_isolated(cfg, {shared_memo.MEMO_ENV: str(folder)})
    assert "noise multiplier" in pre.privacy
    monkeypatch.setenv(shared_memo.MEMO_ENV, str(folder))
    monkeypatch.setattr(accounting, "_calibrate", lambda *a: pytest.fail("calibrated again"))
    accounting.calibrate_noise.cache_clear()
    n = expected_partition_size(cfg, 10)
    sigma = new_ledger(cfg, schedule(cfg, n, n), 10).noise_multiplier
    accounting.calibrate_noise.cache_clear()
    monkeypatch.undo()
    assert sigma == new_ledger(cfg, schedule(cfg, n, n), 10).noise_multiplier  # computed
    accounting.calibrate_noise.cache_clear()
