"""The Python API (``import fedpriv``): the same code as the CLI, for notebooks."""

from __future__ import annotations

import pytest

import fedpriv

from .test_leakage import observed_run
from .test_strategies import _task_identity  # noqa: F401  (fixture)


def test_load_reads_a_run_folder_back_with_its_ledger_as_a_frame(tmp_path):
    observed_run(tmp_path, {}, rounds=2)  # the ServerApp's loop, in-process
    result = fedpriv.load(tmp_path)
    assert result.ok and [r.round for r in result.ledger] == [1, 2]
    assert result.config.federation.num_clients == 3 and result.epsilon is None
    frame = result.frame()
    assert list(frame.index) == [1, 2]
    assert list(frame["accuracy"]) == [r.accuracy for r in result.ledger]
    assert result.accuracy == result.ledger[-1].accuracy
    assert {"loss", "clients", "round-s"} <= set(frame.columns)
    assert (frame["clients"] == 3).all()
    assert repr(result).startswith("Result(finished, 2 rounds, accuracy ")


def test_run_dir_of_an_existing_run_is_refused_not_replaced(tmp_path):
    # it used to be replaced silently by a new timestamped folder
    old = tmp_path / "old"
    old.mkdir()
    (old / "run.json").write_text('{"status": "finished"}')
    with pytest.raises(fedpriv.ConfigError, match="already holds a run"):
        fedpriv.run(num_clients=3, run_dir=str(old), results_dir=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists() and sorted(p.name for p in old.iterdir()) == [
        "run.json"]


def test_bad_input_raises_one_paragraph_before_anything_starts(tmp_path):
    with pytest.raises(fedpriv.ConfigError, match="num-clientz"):
        fedpriv.run(num_clientz=3, results_dir=str(tmp_path))
    with pytest.raises(fedpriv.ConfigError, match="noise-multiplier"):
        fedpriv.run(dp="local", noise_multiplier=-1.0, results_dir=str(tmp_path))
    with pytest.raises(fedpriv.ConfigError, match="not a fedpriv run folder"):
        fedpriv.load(tmp_path)
    with pytest.raises(fedpriv.ConfigError):
        fedpriv.sweep("no-such-sweep")
    assert list(tmp_path.iterdir()) == []  # nothing was written
