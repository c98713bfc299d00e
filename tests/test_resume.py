"""Resume after a crash: a resumed run's ledger equals an uninterrupted run's, epsilon is
never reset, and a round the clients trained before the crash is not accounted twice.

The real ServerApp code and the real ClientApp (mods, handlers, Opacus) in-process
(tests/inprocess.py); the crash is the server losing the replies of round 3 after the
clients trained it — the worst moment, since the clients' privacy ledgers already
count it. The end-to-end version (kill -9 of fedpriv) is in test_end_to_end.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from flwr.app import Context, RecordDict

from clients.state_store import StateFileError
from experiments.runtime.runner import LogFilter, recorded_outcome
from server.app import run_one
from server.checkpoint import FOLDER, SERVER_FILE, Checkpoint, ResumeError, resumable
from server.console import PREFIX
from server.summary import failure_lines
from tasks.config import ConfigError, validate
from tasks.files import temporary
from tasks.results.folder import RunFolder, read_run_info
from tasks.results.info import RunInfo
from tasks.results.ledger import RoundRecord, read_ledger

from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)

BASE = {"num-clients": 4, "num-server-rounds": 4, "fraction-train": 0.5, "batch-size": 64,
        "save-model": False, "local-epochs": 1}
TIMING = ("train-time-s",)


class LostReplies(InProcessGrid):
    """Clients train round ``crash_round`` (and keep its state); the server never hears back."""

    def __init__(self, cfg, crash_round, **grid):
        super().__init__(cfg, **{"simulated": True, **grid})
        self.crash_round = crash_round
        self.training_calls = 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        if any(m.metadata.message_type.startswith("train") for m in messages):
            self.training_calls += 1
            if self.training_calls == self.crash_round:
                raise ConnectionError("lost the connection to the SuperLink")
        return replies


def _context(cfg):
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                   run_config=cfg.flat())


def _comparable(records):
    return [{"round": r.round, "test": r.test, "sampled": r.sampled, "privacy": r.privacy,
             "clients": [{k: v for k, v in c.items() if k not in TIMING} for c in r.clients]}
            for r in records]


def _crash_and_resume(tmp_path, values, crash_round=3, **grid):
    """Run ``values`` uninterrupted and with a crash in ``crash_round``, then resume
    (``grid``: how the nodes are set up; by default simulated nodes)."""
    grid = {"simulated": True, **grid}
    whole = validate({**values, "run-dir": str(tmp_path / "whole")})
    run_one(InProcessGrid(whole, **grid), _context(whole), whole)
    cfg = validate({**values, "run-dir": str(tmp_path / "crashed")})
    grid, setup = LostReplies(cfg, crash_round, **grid), grid
    with pytest.raises(ConnectionError):
        run_one(grid, _context(cfg), cfg)
    crashed = tmp_path / "crashed"
    assert read_run_info(crashed)["status"] == "failed"
    assert [r.round for r in read_ledger(crashed)] == list(range(1, crash_round))
    assert Checkpoint.load(crashed).round == crash_round - 1
    RunFolder(resumable(crashed)[0]).reopen({"from-round": crash_round - 1})
    again = validate({**values, "run-dir": str(crashed), "resume": True})
    fresh = InProcessGrid(again, **setup)  # new processes: empty Contexts
    run_one(fresh, _context(again), again)
    return read_ledger(tmp_path / "whole"), read_ledger(crashed), grid, fresh


def test_resumed_local_dp_run_equals_an_uninterrupted_one(tmp_path, _task_identity):  # noqa: F811
    values = {**BASE, "dp": "local", "noise-multiplier": 1.0, "strategy": "fedadam",
              "server-lr": 0.01}
    whole, resumed, crashed_grid, fresh = _crash_and_resume(tmp_path, values)
    assert _comparable(resumed) == _comparable(whole)
    info = read_run_info(tmp_path / "crashed")
    assert info["status"] == "finished" and info["rounds-completed"] == 4
    assert info["resumed"][0]["status"] == "failed" and "SuperLink" in info["resumed"][0]["error"]
    assert "resumed after round 2" in (tmp_path / "crashed" / "summary.md").read_text()
    # the clients that trained the lost round 3 replayed it without paying twice: each
    # client's ledger counts every round it was sampled in, once
    for pid in range(4):
        rounds = [r.round for r in whole if pid in r.sampled]
        ledger = json.loads(json.dumps(dict(
            fresh.contexts[1000 + pid].state.config_records["dp-sgd"])))
        assert sorted(ledger["released-rounds"]) == rounds
    third = {c["partition-id"]: c["epsilon"] for c in resumed[2].clients}
    assert third == {c["partition-id"]: c["epsilon"] for c in whole[2].clients}
    # the crashed run's clients did train round 3: their state on disk said so
    assert crashed_grid.training_calls == 3
    states = list((tmp_path / "crashed" / FOLDER / "clients").rglob("partition-*.state"))
    assert len(states) == 4


@pytest.mark.parametrize("values", [
    # the accountant and the adaptive clipping norm are restored, not reset
    {"dp": "central", "noise-multiplier": 0.1, "clipping-norm": 1.0,
     "central-clipping": "server-adaptive"},
    # FedAvgM's server momentum is restored
    {"strategy": "fedavgm", "server-momentum": 0.9, "server-lr": 1.0},
    # correlated noise continues exactly where it was (replayed from the seed)
    {"dp": "central", "noise-multiplier": 0.05, "fraction-train": 1.0,
     "client-sampling": "cyclic", "cyclic-groups": 2, "central-mechanism": "banded-mf",
     "max-noise-to-signal": 0},
    {"dp": "central", "noise-multiplier": 0.05, "fraction-train": 1.0,
     "client-sampling": "cyclic", "cyclic-groups": 2, "central-mechanism": "tree",
     "max-noise-to-signal": 0},
    {"dp": "central", "noise-multiplier": 0.05, "fraction-train": 1.0,
     "client-sampling": "cyclic", "cyclic-groups": 2, "central-mechanism": "blt",
     "max-noise-to-signal": 0},
], ids=["central-dp-adaptive", "fedavgm", "banded-mf", "tree", "blt"])
def test_resumed_run_restores_the_strategy_state(tmp_path, _task_identity, values):  # noqa: F811
    whole, resumed, _, _ = _crash_and_resume(tmp_path, {**BASE, **values}, crash_round=2)
    assert _comparable(resumed) == _comparable(whole)
    if values.get("dp") == "central":
        assert resumed[-1].privacy["releases"] == 4
        if "central-mechanism" in values:
            assert resumed[-1].privacy["mechanism"] == values["central-mechanism"]
            assert [r.privacy["epsilon"] for r in resumed] == \
                [r.privacy["epsilon"] for r in whole]
        else:
            assert resumed[-1].privacy["clipping-norm"] != 1.0


def test_supernodes_with_a_state_dir_resume_like_simulated_clients(tmp_path,
                                                                   _task_identity):  # noqa: F811
    """Real SuperNodes (the server assigns nothing) keep their ledgers in their host's own
    state-dir: the resumed run equals the uninterrupted one, each round counted once."""
    values = {**BASE, "dp": "local", "noise-multiplier": 1.0}
    states = tmp_path / "hosts"
    whole, resumed, _, fresh = _crash_and_resume(
        tmp_path, values, simulated=False,
        node_config=lambda pid: {"state-dir": str(states / f"host-{pid}")})
    assert _comparable(resumed) == _comparable(whole)
    assert read_run_info(tmp_path / "crashed")["client-state"] == "on each SuperNode (state-dir)"
    assert sorted(p.relative_to(states).as_posix() for p in states.rglob("*.state")) == [
        f"host-{i}/{run}/partition-{i}.state" for i in range(4)
        for run in ("crashed", "whole")]
    for pid in range(4):
        ledger = fresh.contexts[1000 + pid].state.config_records["dp-sgd"]
        assert sorted(ledger["released-rounds"]) == [r.round for r in whole if pid in r.sampled]


def test_resume_is_refused_when_a_supernode_keeps_no_state(tmp_path, _task_identity):  # noqa: F811
    values = {**BASE, "dp": "local", "noise-multiplier": 1.0, "num-server-rounds": 2}
    cfg = validate({**values, "run-dir": str(tmp_path / "run")})
    keeps = {0: True, 1: True, 2: False, 3: True}
    setup = {"simulated": False, "node_config": lambda pid: (
        {"state-dir": str(tmp_path / "hosts")} if keeps[pid] else {})}
    with pytest.raises(ConnectionError):
        run_one(LostReplies(cfg, 2, **setup), _context(cfg), cfg)
    with pytest.raises(ConfigError, match="real SuperNodes without a state-dir"):
        resumable(tmp_path / "run")  # run.json recorded that client 2 keeps nothing
    RunFolder(tmp_path / "run").reopen({"from-round": 1})
    again = validate({**values, "run-dir": str(tmp_path / "run"), "resume": True})
    with pytest.raises(ResumeError, match=r"client\(s\) 2 keep no state"):
        run_one(InProcessGrid(again, **setup), _context(again), again)


def test_resume_is_refused_for_finished_running_and_unknown_folders(tmp_path):
    with pytest.raises(ConfigError, match="not a fedpriv run folder"):
        resumable(tmp_path)
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "run.json").write_text(json.dumps({"status": "finished"}))
    with pytest.raises(ConfigError, match="already finished"):
        resumable(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"status": "running"}))
    with pytest.raises(ConfigError, match="still 'running'"):
        resumable(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"status": "crashed"}))
    with pytest.raises(ConfigError, match="before its first round was checkpointed"):
        resumable(tmp_path)
    (tmp_path / FOLDER).mkdir()
    (tmp_path / FOLDER / SERVER_FILE).write_bytes(b"")  # an empty checkpoint is no checkpoint
    with pytest.raises(ConfigError, match="config.toml holds no keys"):  # nor an empty config
        resumable(tmp_path)
    (tmp_path / "config.toml").write_text("num-clients = 3\n")
    with pytest.raises(ConfigError, match="server.npz is damaged"):
        resumable(tmp_path)


FULL = "/dev/full"  # every write to it fails with ENOSPC, as on a full disk


@pytest.mark.skipif(not os.path.exists(FULL), reason="needs Linux's /dev/full")
def test_a_full_disk_stops_the_run_with_its_cause_and_no_half_written_files(
        tmp_path, _task_identity, capsys):  # noqa: F811
    cfg = validate({**BASE, "num-server-rounds": 3, "run-dir": str(tmp_path / "run")})
    (tmp_path / "run").mkdir()
    run = RunFolder(tmp_path / "run")
    # the checkpoint's file system fills up after round 1 (round 1's was written)
    run_one_round = validate({**BASE, "num-server-rounds": 1,
                              "run-dir": str(tmp_path / "one")})
    run_one(InProcessGrid(run_one_round, simulated=True), _context(run_one_round), run_one_round)
    (run.path / FOLDER).mkdir()
    os.symlink(FULL, temporary(run.path / FOLDER / SERVER_FILE))
    with pytest.raises(OSError, match="No space left on device.*the disk is full"):
        run_one(InProcessGrid(cfg, simulated=True), _context(cfg), cfg)
    info = read_run_info(run.path)
    assert info["status"] == "failed" and "the disk is full" in info["error"]
    assert [r.round for r in read_ledger(run.path)] == [1]  # the round itself is kept
    assert not temporary(run.path / FOLDER / SERVER_FILE).exists()
    assert "error: WriteFailed: cannot write" in capsys.readouterr().out
    # the ledger's own disk full: no half line is left for a reader to choke on
    (tmp_path / "ledger").mkdir()
    os.symlink(FULL, tmp_path / "ledger" / "metrics.jsonl")
    with pytest.raises(OSError, match="the disk is full"):
        RunFolder(tmp_path / "ledger").append_jsonl("metrics.jsonl", {"round": 1})


@pytest.mark.skipif(not os.path.exists(FULL), reason="needs Linux's /dev/full")
def test_a_full_disk_under_flwr_log_is_said_once_and_the_printed_cause_is_the_outcome(
        tmp_path):
    os.symlink(FULL, tmp_path / "flwr.log")
    seen = []
    log = LogFilter(tmp_path / "flwr.log", False, seen.append)
    cause = "WriteFailed: cannot write run.json: No space left on device (the disk is full)"
    for line in ("round 1", f"error: {cause}", "error: run.json could not record it either"):
        log(f"{PREFIX}{line}")
    log.close()
    assert sum("the rest of Flower's log is not kept" in s for s in seen) == 1
    assert f"error: {cause}" in seen
    # run.json never got the outcome: the cause the ServerApp printed is the outcome
    assert recorded_outcome(tmp_path, tmp_path / "flwr.log", None, log.last_error) == (
        "failed", cause)


def test_the_summary_names_each_failed_client_its_round_and_cause():
    rec = RoundRecord(round=3, test={"accuracy": 0.5, "loss": 1.0}, train={}, sampled=[0, 1],
                      clients=[{"partition-id": 0}], time={"round-s": 1.0},
                      failures=[
                          {"partition-id": 1, "error": "<class 'ClientAppException'>:<'\n"
                           "Traceback (most recent call last):\nValueError: boom\n'>"},
                          {"partition-id": 0, "phase": "evaluate",
                           "error": "UpdateRejected: w holds NaN or Inf"}])
    lines = failure_lines([rec], RunInfo(resumed=[{"from-round": 2, "at": "t",
                                                    "status": "crashed", "error": "killed",
                                                    "automatic": True}]))
    text = "\n".join(lines)
    assert "2 in 1 round(s)" in text
    assert "round 3, client 1: ValueError: boom" in text
    assert "round 3, client 0 (evaluate): UpdateRejected: w holds NaN or Inf" in text
    assert "restarted automatically after round 2" in text


def _dp_accounting_epsilon(client: dict) -> float:
    """A client's epsilon from its reported DP-SGD parameters, by Google's dp-accounting
    (PLD of the Poisson-subsampled Gaussian), built here apart from fedpriv's accountant."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(
        client["sample-rate"], dp_accounting.GaussianDpEvent(client["noise-multiplier"])),
        int(client["dp-steps"]))
    return acc.get_epsilon(client["delta"])


LOCAL_DP = {**BASE, "dp": "local", "noise-multiplier": 1.0}


def _crashed(tmp_path, values, crash_round=3):
    """An uninterrupted run and the same run crashed in ``crash_round`` (ledgers, path)."""
    whole = validate({**values, "run-dir": str(tmp_path / "whole")})
    run_one(InProcessGrid(whole, simulated=True), _context(whole), whole)
    cfg = validate({**values, "run-dir": str(tmp_path / "crashed")})
    with pytest.raises(ConnectionError):
        run_one(LostReplies(cfg, crash_round), _context(cfg), cfg)
    return read_ledger(tmp_path / "whole"), tmp_path / "crashed"


def _resume_in(path):
    folder, cfg = resumable(path)
    RunFolder(folder).reopen({"from-round": Checkpoint.load(folder).round})
    run_one(InProcessGrid(cfg, simulated=True), _context(cfg), cfg)
    return read_ledger(folder)


@pytest.mark.parametrize("move", ["renamed", "moved"])
def test_a_renamed_or_moved_local_dp_run_resumes_with_every_clients_ledger(
        tmp_path, _task_identity, move):  # noqa: F811
    """The client state is keyed by the run's id, not its folder's name: after a rename or
    a move the resumed epsilons equal the uninterrupted run's and dp-accounting's."""
    whole, crashed = _crashed(tmp_path, {**LOCAL_DP, "run-id": "run-a1"})
    target = tmp_path / ("renamed" if move == "renamed" else "elsewhere/deeper/crashed")
    target.parent.mkdir(parents=True, exist_ok=True)
    crashed.rename(target)
    resumed = _resume_in(target)
    assert _comparable(resumed) == _comparable(whole)
    for client in resumed[-1].clients:
        assert client["epsilon"] == pytest.approx(_dp_accounting_epsilon(client), rel=0.02)


def test_a_resume_without_the_clients_state_is_refused_not_reset(tmp_path, _task_identity):  # noqa: F811
    """Deleted (or another run's) client state: refused before any round, naming what to
    restore; nothing of the run is changed."""
    _, crashed = _crashed(tmp_path, {**LOCAL_DP, "run-id": "run-b2"})
    states = crashed / FOLDER / "clients"
    backup = tmp_path / "backup"
    states.rename(backup)
    ledger_before = (crashed / "metrics.jsonl").read_bytes()
    with pytest.raises(ResumeError, match="DP-SGD ledger holds 0 steps, but the checkpoint "
                                          "recorded") as err:
        _resume_in(crashed)
    assert "Restore the state files" in str(err.value)
    assert (crashed / "metrics.jsonl").read_bytes() == ledger_before
    # another run's state files put in this run's place: their owner record says whose
    shutil.copytree(backup, states)
    other = validate({**LOCAL_DP, "run-id": "run-zz", "run-dir": str(tmp_path / "zz")})
    run_one(InProcessGrid(other, simulated=True), _context(other), other)
    for f in (tmp_path / "zz" / FOLDER / "clients" / "run-zz").iterdir():
        shutil.copy(f, states / "run-b2" / f.name)
    # (in Flower's runtime the client's error reaches the server, which raises ResumeError)
    with pytest.raises((ResumeError, StateFileError), match="belongs to run run-zz"):
        _resume_in(crashed)


def _write_checkpoint_round(path, rnd):
    cp = Checkpoint.load(path)
    cp.round = rnd
    cp.save(path)


@pytest.mark.parametrize("damage, why", [
    (lambda p: _write_checkpoint_round(p, 99), "the checkpoint says round 99, but the run "
                                               "has 4 rounds"),
    (lambda p: (p / "config.toml").write_text((p / "config.toml").read_text().replace(
        "num-server-rounds = 4", "num-server-rounds = 1")), "num-server-rounds: 4 -> 1"),
    (lambda p: (p / "metrics.jsonl").unlink(), "metrics.jsonl holds rounds none"),
    (lambda p: (p / "metrics.jsonl").write_text("{not json\n"), "has a damaged line"),
    (lambda p: (p / "run.json").write_text("[1, 2]"), "holds a list"),
    (lambda p: (p / "run.json").write_text(""), "run.json is not JSON"),
    (lambda p: (p / "config.toml").write_text("= ="), "config.toml is not TOML"),
    (lambda p: (p / FOLDER / SERVER_FILE).write_bytes(b"garbage"), "is damaged"),
    (lambda p: (p / FOLDER / SERVER_FILE).write_bytes(
        (p / FOLDER / SERVER_FILE).read_bytes()[:200]), "is damaged"),
], ids=["round-99", "config-edited", "no-ledger", "garbage-ledger", "run-json-list",
        "run-json-empty", "config-not-toml", "checkpoint-garbage", "checkpoint-truncated"])
def test_a_resume_whose_files_disagree_or_are_damaged_is_refused_clearly(
        tmp_path, _task_identity, damage, why):  # noqa: F811
    values = {**BASE, "num-server-rounds": 4}
    cfg = validate({**values, "run-dir": str(tmp_path / "run")})
    with pytest.raises(ConnectionError):
        run_one(LostReplies(cfg, 3), _context(cfg), cfg)
    damage(tmp_path / "run")
    with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace(")", r"\)")):
        resumable(tmp_path / "run")


class Silent(InProcessGrid):
    """Clients that never answer a training message in time."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if any(m.metadata.message_type.startswith("train") for m in messages):
            return []
        return super().send_and_receive(messages, timeout=timeout)


def test_a_round_nobody_answered_fails_the_run_with_its_cause(tmp_path, _task_identity):  # noqa: F811
    """Not 'finished' with 0/N clients every round: no reply within round-timeout is a
    failure, and a round of failures stops the run; an impossible timeout is refused."""
    with pytest.raises(ConfigError, match="round-timeout"):
        validate({"round-timeout": 1e-9})
    cfg = validate({**BASE, "run-dir": str(tmp_path / "run"), "round-timeout": 5})
    with pytest.raises(Exception, match="no answer within 5 s"):
        run_one(Silent(cfg, simulated=True), _context(cfg), cfg)
    info = read_run_info(tmp_path / "run")
    assert info["status"] == "failed" and "no answer within 5 s" in info["error"]
    assert read_ledger(tmp_path / "run") == []


def test_a_hook_failing_while_stopping_never_hides_the_first_error(capsys):
    """The first error is the one reported: a plot hook that fails too on the way out (as
    matplotlib did on a full disk) is only mentioned."""
    from types import SimpleNamespace

    from flwr.app import ArrayRecord

    from server.loop import run_rounds

    class FullDisk:
        def run_round(self, rnd, arrays):
            raise OSError("cannot write checkpoint/server.npz (the disk is full)")

    class FailingPlot:
        def after_round(self, *a):
            pass

        def finish(self):
            raise RuntimeError("matplotlib could not save the figure")

    with pytest.raises(OSError, match="server.npz \\(the disk is full\\)"):
        run_rounds(FullDisk(), ArrayRecord(), 3, lambda a: {}, SimpleNamespace(
            resumed=lambda s: None), hooks=[FailingPlot()], start=2)
    assert "FailingPlot failed too: RuntimeError: matplotlib" in capsys.readouterr().out


def test_runs_that_ask_for_nothing_or_would_mix_folders_are_refused(tmp_path):
    """An observed set that is empty, and a run-dir that is a folder of other runs."""
    with pytest.raises(ConfigError, match="leakage-clients empty: the study would observe"):
        validate({"leakage-rounds": "1", "leakage-clients": ""})
    with pytest.raises(ConfigError, match="attacks empty"):
        validate({"leakage-rounds": "1", "attacks": " "})
    from tasks.results.folder import given_run_dir

    (tmp_path / "old-run").mkdir()
    (tmp_path / "old-run" / "run.json").write_text("{}")
    cfg = validate({"run-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="is a folder of runs"):
        given_run_dir(cfg.results)
    assert given_run_dir(validate({"run-dir": str(tmp_path / "new")}).results) == \
        (tmp_path / "new").resolve()
