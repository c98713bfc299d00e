"""Mechanisms are checked statistically, over many draws, against their definitions."""

import math

import numpy as np
import pytest
from scipy import stats

from privacy.mechanisms import (
    Budget,
    BudgetExceeded,
    _analytic_delta,
    estimate_yes_share,
    gaussian_mechanism,
    gaussian_sigma,
    k_anonymity,
    laplace_mechanism,
    randomized_response,
    randomized_response_epsilon,
)

N = 200_000


def test_laplace_noise_has_scale_sensitivity_over_epsilon():
    rel = laplace_mechanism(np.zeros(N), sensitivity=2.0, epsilon=0.5, rng=0)
    assert rel.scale == 4.0 and rel.epsilon == 0.5 and rel.delta == 0.0
    noise = rel.value
    assert abs(np.mean(np.abs(noise)) / 4.0 - 1) < 0.02  # E|X| = b
    assert abs(np.std(noise) / (math.sqrt(2) * 4.0) - 1) < 0.02
    assert stats.kstest(noise, "laplace", args=(0, 4.0)).pvalue > 1e-3


def test_laplace_on_a_count_query_matches_the_seed_notebook():
    db = np.random.default_rng(1).integers(0, 2, 100)
    answers = [laplace_mechanism(db.sum(), 1.0, 0.5, rng=s).value for s in range(4000)]
    assert abs(np.mean(answers) - db.sum()) < 0.2  # unbiased
    assert abs(np.std(answers) / (math.sqrt(2) * 2.0) - 1) < 0.05


def test_gaussian_classic_formula():
    sigma = gaussian_sigma(0.5, 1e-5, sensitivity=1.0, method="classic")
    assert sigma == pytest.approx(math.sqrt(2 * math.log(1.25e5)) / 0.5)
    with pytest.raises(ValueError, match="epsilon < 1"):
        gaussian_sigma(2.0, 1e-5, method="classic")


@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0, 4.0])
def test_analytic_gaussian_is_tight_and_below_classic(eps):
    sigma = gaussian_sigma(eps, 1e-5, sensitivity=3.0)
    assert _analytic_delta(sigma, eps, 3.0) <= 1e-5
    assert _analytic_delta(sigma * 0.99, eps, 3.0) > 1e-5  # the smallest sigma that works
    if eps < 1:
        assert sigma < gaussian_sigma(eps, 1e-5, 3.0, method="classic")
    # the same condition, computed here from its closed form (Balle & Wang 2018, Thm 8),
    # up to floating-point rounding (measured: within 3e-15 relative)
    assert _delta_closed_form(sigma, eps, 3.0) <= 1e-5 * (1 + 1e-9)
    assert _delta_closed_form(0.999 * sigma, eps, 3.0) > 1e-5


def _phi(t):
    return 0.5 * math.erfc(-t / math.sqrt(2))  # accurate in the lower tail


def _delta_closed_form(sigma, eps, sens):
    """Phi(D/2s - e s/D) - e^e Phi(-D/2s - e s/D), independent of privacy.mechanisms."""
    a, b = sens / (2 * sigma), eps * sigma / sens
    return _phi(a - b) - math.exp(eps) * _phi(-a - b)


def test_analytic_gaussian_matches_the_published_value():
    # Balle & Wang's analytic Gaussian mechanism (2018): epsilon = 1, delta = 1e-5 and
    # sensitivity 1 need sigma = 3.7306 (the closed form above gives delta(3.7306) =
    # 1.00014e-5 > 1e-5 >= delta(3.7307) = 9.9970e-6)
    sigma = gaussian_sigma(1.0, 1e-5)
    assert sigma == pytest.approx(3.7306, abs=1e-4)
    assert _delta_closed_form(3.7306, 1.0, 1.0) > 1e-5 >= _delta_closed_form(3.7307, 1.0, 1.0)
    assert 3.7306 < sigma <= 3.7307
    # classic bound at epsilon = 0.5 is sqrt(2 ln(1.25e5)) / 0.5 = 9.69; analytic is 7.03
    assert gaussian_sigma(0.5, 1e-5) == pytest.approx(7.0318, abs=1e-4)
    # and Google's dp-accounting (installed with Flower), an independent implementation
    reference = pytest.importorskip("dp_accounting.gaussian_mechanism")
    for eps in (0.1, 0.5, 1.0, 4.0):
        assert gaussian_sigma(eps, 1e-5) == pytest.approx(
            reference.get_sigma_gaussian(eps, 1e-5), rel=1e-6)


def test_gaussian_noise_has_the_calibrated_std():
    rel = gaussian_mechanism(np.zeros(N), sensitivity=2.0, epsilon=1.0, delta=1e-5, rng=3)
    # sigma is proportional to the sensitivity: twice the unit-sensitivity sigma 3.7306
    assert rel.scale == pytest.approx(2 * gaussian_sigma(1.0, 1e-5), rel=1e-9)
    assert rel.scale == pytest.approx(7.4613, abs=1e-4)
    assert abs(np.std(rel.value) / rel.scale - 1) < 0.01
    assert abs(np.mean(rel.value)) < 4 * rel.scale / math.sqrt(N)


def test_randomized_response_epsilon_and_unbiased_estimate():
    assert randomized_response_epsilon(0.5) == pytest.approx(math.log(3))  # two fair coins
    rng = np.random.default_rng(7)
    truth = rng.random(2000) < 0.3
    estimates = [estimate_yes_share(randomized_response(truth, 0.5, rng=rng).value, 0.5)
                 for _ in range(2000)]
    # unbiased: the mean estimate is within 4 standard errors of the true share
    se = np.std(estimates) / math.sqrt(len(estimates))
    assert abs(np.mean(estimates) - truth.mean()) < 4 * se
    # each answer is the truth with probability p + (1 - p)/2 = 0.75
    rel = randomized_response(np.ones(N, bool), 0.5, rng=1)
    assert abs(rel.value.mean() - 0.75) < 0.005


def test_budget_composes_sequentially_and_refuses_overspending():
    budget = Budget(epsilon=1.0, delta=1e-5)
    budget.charge(laplace_mechanism(1.0, 1.0, 0.4, rng=0))
    budget.charge(gaussian_mechanism(1.0, 1.0, 0.5, 1e-5, rng=0))
    assert budget.spent_epsilon == pytest.approx(0.9)
    with pytest.raises(BudgetExceeded):
        budget.charge(laplace_mechanism(1.0, 1.0, 0.2, rng=0))
    assert len(budget.releases) == 2 and budget.remaining[0] == pytest.approx(0.1)


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        laplace_mechanism(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="delta must be > 0.0 and < 1"):
        gaussian_sigma(1.0, 1.0)
    with pytest.raises(ValueError, match="p_truth"):
        randomized_response_epsilon(1.0)


def test_k_anonymity_of_the_seed_table():
    table = {"age": [42, 52, 36, 24, 73], "pre": [4, 24, 31, 2, 3], "post": [25, 94, 57, 62, 70]}
    report = k_anonymity(table)
    assert report.k == 1 and report.groups == 5 and report.satisfies(1)
    assert not report.satisfies(2)


def test_k_anonymity_over_generalized_quasi_identifiers():
    rows = [{"age": "20-29", "zip": "130**", "disease": d} for d in ("flu", "cold", "flu")]
    rows += [{"age": "30-39", "zip": "148**", "disease": d} for d in ("flu", "hiv")]
    report = k_anonymity(rows, quasi_identifiers=["age", "zip"])
    assert report.k == 2 and report.groups == 2 and report.smallest == ("30-39", "148**")
    assert k_anonymity(rows).k == 1  # with the sensitive column as well: unique rows
    with pytest.raises(KeyError):
        k_anonymity(rows, ["name"])
    assert k_anonymity([]).k == 0
