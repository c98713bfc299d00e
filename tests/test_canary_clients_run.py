"""The canary-client audit of central DP-FedAvg (``canary-clients``; Andrew et al. 2024) in
real runs: the ServerApp's code (run_federation: round runner, DP-FedAvg, recorder,
summary) and the real ClientApp, in-process. The claim of the true noise stands; with the
noise the server draws halved from outside the project (the claim still z), the audit
rejects it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from privacy.dp import dpfedavg
from server.federation import run_federation
from strategies.build import build_runner
from tasks.config import ConfigError, validate
from tasks.results.folder import RunFolder

from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)

# 3 clients, every one every round, 3 rounds at z = 1.9: a claim of about 3.9 at delta 1e-5
RUN = {"num-clients": 3, "num-server-rounds": 3, "dp": "central", "noise-multiplier": 1.9,
       "clipping-norm": 1.0, "central-clipping": "server-fixed", "fraction-train": 1.0,
       "fraction-evaluate": 0.0, "model": "linear", "max-noise-to-signal": 0,
       "canary-clients": 500, "save-model": False, "run-id": "t-canary"}


def _run(tmp_path, name, **values):
    cfg = validate({**RUN, "results-dir": str(tmp_path / "results"), **values})
    run = RunFolder(tmp_path / "results" / name)
    run.write_config(cfg)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=cfg.flat())
    run_federation(InProcessGrid(cfg, simulated=True), context, cfg, run)
    return json.loads((run.path / "audit-canary-clients.json").read_text()), run.path


def test_a_real_run_audits_its_claim_and_rejects_halved_noise(tmp_path, monkeypatch):
    honest, path = _run(tmp_path, "honest")
    claim = honest["epsilon-claimed"]
    assert 3.5 < claim < 4.5 and honest["rounds"] == 3 and honest["canary-clients"] == 500
    assert honest["claim-consistent"] is True, honest
    assert honest["epsilon-lower-bound-oneshot"] < claim
    assert honest["epsilon-lower-bound-oneshot"] > 0.4 * claim, honest  # the audit has power
    line = [x for x in (path / "summary.md").read_text().splitlines()
            if x.startswith("- canary-client audit")]
    assert len(line) == 1 and "consistent with the claim" in line[0], line

    drawn = dpfedavg.gaussian_noise  # the server's noise, halved; the claim stays z
    monkeypatch.setattr(dpfedavg, "gaussian_noise",
                        lambda shape, std, rng, secure=False: drawn(shape, std / 2, rng, secure))
    halved, path = _run(tmp_path, "halved")
    assert halved["epsilon-claimed"] == pytest.approx(claim)
    assert halved["claim-consistent"] is False, halved
    assert halved["epsilon-lower-bound-oneshot"] > claim, halved
    assert "**the claim is rejected**" in (path / "summary.md").read_text()


def test_under_cyclic_banded_mf_the_audit_holds_the_claim_and_rejects_halved_noise(
        tmp_path, monkeypatch):
    """Canary clients in cyclic groups (canary k trains when group k mod 2 does) under
    banded MF's correlated noise: the claim of the true noise stands; with the noise the
    correlated source draws halved (the claim still z), the audit rejects it."""
    cyclic = {"num-clients": 4, "num-server-rounds": 4, "client-sampling": "cyclic",
              "cyclic-groups": 2, "central-mechanism": "banded-mf", "noise-multiplier": 1.0}
    honest, _ = _run(tmp_path, "cyclic-honest", **cyclic)
    claim = honest["epsilon-claimed"]
    assert honest["rounds"] == 4 and honest["claim-consistent"] is True, honest
    assert honest["epsilon-lower-bound-oneshot"] < claim
    assert honest["epsilon-lower-bound-oneshot"] > 0.3 * honest["epsilon-view"], honest

    from privacy.dp import correlated
    drawn = correlated.gaussian_noise
    monkeypatch.setattr(correlated, "gaussian_noise",
                        lambda shape, std, rng, secure=False: drawn(shape, std / 4, rng, secure))
    weak, _ = _run(tmp_path, "cyclic-weak", **cyclic)
    assert weak["epsilon-claimed"] == pytest.approx(claim)
    assert weak["claim-consistent"] is False, weak


def test_the_audit_goes_on_from_a_checkpoint(tmp_path):
    """state() keeps the rounds audited and the model the audit started from."""
    cfg = validate({**RUN, "results-dir": str(tmp_path)})
    grid = InProcessGrid(cfg)
    a = build_runner(cfg, grid, grid.partition_of, num_parameters=7850).aggregation
    b = build_runner(cfg, grid, grid.partition_of, num_parameters=7850).aggregation
    start = [np.full((10, 784), 0.5, dtype=np.float32), np.zeros(10, dtype=np.float32)]
    a.canaries.replies(1, start, 1.0)
    a.canaries.released(1)
    b.restore(a.state())
    assert b.canaries.rounds == 1
    assert all(np.array_equal(x, y) for x, y in zip(b.canaries.start, start, strict=True))


@pytest.mark.parametrize("values, says", [
    ({"dp": "local", "target-epsilon": 5}, "canary-clients = 500 with dp = 'local'"),
    ({"client-sampling": "fixed", "fraction-train": 0.5}, "displace a real one"),
    ({"canary-clients": 2}, "at least 3 canary clients"),
])
def test_runs_the_audit_cannot_serve_are_refused(values, says):
    with pytest.raises(ConfigError, match=says):
        validate({**RUN, **values})


def test_max_grad_norm_acts_under_central_dp_only_with_record_canaries():
    from tasks.config.effect import unread_keys

    keys = ["max-grad-norm", "audit-confidence"]
    central = validate({**RUN, "canary-clients": 0})
    assert set(unread_keys(keys, central)) == {"max-grad-norm", "audit-confidence"}
    audited = validate({**RUN, "leakage-rounds": "1", "attacks": "mia,audit",
                        "canaries": 100, "canary-clients": 0})
    assert unread_keys(keys, audited) == {}
    assert "audit-confidence" not in unread_keys(keys, validate(RUN))
