"""The neighbouring-datasets tester (privacy.dp.neighbours) and fedpriv's mechanisms under it
(experiments.neighbour_mechanisms, `fedpriv dp-test`).

The statistical core is checked on synthetic mechanisms whose epsilon is known; then each
of fedpriv's mechanisms, run as the product runs it, must keep the tester's 95% lower
bound under the epsilon it claims. A bound above the claim is a refutation, not noise:
every bound holds with 95% confidence jointly over the statistics (seeds are fixed, so
each test is deterministic).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import binomtest

from privacy.dp import neighbours as nb
from tasks.config import validate


def _gaussian(sigma: float, shift: float = 1.0, dim: int = 1):
    def run(which: str, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        return {"out": (shift if which == nb.D_PRIME else 0.0) + rng.normal(0, sigma, dim)}

    return run


def test_clopper_pearson_matches_scipys_exact_interval():
    for k, n in ((0, 50), (3, 50), (17, 40), (40, 40)):
        # a one-sided (1 - a) bound is the upper end of the two-sided (1 - 2a) interval
        expected = binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact").high
        assert float(nb.clopper_pearson_upper(k, n, 0.05)) == pytest.approx(expected, abs=1e-9)
    # perfect separation on 50 runs a side: the largest bound 100 runs a side can give
    a = 1 - 0.05 ** (1 / 50)
    assert float(nb.epsilon_from_rates(a, a, 0.0)) == pytest.approx(np.log((1 - a) / a))
    assert float(nb.epsilon_from_rates(0.6, 0.5, 0.0)) == 0.0  # a useless test bounds nothing


def test_a_gaussian_mechanism_stays_under_its_true_epsilon():
    delta = 1e-5
    true = nb.gaussian_epsilon(2.0, delta)  # sensitivity 1, sigma 0.5
    assert true == pytest.approx(10.0, abs=0.1)  # Balle & Wang 2018's exact conversion
    report = nb.test_mechanism(_gaussian(0.5), runs=400, claim=nb.Claim(true, delta, "shift"))
    assert 1.0 < report.epsilon <= true and report.passed
    assert report.best.name.startswith("out:")  # found through the released value itself
    # the cap the sample size puts on any bound is respected
    assert report.epsilon <= nb.max_detectable(400, len(report.statistics), 0.95, delta)


def test_a_noise_scale_that_depends_on_the_neighbour_is_flagged_far_above_its_claim():
    """The count leak's shape: the same mechanism with a different noise scale on D'."""

    def run(which: str, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        return {"update": rng.normal(0, 1.3 if which == nb.D_PRIME else 1.0, 1000)}

    report = nb.test_mechanism(run, runs=100, claim=nb.Claim(0.35, 1e-5, "add-remove"))
    assert report.epsilon > 5 * 0.35 and report.passed is False
    assert report.best.name in ("update:l2", "update:std", "update:mean-abs")
    assert report.best.fpr == report.best.fnr == 0.0
    text = report.describe()
    assert "FAIL" in text and "refuted at 95% confidence" in text and "update:" in text


def test_an_identical_mechanism_gives_zero():
    def run(which: str, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        return {"update": rng.normal(size=64), "steps": 10, "rate": 0.1}

    report = nb.test_mechanism(run, runs=100, claim=nb.Claim(0.1, 1e-5, "none"))
    assert report.epsilon == 0.0 and all(s.epsilon == 0.0 for s in report.statistics)
    assert report.passed and "PASS" in report.describe()
    assert {s.name for s in report.statistics} >= {"steps", "rate", "update:projection",
                                                   "update:top-coordinate"}


def test_runs_are_reproducible_and_their_seeds_distinct():
    seeds = nb.run_seeds(50, 7)
    flat = seeds[nb.D] + seeds[nb.D_PRIME]
    assert len(set(flat)) == 100
    a = nb.test_mechanism(_gaussian(1.0), runs=40, seed=7)
    b = nb.test_mechanism(_gaussian(1.0), runs=40, seed=7)
    assert [s.epsilon for s in a.statistics] == [s.epsilon for s in b.statistics]
    assert a.passed is None and "No claim" in a.describe()  # no claim: nothing to judge


# ---------------------------------------------------------------------- fedpriv's mechanisms


def _local_cfg(**extra):
    # 70 clients: client 0 holds 57 of the embedded MNIST's 4,000 training digits, enough
    # for D' = 55 records, and a run's expected partition is as small (quick epochs)
    return validate({"dp": "local", "noise-multiplier": 4.0, "batch-size": 5,
                     "local-epochs": 1, "model": "linear", "delta": 1e-5,
                     "num-clients": 70, **extra})


@pytest.mark.parametrize("records", [50, 54], ids=["n-multiple-of-B", "n-not-a-multiple"])
def test_local_dp_sgd_keeps_its_claim_when_one_record_is_added(records):
    """Client 0's DP-SGD round (clients.update.local_update -> dp_round) on n real MNIST
    digits vs n + 1. With q, steps and the normaliser taken from n (Opacus' defaults), the
    release reveals n: at n = 50, B = 5 D' takes 11 steps at q = 1/11 instead of 10 at
    1/10; at n = 54 both take 11 but the normaliser int(n q) is 4 vs 5, so the update's
    spread differs by a quarter. Either way D and D' separate perfectly, far above the
    ledger's epsilon of about 0.35."""
    from experiments.neighbour_mechanisms import test_config

    report = test_config(_local_cfg(), mechanism="local", runs=100, records=records)
    assert report.claim is not None and 0 < report.claim.epsilon < 1
    assert report.passed, f"{report.describe()}\n{report.table()}"


def test_a_schedule_from_the_clients_own_count_is_caught(monkeypatch):
    """The mutation check: give DP-SGD's schedule the client's private n again (as Opacus
    does) and the same test refutes the claim."""
    from clients.update import Client
    from experiments.neighbour_mechanisms import test_config

    monkeypatch.setattr(Client, "public_records", lambda self: len(self.data.y))
    report = test_config(_local_cfg(), mechanism="local", runs=100, records=50)
    assert report.passed is False and report.epsilon > 5 * report.claim.epsilon, \
        report.describe()


def test_central_dp_fedavg_keeps_its_claim_when_one_client_is_added():
    from experiments.neighbour_mechanisms import test_config

    cfg = validate({"dp": "central", "model": "linear", "num-clients": 10,
                    "noise-multiplier": 1.0, "clipping-norm": 1.0})
    report = test_config(cfg, runs=200)
    assert report.claim is not None and report.claim.epsilon > 1
    assert report.passed, f"{report.describe()}\n{report.table()}"
    assert "add or remove one client" in report.claim.relation


def test_dp_fedavg_under_secagg_keeps_its_claim():
    from experiments.neighbour_mechanisms import mechanism_for, test_config

    cfg = validate({"dp": "central", "secure-aggregation": "secagg+",
                    "central-clipping": "client-fixed", "model": "linear", "num-clients": 5,
                    "noise-multiplier": 1.0})
    assert mechanism_for(cfg) == "secagg"
    report = test_config(cfg, runs=100)
    assert report.passed, f"{report.describe()}\n{report.table()}"
    assert "quantization slack" in report.claim.source


def test_the_secagg_sum_is_the_clipped_sum_to_quantization_error():
    from experiments.neighbour_mechanisms import _secagg_sum, _server_sum

    cfg = validate({"dp": "central", "secure-aggregation": "secagg+",
                    "central-clipping": "client-fixed"})
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (4,)]
    updates = [[rng.normal(0, 0.5, s) for s in shapes] for _ in range(4)]
    plain, plain_bits = _server_sum(updates, 1.0, shapes)
    secure, secure_bits = _secagg_sum(updates, 1.0, cfg, seed=3)
    step = 2 * cfg.secagg.clipping_range / cfg.secagg.quantization_range
    for a, b in zip(plain, secure, strict=True):
        np.testing.assert_allclose(a, b, atol=4 * step + 1e-6)
    assert plain_bits == secure_bits


def test_the_dp_cvae_keeps_its_claim():
    """The CVAE anonymizer's DP-SGD (train_cvae) on 50 real digits (7x7, as vectors) vs a
    neighbour under the relation it claims; the release is its weights and the epsilon the
    client reports. A noise multiplier and delta calibrated from the private n would make
    that reported epsilon differ between D and D'."""
    from experiments.neighbour_mechanisms import cvae_dpsgd
    from tasks.datasets import client_dataset

    cfg = validate({"features": "embeddings", "anonymizer": "cvae", "cvae-epsilon": 1.0,
                    "cvae-epochs": 2, "cvae-batch-size": 10, "cvae-hidden": 16,
                    "cvae-latent": 4})
    digits = client_dataset("mnist", "", False, 0.0, 0.0)
    x = digits.x_train[:60].reshape(60, 28, 28)[:, ::4, ::4].reshape(60, -1) / 255.0
    setup = cvae_dpsgd(cfg, 50, data=(x.astype(np.float32), digits.y_train[:60]))
    report = nb.test_mechanism(setup.run, runs=40, claim=setup.claim, name=setup.name,
                               neighbours=setup.neighbours)
    assert {s.name for s in report.statistics} >= {"anon-info-epsilon", "weights:l2"}
    assert report.passed, f"{report.describe()}\n{report.table()}"


def test_the_cli_refuses_a_configuration_without_a_dp_claim(capsys):
    from experiments.cli.main import main

    assert main(["dp-test", "--runs", "10"]) == 2
    err = capsys.readouterr().err
    assert "makes no differential-privacy claim" in err and "nothing to test" in err
    assert err.count("\n") == 1  # one paragraph
    assert main(["dp-test", "--set", "dp=local", "--mechanism", "central"]) == 2
    assert "no differential-privacy claim for mechanism 'central'" in capsys.readouterr().err
    assert main(["dp-test", "--set", "dp=local", "--mechanism", "nope"]) == 2
    assert "unknown DP mechanism 'nope'" in capsys.readouterr().err


def test_the_cli_prints_the_table_and_the_verdict(tmp_path, capsys):
    from experiments.cli.main import main

    out = tmp_path / "report.json"
    rc = main(["dp-test", "--set", "dp=central", "--set", "model=linear", "--set",
               "num-clients=4", "--runs", "20", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "update:projection" in text and "PASS" in text and "CentralAccountant" in text
    saved = json.loads(out.read_text())
    assert saved["passed"] is True and saved["runs"] == 20
    assert len(saved["statistics"]) == 7 and saved["claim"]["epsilon"] > 0
