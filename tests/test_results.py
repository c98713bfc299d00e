import json
from pathlib import Path

import pytest

from tasks.config import ConfigError, validate
from tasks.results.folder import RunFolder, new_run_dir, read_run_info
from tasks.results.ledger import RoundRecord, outcome, read_ledger


def _record(r: int, accuracy: float = 0.5, **extra) -> RoundRecord:
    return RoundRecord(round=r, test={"accuracy": accuracy, "loss": 1.0}, train={},
                       sampled=[0], clients=[{"partition-id": 0}], failures=[],
                       time={"round-s": 1.0 + r}, **extra)


def test_new_run_dirs_never_collide(tmp_path):
    dirs = {new_run_dir(tmp_path, "same name") for _ in range(5)}
    assert len(dirs) == 5 and all(d.is_dir() for d in dirs)
    assert all(" " not in d.name for d in dirs)


def test_run_folder_refuses_an_existing_run(tmp_path):
    cfg = validate({"run-dir": str(tmp_path / "r")})
    run = RunFolder.open(cfg.results, "x")
    run.append_round(_record(1))
    (tmp_path / "r" / "keep.txt").write_text("precious")
    with pytest.raises(ConfigError, match="already holds a run"):
        RunFolder.open(cfg.results, "x")
    assert (tmp_path / "r" / "keep.txt").read_text() == "precious"
    assert read_ledger(tmp_path / "r") == [_record(1)]


def test_ledger_is_appended_one_typed_line_per_round(tmp_path):
    run = RunFolder.open(validate({"results-dir": str(tmp_path)}).results, "x")
    for r in (1, 2, 3):
        run.append_round(_record(r, r / 10, privacy={"mode": "central", "epsilon": r},
                                 client_eval={"accuracy": 0.5}))
    lines = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2, 3]
    assert "client-eval" in lines[0] and "skipped" not in lines[0]  # the file's own keys
    ledger = read_ledger(run.path)
    assert ledger[2].privacy == {"mode": "central", "epsilon": 3}
    assert ledger[0].client_eval == {"accuracy": 0.5}
    res = outcome(ledger)
    assert res["final"]["round"] == 3 and res["best"]["accuracy"] == 0.3
    assert res["steady-round-s"] == pytest.approx(3.5)
    run.write_json("run.json", {"status": "finished"})
    assert read_run_info(run.path) == {"status": "finished"}


def test_an_outcome_is_recorded_once(tmp_path):
    # A ServerApp that lost its owner must not overwrite the owner's "crashed".
    from tasks.results.folder import OutcomeAlreadyRecorded
    from tasks.results.info import RunInfo

    run = RunFolder(tmp_path)
    run.write_info(RunInfo())
    run.write_info(RunInfo(rounds_completed=1))  # progress: fine
    run.write_json("run.json", {"status": "crashed", "error": "SuperLink died"})
    with pytest.raises(OutcomeAlreadyRecorded, match="already records the outcome 'crashed'"):
        run.write_info(RunInfo(status="finished"))
    assert read_run_info(tmp_path)["status"] == "crashed"


def test_stale_private_folders_of_dead_owners_are_removed(tmp_path):
    import os
    import subprocess
    import sys

    from experiments.runtime.keeper import KEEPER_FILE
    from experiments.runtime.owned_folders import OWNER_FILE, remove_stale_homes
    from experiments.runtime.procs import started

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    when = started(gone.pid)
    gone.wait()
    dead = {"pid": gone.pid, "started": when}
    me = {"pid": os.getpid(), "started": started(os.getpid())}
    for name, owner, its_keeper in (("fp-dead", dead, None), ("fp-live", me, None),
                                    ("fp-kept", dead, me), ("fp-both-dead", dead, dead),
                                    ("fp-unknown", None, None)):
        (tmp_path / name).mkdir()
        if owner:
            (tmp_path / name / OWNER_FILE).write_text(json.dumps(owner))
        if its_keeper:
            (tmp_path / name / KEEPER_FILE).write_text(json.dumps(its_keeper))
    assert sorted(remove_stale_homes(tmp_path)) == [tmp_path / "fp-both-dead",
                                                    tmp_path / "fp-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp-kept", "fp-live", "fp-unknown"]


def test_private_folders_left_by_a_sigkilled_process_are_removed_by_the_next_start(tmp_path):
    """The app folder a run stages for Flower and a warm SuperNode's secret folder are
    removed at exit; a process SIGKILLed (no exit code runs) leaves them, and the next
    start's staging removes them, not a live process's."""
    import os
    import subprocess
    import sys
    import tempfile

    from experiments.runtime.app_bundle import stage_app

    killed = ("import os, signal\n"
              "from experiments.runtime.app_bundle import stage_app\n"
              "from experiments.deploy.warm_node import write_runtime_secret\n"
              "print(stage_app(), write_runtime_secret().parent, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", killed], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    staged, secret = map(Path, out.stdout.split())
    assert (staged / "pyproject.toml").exists() and (secret / "runtime.secret").exists()
    assert staged.is_relative_to(tmp_path) and secret.is_relative_to(tmp_path)
    cached, tempfile.tempdir = tempfile.tempdir, str(tmp_path)
    try:
        mine = stage_app()
        again = stage_app()
    finally:
        tempfile.tempdir = cached
    assert not staged.exists() and not staged.parent.exists() and not secret.exists()
    assert (mine / "pyproject.toml").exists() and (again / "pyproject.toml").exists()
    assert sorted(tmp_path.iterdir()) == sorted({mine.parent, again.parent})


def test_run_info_round_trips_run_json_and_keeps_keys_it_does_not_know():
    from tasks.results.info import RunInfo

    raw = {"status": "finished", "rounds-completed": 3, "final": {"accuracy": 0.9},
           "resumed": [{"from-round": 1}], "from-a-newer-version": {"x": 1}}
    info = RunInfo.from_json(raw)
    assert info.rounds_completed == 3 and info.final == {"accuracy": 0.9}
    assert info.extra == {"from-a-newer-version": {"x": 1}}
    assert info.to_json() == raw and info.get("rounds-completed") == 3
    info.update({"best": {"round": 2}, "wall-s": 1.5})
    assert info.best == {"round": 2} and info.wall_s == 1.5
    assert "error" not in RunInfo().to_json()  # None is left out of the file
