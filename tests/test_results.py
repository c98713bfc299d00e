import json

import pytest

from server.results import RunFolder, new_run_dir, read_metrics, read_run_info
from server.summary import outcome
from tasks.config import ConfigError, validate


def test_new_run_dirs_never_collide(tmp_path):
    dirs = {new_run_dir(tmp_path, "same name") for _ in range(5)}
    assert len(dirs) == 5 and all(d.is_dir() for d in dirs)
    assert all(" " not in d.name for d in dirs)


def test_run_folder_refuses_an_existing_run(tmp_path):
    cfg = validate({"run-dir": str(tmp_path / "r")})
    run = RunFolder.open(cfg)
    run.append_metrics({"round": 1})
    (tmp_path / "r" / "keep.txt").write_text("precious")
    with pytest.raises(ConfigError, match="already holds a run"):
        RunFolder.open(cfg)
    assert (tmp_path / "r" / "keep.txt").read_text() == "precious"
    assert read_metrics(tmp_path / "r") == [{"round": 1}]


def test_metrics_are_appended_one_line_per_round(tmp_path):
    run = RunFolder.open(validate({"results-dir": str(tmp_path)}))
    for r in (1, 2, 3):
        run.append_metrics({"round": r, "test": {"accuracy": r / 10, "loss": 1.0},
                            "time": {"round-s": 1.0 + r}})
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2, 3]
    res = outcome(read_metrics(run.path))
    assert res["final"]["round"] == 3 and res["best"]["accuracy"] == 0.3
    assert res["steady-round-s"] == pytest.approx(3.5)
    run.write_json("run.json", {"status": "finished"})
    assert read_run_info(run.path) == {"status": "finished"}
