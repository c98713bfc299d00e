"""What can never be resumed is never offered: an unfinished run's hint, `--resume` and
the automatic restart after a lost Ray worker share one rule (`cannot_resume`)."""

from __future__ import annotations

import json

import pytest

from server.checkpoint import cannot_resume
from server.summary import resume_hint
from tasks.config import validate
from tasks.results.folder import RunFolder

BLT = {"dp": "central", "central-mechanism": "blt", "num-clients": 4,
       "client-sampling": "cyclic", "cyclic-groups": 2, "num-server-rounds": 4,
       "noise-multiplier": 1.0}


@pytest.mark.parametrize("values,refused", [
    ({**BLT, "secure-rng": True}, "cannot be rebuilt"),
    ({**BLT, "secure-rng": False}, None),
    ({"dp": "central", "secure-rng": True, "noise-multiplier": 1.0}, None),  # independent
    ({"dp": "local", "noise-multiplier": 1.0}, None)])
def test_correlated_noise_from_os_entropy_can_never_be_resumed(values, refused):
    why = cannot_resume(validate(values), {"client-state": "kept"})
    assert (why is None) if refused is None else (refused in why)


def test_local_dp_without_its_clients_state_can_never_be_resumed():
    cfg = validate({"dp": "local", "noise-multiplier": 1.0})
    assert "reset their epsilon" in cannot_resume(cfg, {})


def _stopped_run(path, values):
    run = RunFolder(path)
    cfg = validate(values)
    run.write_config(cfg)
    (path / "run.json").write_text(json.dumps({"status": "crashed", "client-state": "kept"}))
    (path / "checkpoint").mkdir()
    (path / "checkpoint" / "server.npz").write_bytes(b"")
    return path


def test_an_unfinished_runs_hint_offers_resume_only_where_it_can_work(tmp_path):
    can = _stopped_run(tmp_path / "a", {**BLT, "secure-rng": False})
    assert "fedpriv run --resume" in resume_hint(can)
    never = _stopped_run(tmp_path / "b", {**BLT, "secure-rng": True})
    hint = resume_hint(never)
    assert "--resume" not in hint and hint.startswith("it cannot be resumed: its blt noise")
    assert "run it again" in hint


def test_an_unfinished_runs_summary_says_the_epsilon_spent_by_its_last_round():
    from server.summary import spent_so_far
    from tasks.results.ledger import RoundRecord

    def record(rnd, privacy):
        return RoundRecord(rnd, {"accuracy": 0.5, "loss": 1.0}, {}, [0, 1], [], [],
                           {"round-s": 1.0}, privacy=privacy)

    rounds = [record(1, {"mode": "local", "epsilon-max": 1.25, "delta-max": 1e-5}),
              record(2, {"mode": "local", "epsilon-max": 1.75, "delta-max": 1e-5}),
              record(3, None)]  # a round no client reported privacy in
    (line,) = spent_so_far(rounds)
    assert line.startswith("- privacy: local DP, epsilon **1.750** at delta 1e-05 spent by "
                           "round 2"), line
    assert spent_so_far([record(1, None)]) == []
