"""The audit's estimators against independent computations: jax-privacy's auditing module
(Google DeepMind's reference implementations), dp-accounting, scipy's binomial tail, and
Monte Carlo of Gaussian mechanisms of known mu."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from privacy.attacks.audit import epsilon_lower_bound
from privacy.attacks.audit_fdp import mu_lower_bound
from privacy.attacks.audit_gdp import gdp_epsilon, gdp_mu, gdp_mu_lower_bound
from privacy.attacks.audit_suite import audit_all, claim_check

auditing = pytest.importorskip("jax_privacy.auditing")  # the dev extras install it

CASES = [(1000, 500, 400), (5000, 1000, 900), (20000, 2000, 1990), (200, 100, 61),
         (10000, 5000, 2600)]


@pytest.mark.parametrize("m,k,c", CASES)
@pytest.mark.parametrize("delta", [0.0, 1e-5])
def test_steinke_bound_matches_jax_privacy(m, k, c, delta):
    ours = epsilon_lower_bound(m, k, c, delta, 0.95)
    theirs = auditing._epsilon_one_run(0.0, m, k, c, 0.05, delta)
    assert ours == pytest.approx(theirs, abs=1e-4)


def test_steinke_bound_without_delta_is_the_binomial_tail():
    # delta = 0: the bound is the epsilon at which P[Binomial(k, e^eps/(1+e^eps)) >= c]
    # is exactly 5%
    m, k, c = 1000, 300, 250
    eps = epsilon_lower_bound(m, k, c, 0.0, 0.95)
    q = math.exp(eps) / (1 + math.exp(eps))
    assert binom.sf(c - 1, k, q) == pytest.approx(0.05, abs=1e-6)


@pytest.mark.parametrize("m,k,c", CASES)
def test_fdp_bound_matches_jax_privacy(m, k, c):
    # jax-privacy reports the epsilon (at delta) of the largest rejected Gaussian
    delta = 1e-5
    theirs = auditing._epsilon_one_run_fdp(0.0, m, k, c, 0.05, delta)
    ours = gdp_epsilon(mu_lower_bound(m, k, c, 0.95), delta)
    assert ours == pytest.approx(theirs, abs=2e-3, rel=1e-3)


def test_fdp_bound_matches_jax_privacy_public_api_on_scores():
    rng = np.random.default_rng(3)
    included = rng.random(4000) < 0.5
    scores = rng.normal(0, 1, 4000) + 1.2 * included
    t = np.quantile(scores, 0.9)  # guess "included" on the top 10%, abstain elsewhere
    k, c = int((scores >= t).sum()), int((scores[included] >= t).sum())
    theirs = auditing.CanaryScoreAuditor(scores[included], scores[~included]) \
        .epsilon_one_run_fdp(0.05, 1e-5, threshold_strategy=auditing.Explicit(t))
    assert gdp_epsilon(mu_lower_bound(4000, k, c, 0.95), 1e-5) == pytest.approx(theirs,
                                                                                abs=2e-3)
    assert theirs > 1.0


@pytest.mark.parametrize("eps,delta", [(0.5, 1e-5), (2.0, 1e-5), (8.0, 1e-5), (3.0, 1e-3)])
def test_gdp_conversion_matches_dp_accounting(eps, delta):
    import dp_accounting

    # the Gaussian mechanism that is exactly (eps, delta)-DP, by dp-accounting's own search
    sigma = dp_accounting.get_sigma_gaussian(eps, delta)
    assert gdp_mu(eps, delta) == pytest.approx(1 / sigma, rel=1e-3)
    assert gdp_epsilon(1 / sigma, delta) == pytest.approx(eps, rel=1e-3)


def _gaussian_scores(rng, m, mu):
    included = rng.random(m) < 0.5
    return rng.normal(0, 1, m) + mu * included, included


def test_gdp_bound_holds_at_its_rate_and_is_tight_on_a_gaussian_mechanism():
    rng = np.random.default_rng(0)
    mu, runs = 1.0, 300
    bounds = np.array([gdp_mu_lower_bound(s[inc], s[~inc], 0.95).mu_lower_bound
                       for s, inc in (_gaussian_scores(rng, 2000, mu) for _ in range(runs))])
    assert (bounds > mu).mean() <= 0.05  # a 95% bound (Bonferroni: in fact conservative)
    assert np.median(bounds) > 0.75 * mu


def test_gdp_estimate_agrees_with_jax_privacy_on_many_canaries():
    rng = np.random.default_rng(1)
    s, inc = _gaussian_scores(rng, 20000, 1.5)
    ours = gdp_epsilon(gdp_mu_lower_bound(s[inc], s[~inc], 0.95).mu_lower_bound, 1e-5)
    theirs = auditing.CanaryScoreAuditor(s[inc], s[~inc]).epsilon_from_gdp(0.05, 1e-5)
    truth = gdp_epsilon(1.5, 1e-5)
    assert ours <= truth and theirs <= truth
    assert abs(ours - theirs) < 0.1 * truth


def test_fdp_bound_holds_at_its_rate():
    rng = np.random.default_rng(2)
    mu, runs, over = 1.0, 60, 0
    for _ in range(runs):
        s, inc = _gaussian_scores(rng, 1000, mu)
        b = audit_all(s, inc, 1e-5, 0.95, 0.2)
        over += b.mu_lower_bound_fdp > mu
    assert over / runs <= 0.1


def test_claim_check():
    rng = np.random.default_rng(4)
    s, inc = _gaussian_scores(rng, 4000, 1.0)  # a mechanism with epsilon 4.4 at 1e-5
    b = audit_all(s, inc, 1e-5, 0.95, 0.2)
    assert claim_check(b, None, True) == {"claim-consistent": None,
                                          "claim-checked-by": "no claim"}
    assert claim_check(b, gdp_epsilon(1.0, 1e-5), True)["claim-consistent"] is True
    low = claim_check(b, gdp_epsilon(0.5, 1e-5), True)  # claims twice the noise
    assert low["claim-consistent"] is False and "gdp" in low["claim-rejected-by"]
    # a subsampled claim is compared with Steinke's epsilon bound only
    sub = claim_check(b, gdp_epsilon(0.5, 1e-5), False)
    assert sub["claim-checked-by"] == "steinke" and sub["claim-consistent"] is True
