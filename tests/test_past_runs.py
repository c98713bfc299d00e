"""Past runs at hand: `fedpriv runs` and fedpriv.runs() list every run folder (sweep cells
included) with its headline numbers, from the files runs write."""

from __future__ import annotations

import fedpriv
from tasks.config import validate
from tasks.results.folder import RunFolder
from tasks.results.info import RunInfo

from .conftest import run_cli


def _run(path, started: str, status: str, accuracy: float | None, privacy: dict | None,
         dataset: str = "mnist") -> None:
    folder = RunFolder(path)
    folder.write_config(validate({"dataset": dataset} if dataset != "mnist" else {}))
    info = RunInfo(status=status, started=started, model="small-cnn", num_clients=10,
                   rounds_completed=3, privacy=privacy, wall_s=4.5,
                   final={"accuracy": accuracy} if accuracy is not None else None)
    folder.write_info(info)


def _results(tmp_path):
    root = tmp_path / "results"
    _run(root / "20261129-100000-b", "2026-11-29T10:00:00+00:00", "finished", 0.9132,
         {"mode": "central", "epsilon": 3.9871})
    _run(root / "20261129-090000-a", "2026-11-29T09:00:00+00:00", "interrupted", None, None,
         "breast-cancer")
    _run(root / "sweeps" / "20261129-110000-s" / "cells" / "01-dp-local",
         "2026-11-29T11:00:00+00:00", "finished", 0.8, {"mode": "local", "epsilon-max": 5.0})
    bad = root / "20261129-120000-damaged"
    bad.mkdir()
    (bad / "run.json").write_text("{ not json")
    return root


def test_fedpriv_runs_lists_every_run_oldest_first_with_its_headline(tmp_path):
    root = _results(tmp_path)
    res = run_cli("runs", str(root))
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| 2026") or
            line.startswith("| sweeps")]
    assert [r.split("|")[1].strip() for r in rows] == [
        "20261129-090000-a", "20261129-100000-b", "sweeps/20261129-110000-s/cells/01-dp-local",
        "20261129-120000-damaged"]
    b = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert b == ["20261129-100000-b", "finished", "mnist", "small-cnn", "10", "3", "0.9132",
                 "3.99", "2026-11-29 10:00:00", "4.5"]
    assert "interrupted" in rows[0] and "breast-cancer" in rows[0]
    assert rows[3].split("|")[2].strip() == "unreadable"  # listed, not hidden
    assert "4 of 4 run(s)" in res.stdout
    last = run_cli("runs", str(root), "--last", "1")
    assert "1 of 4 run(s)" in last.stdout
    missing = run_cli("runs", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "is not a folder" in missing.stderr


def test_the_python_api_gives_the_same_runs_as_a_frame(tmp_path):
    frame = fedpriv.runs(_results(tmp_path))
    assert list(frame["status"]) == ["interrupted", "finished", "finished", "unreadable"]
    assert frame["epsilon"].tolist()[1:3] == [3.9871, 5.0]
    assert frame["accuracy"].tolist()[1] == 0.9132
    assert frame["path"][1].endswith("/results/20261129-100000-b")  # for fedpriv.load
