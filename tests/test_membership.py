"""Membership inference at the state of the art: reference updates (LiRA, RMIA), the
update decomposition, bootstrap intervals, and every DP run's attacks checked against
the curve its claim allows — each checked against an independent computation."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm
from sklearn.metrics import roc_auc_score, roc_curve
from torch import nn

from experiments.leakage.attack import run_attacks
from privacy.analysis.membership_metrics import auc, membership_scores, tpr_at
from privacy.attacks.observation import LocalTraining
from privacy.attacks.reference import ReferenceSetup, local_training
from privacy.attacks.simulate import replay
from privacy.dp.tradeoff import Claim, check_roc, dp_curve, gaussian_curve, pld_profile
from tasks.config import ConfigError, validate

from .test_leakage import observed_run
from .test_strategies import _task_identity  # noqa: F401  (fixture)


def _lines(path):
    return {x["attack"]: x for x in map(json.loads,
                                        (path / "leakage.jsonl").read_text().splitlines())}


# ------------------------------------------------------------------ metrics


def test_auc_and_tpr_at_low_fpr_equal_scikit_learns_roc():
    rng = np.random.default_rng(1)
    for _ in range(20):
        m, n = rng.normal(0.7, 1, 150), rng.normal(0, 1, 1200)
        assert auc(m, n) == pytest.approx(roc_auc_score(
            np.r_[np.ones(150), np.zeros(1200)], np.r_[m, n]))
        fpr, tpr, _ = roc_curve(np.r_[np.ones(150), np.zeros(1200)], np.r_[m, n])
        for rate in (0.01, 0.001):
            assert tpr_at(m, n, rate) == pytest.approx(tpr[fpr <= rate].max())


def test_the_bootstrap_interval_of_tpr_at_1pct_fpr_covers_the_truth_about_95pct():
    # members N(d, 1), non-members N(0, 1): TPR at FPR f is 1 - Phi(Phi^-1(1 - f) - d)
    rng = np.random.default_rng(0)
    d, runs, hits = 1.5, 60, 0
    true = 1 - norm.cdf(norm.ppf(0.99) - d)
    for i in range(runs):
        s = membership_scores(rng.normal(d, 1, 200), rng.normal(0, 1, 1000), seed=i)
        lo, hi = s["tpr-at-1%fpr-ci95"]
        hits += lo <= true <= hi
    assert 0.85 <= hits / runs <= 1.0
    assert s["tpr-at-0.1%fpr-ci95"] is not None  # 1,000 non-members: measurable


# ------------------------------------------------------------------ the claim's curve


def test_the_claim_curve_of_a_gaussian_mechanism_is_its_gdp_curve():
    # a Gaussian mechanism with sensitivity 1 and noise sigma is exactly (1/sigma)-GDP
    # (Dong, Roth & Su 2019): the PLD envelope must bound that curve from above, closely
    from dp_accounting import GaussianDpEvent

    fpr = np.logspace(-4, -0.05, 60)
    for sigma in (0.5, 1.0, 2.0):
        curve = Claim(99.0, 1e-5, "test", pld_profile(GaussianDpEvent(sigma))).curve(fpr)
        exact = gaussian_curve(fpr, 1 / sigma)
        assert np.all(curve >= exact - 1e-6)
        assert np.max(curve - exact) < 0.02, sigma


def test_the_epsilon_delta_curve_is_the_hypothesis_test_bound():
    # randomized response with flip probability 1/(1+e^eps) is eps-DP and reaches the bound
    eps = 1.3
    p = math.exp(eps) / (1 + math.exp(eps))
    assert dp_curve(np.array([1 - p]), eps, 0.0)[0] == pytest.approx(p)
    assert dp_curve(np.array([0.0]), eps, 0.01)[0] == pytest.approx(0.01)


def test_a_gaussian_attack_is_within_its_true_claim_and_above_a_false_one():
    # Monte Carlo of a mu-GDP membership test: member scores N(mu, 1), non-members N(0, 1)
    from dp_accounting import GaussianDpEvent

    true_claim = Claim(50.0, 1e-6, "mu = 3", pld_profile(GaussianDpEvent(1 / 3)))
    false_claim = Claim(50.0, 1e-6, "mu = 1", pld_profile(GaussianDpEvent(1.0)))
    rng = np.random.default_rng(3)
    consistent, caught = 0, 0
    for _ in range(40):
        m, n = rng.normal(3, 1, 400), rng.normal(0, 1, 2000)
        consistent += check_roc(m, n, true_claim)["consistent"]
        caught += not check_roc(m, n, false_claim)["consistent"]
    assert consistent >= 38 and caught == 40


# ------------------------------------------------------------------ reference training


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))


def test_batched_reference_training_equals_the_sequential_replay():
    model = _tiny()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    t = LocalTraining(lr=0.1, momentum=0.5, weight_decay=0.01, local_epochs=3, batch_size=5,
                      proximal_mu=0.1)
    x, y = torch.randn(4, 5, 12), torch.randint(0, 3, (4, 5))
    together = local_training(model, start, x, y, ReferenceSetup(t, 5))  # full batches
    for i in range(4):
        alone = replay(model, start, x[i], y[i], t, create_graph=False)
        for k in alone:
            assert torch.allclose(together[k][i], alone[k], atol=1e-6), k


def test_reference_dp_sgd_clips_each_record_and_without_noise_or_clipping_is_sgd():
    model = _tiny()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    t = LocalTraining(lr=0.1, momentum=0.0, weight_decay=0.0, local_epochs=1, batch_size=6)
    x, y = torch.randn(2, 6, 12), torch.randint(0, 3, (2, 6))
    plain = local_training(model, start, x, y, ReferenceSetup(t, 6))
    loose = local_training(model, start, x, y, ReferenceSetup(t, 6, dp_clip=1e6))
    for k in plain:
        assert torch.allclose(plain[k], loose[k], atol=1e-6)
    tight = local_training(model, start, x, y, ReferenceSetup(t, 6, dp_clip=1e-3))
    moved = torch.cat([v.reshape(2, -1) for v in tight.values()], 1).norm(dim=1)
    assert torch.all(moved <= 0.1 * 1e-3 + 1e-7)  # lr x (mean of records clipped to C)


# ------------------------------------------------------------------ in a round


def test_reference_and_decomposition_attacks_beat_the_loss_drop_on_an_update(tmp_path):
    observed_run(tmp_path, {"leakage-rounds": "1", "attacks": "mia,decompose,lira,rmia",
                            "observed-examples": 100, "batch-size": 16, "local-epochs": 3,
                            "reference-fraction": 0.2, "mia-candidates": 100,
                            "mia-nonmembers": 500, "mia-references": 8})
    run_attacks(tmp_path, echo=lambda line: None)
    by = _lines(tmp_path)
    base, strong = by["mia"], by["decompose"]
    assert strong["nonmembers"] == 500 and strong["members"] == 100
    assert strong["auc"] > 0.85 > base["auc"]
    assert strong["tpr-at-1%fpr"] >= max(3 * base["tpr-at-1%fpr"], 0.2)
    for name in ("lira", "rmia"):
        assert 0.5 < by[name]["auc"] < 1 and by[name]["tpr-at-1%fpr-ci95"] is not None
    assert by["lira"]["attack-used"] == "lira-offline"  # 8 references: too few for online
    assert "claim-consistent" not in strong  # no DP: no claim to check


def test_a_local_dp_run_is_checked_against_its_claim_everywhere(tmp_path):
    cfg = observed_run(tmp_path, {"leakage-rounds": "1", "attacks": "mia,decompose",
                            "observed-examples": 100, "batch-size": 16, "local-epochs": 3,
                            "dp": "local", "noise-multiplier": 1.0, "mia-candidates": 100,
                            "mia-nonmembers": 500})
    summary = run_attacks(tmp_path, echo=lambda line: None)
    line = _lines(tmp_path)["decompose"]
    assert line["claim-consistent"] is True and line["claim"]["epsilon"] > 0
    assert {p["fpr-level"] for p in line["claim-checks"]["decomposition"]} == {0.01, 0.1}
    assert summary["claim-violations"] == []
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["claim-consistent"] is True
    assert "consistent with the run's DP claim" in (tmp_path / "summary.md").read_text()
    # the sweep's table: every variant with its intervals and the verdict
    from types import SimpleNamespace

    from experiments.leakage.tables import write_attack_tables

    out = tmp_path / "sweep"
    out.mkdir()
    assert write_attack_tables(out, [SimpleNamespace(index=1, run_dir=tmp_path, config=cfg)])
    rows = list(csv.DictReader(open(out / "leakage_membership.csv")))
    decomposition = next(r for r in rows if r["attack"] == "decompose: decomposition")
    assert decomposition["defence"] == "local DP-SGD (sigma 1)"
    assert decomposition["claim-consistent"] == "yes" and decomposition["nonmembers"] == "500"
    assert "-" in decomposition["tpr-at-1%fpr-ci95"]
    assert "## Membership inference" in (out / "leakage.md").read_text()


def test_reference_attacks_without_the_servers_own_data_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="reference-fraction"):
        validate({"leakage-rounds": "1", "attacks": "lira"})
    observed_run(tmp_path, {"leakage-rounds": "1", "attacks": "mia", "mia-candidates": 20})
    with pytest.raises(ConfigError, match="reference-fraction"):
        run_attacks(tmp_path, ["rmia"], echo=lambda line: None)


def test_more_non_members_than_held_out_rows_are_refused_before_training(tmp_path):
    from experiments.preflight.checks import preflight

    cfg = validate({"num-clients": 5, "leakage-rounds": "1", "attacks": "mia,decompose",
                    "observed-examples": 100, "mia-nonmembers": 1000,
                    "results-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"mia-nonmembers = 1000.*only 700"):
        preflight(cfg)
