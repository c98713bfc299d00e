"""The keeper against the cleanup of another fedpriv: its owner SIGKILLed, the folder it
reads looks stale to any other fedpriv starting a run (the owner is gone) until the
keeper has recorded the owner's runs as crashed and stopped what it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from experiments.runtime import keeper, procs
from experiments.runtime.owned_folders import OWNER_FILE, remove_stale_homes

from .conftest import REPO

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _wait(predicate, timeout=30.0):
    assert procs.wait_until(predicate, timeout, 0.02), "timed out"


def test_the_keeper_records_the_crash_though_another_fedpriv_cleans_up_at_once(tmp_path):
    home = tmp_path / "fp-owner"
    home.mkdir()
    run = tmp_path / "results" / "run"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"status": "running"}))
    owner, started_by_owner = subprocess.Popen(SLEEP), subprocess.Popen(SLEEP)
    keeper_proc = None
    try:
        (home / OWNER_FILE).write_text(json.dumps({"pid": owner.pid,
                                                   "started": procs.started(owner.pid)}))
        record = home / "processes.json"
        record.with_suffix(".roots").write_text(f"{started_by_owner.pid}\n")
        record.with_suffix(".runs").write_text(f"{run}\n")
        keeper_proc = subprocess.Popen([sys.executable, "-m", "experiments.runtime.keeper",
                                        str(record), str(owner.pid)], cwd=REPO)
        _wait(lambda: started_by_owner.pid in keeper.read_record(record))
        assert remove_stale_homes(tmp_path) == []  # the owner is alive
        owner.kill()
        owner.wait()
        # another fedpriv starting a run at once: the owner is gone, the keeper is not
        removed = []
        while keeper_proc.poll() is None:
            removed += remove_stale_homes(tmp_path)
            time.sleep(0.01)
        assert keeper_proc.returncode == 0
        assert removed == []  # the keeper removed its folder itself, when done
        assert not home.exists()
        info = json.loads((run / "run.json").read_text())
        assert info["status"] == "crashed"
        assert f"fedpriv (pid {owner.pid}) was killed" in info["error"]
        assert started_by_owner.wait(timeout=10) is not None
    finally:
        for p in (owner, started_by_owner, keeper_proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_the_keeper_marks_runs_listed_before_its_folder_was_removed(tmp_path):
    """Even when the folder is gone by the time the owner dies (removed by hand, or by an
    older fedpriv), the runs listed before are recorded as crashed."""
    home = tmp_path / "fp-owner"
    home.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"status": "running"}))
    owner, started_by_owner = subprocess.Popen(SLEEP), subprocess.Popen(SLEEP)
    keeper_proc = None
    try:
        record = home / "processes.json"
        record.with_suffix(".runs").write_text(f"{run}\n")
        record.with_suffix(".roots").write_text(f"{started_by_owner.pid}\n")
        keeper_proc = subprocess.Popen([sys.executable, "-m", "experiments.runtime.keeper",
                                        str(record), str(owner.pid)], cwd=REPO)
        # the root recorded: the keeper's pass that did it read the run list first
        _wait(lambda: started_by_owner.pid in keeper.read_record(record))
        for f in home.iterdir():
            f.unlink()
        owner.kill()
        owner.wait()
        assert keeper_proc.wait(timeout=30) == 0
        assert json.loads((run / "run.json").read_text())["status"] == "crashed"
    finally:
        for p in (owner, started_by_owner, keeper_proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_process_is_known_by_its_start_since_boot_not_the_wall_clock():
    me = os.getpid()
    assert procs.same_process(me, procs.started(me))
    assert not procs.same_process(me, procs.started(me) + 0.01)  # another process
    # psutil's wall-clock start is the same instant, up to the boot time it adds
    assert abs(psutil.Process(me).create_time() - psutil.boot_time()
               - procs.started(me)) < 1.0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    when = procs.started(child.pid)
    _wait(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE)
    assert not procs.same_process(child.pid, when)  # a zombie is gone
    child.wait()
    assert not procs.same_process(child.pid, when)
