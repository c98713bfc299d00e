"""privacy/dp/distributed.py against independent computations: exact Renyi divergences by
direct summation, dp-accounting's Gaussian mechanism, the encoding's arithmetic, and a
neighbouring-datasets Monte Carlo of the mechanism as run."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special

from privacy.dp import distributed as dd
from privacy.dp.neighbours import Claim, test_mechanism


def _renyi(logp: np.ndarray, logq: np.ndarray, alpha: float) -> float:
    """D_alpha(P || Q) = log sum P^alpha Q^(1 - alpha) / (alpha - 1), by direct summation."""
    keep = np.isfinite(logp) & np.isfinite(logq)
    return float(special.logsumexp(alpha * logp[keep] + (1 - alpha) * logq[keep]) / (alpha - 1))


def _skellam_exact(shift: int, variance: float, alpha: float) -> float:
    """Exact D_alpha between Skellam of variance mu shifted by ``shift`` and unshifted:
    Poisson(mu/2) - Poisson(mu/2) has pmf e^-mu I_|x|(mu) = ive(|x|, mu)."""
    sd = math.sqrt(variance)
    half = int(40 * sd) + int(alpha * shift) + shift + 20
    x = np.arange(-half, half + 1)
    with np.errstate(divide="ignore"):
        logq = np.log(special.ive(np.abs(x).astype(float), variance))
        logp = np.log(special.ive(np.abs(x - shift).astype(float), variance))
    return _renyi(logp, logq, alpha)


@pytest.mark.parametrize("variance", [20.0, 200.0, 1e4])
def test_skellam_closed_form_bounds_exact_divergence(variance: float) -> None:
    for shift in (1, 3, int(math.sqrt(variance))):
        for alpha in (2, 8, 32):
            exact = _skellam_exact(shift, variance, alpha)
            closed = float(dd.skellam_rdp([alpha], shift, shift, variance)[0])
            assert exact <= closed * (1 + 1e-12), (variance, shift, alpha, exact, closed)


def test_skellam_closed_form_tight_at_fedpriv_scale() -> None:
    # the memo: within 0.15% for mu >= 1e4 and alpha <= 8
    for variance in (1e4, 1e5):
        for shift in (1, 10, int(math.sqrt(variance))):
            for alpha in (2, 8):
                exact = _skellam_exact(shift, variance, alpha)
                closed = float(dd.skellam_rdp([alpha], shift, shift, variance)[0])
                assert exact <= closed <= 1.01 * exact, (variance, shift, alpha, exact, closed)


def test_skellam_epsilon_is_the_gaussian_in_the_limit() -> None:
    from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
    from dp_accounting.rdp import RdpAccountant

    dim, n, rounds, delta = 1 << 14, 10, 100, 1e-5
    l2 = dd.rounded_l2_bound(3e4, dim, math.exp(-0.5))
    l1 = dd.rounded_l1_bound(l2, dim)
    local_variance = l2 ** 2 / n  # total variance l2^2: noise multiplier 1
    eps, got_delta, order = dd.skellam_epsilon(l2, l1, local_variance, n, rounds, delta)
    acc = RdpAccountant(orders=list(dd.ORDERS))
    acc.compose(SelfComposedDpEvent(GaussianDpEvent(1.0), rounds))
    ref = acc.get_epsilon(delta)
    assert got_delta == delta and order in dd.ORDERS
    assert abs(eps - ref) <= 0.01 * ref, (eps, ref)
    # colluders remove their shares: fewer shares, larger epsilon
    assert dd.skellam_epsilon(l2, l1, local_variance, n, rounds, delta, colluding=5)[0] > eps


def _dg_sum_logpmf(local_std: float, n: int, half: int) -> np.ndarray:
    """log pmf on [-half, half] of the sum of n i.i.d. N_Z(0, local_std^2), by convolution."""
    r = int(math.ceil(40 * local_std)) + 2
    z = np.arange(-r, r + 1).astype(float)
    p = np.exp(-z ** 2 / (2 * local_std ** 2))
    p /= p.sum()
    total = p
    for _ in range(n - 1):
        total = np.convolve(total, p)
    centre = len(total) // 2
    out = np.zeros(2 * half + 1)
    lo = max(0, centre - half)
    hi = min(len(total), centre + half + 1)
    out[lo - centre + half:hi - centre + half] = total[lo:hi]
    with np.errstate(divide="ignore"):
        return np.log(out)


@pytest.mark.parametrize("local_std", [0.5, 1.0, 2.0])
def test_ddg_bound_covers_exact_sum_of_discrete_gaussians(local_std: float) -> None:
    n = 10
    half = int(60 * local_std * math.sqrt(n)) + 200
    logq = _dg_sum_logpmf(local_std, n, half)
    for shift in (1, 3):
        logp = np.full_like(logq, -np.inf)
        logp[shift:] = logq[:-shift]
        for alpha in (2, 8):
            exact = _renyi(logp, logq, alpha)
            bound = min(xi + rho * alpha
                        for rho, xi in dd.ddg_branches(shift, shift, local_std, n, 1))
            assert exact <= bound * (1 + 1e-9), (local_std, shift, alpha, exact, bound)


def test_encode_decode_round_trip_and_modular_sum() -> None:
    rng = np.random.default_rng(1)
    n, d, clip, scale, bits, seed = 6, 37, 1.0, 200.0, 20, 12345
    updates = [rng.normal(size=d) * s for s in (0.1, 0.5, 1.0, 3.0, 10.0, 0.0)]
    clipped = [u * min(1.0, clip / max(np.linalg.norm(u), 1e-300)) for u in updates]
    encs = [dd.encode(u, clip, scale, seed, rng) for u in updates]
    dim = dd.padded_dim(d)
    assert all(e.dtype == np.int64 and e.size == dim for e in encs)
    total = np.sum(encs, axis=0)
    est = dd.decode(total, bits, scale, seed, d)
    # each client's rounding moves its integer vector by < sqrt(dim); rotation is isometric
    err = np.linalg.norm(est - np.sum(clipped, axis=0))
    assert err <= n * math.sqrt(dim) / scale
    modular = np.mod(np.sum([dd.to_modular(e, bits) for e in encs], axis=0), 1 << bits)
    assert np.array_equal(dd.centre(modular, bits), total)
    assert np.array_equal(dd.decode(modular, bits, scale, seed, d), est)


@pytest.mark.parametrize("beta", [0.0, math.exp(-0.5)])
def test_rounded_norm_respects_bound(beta: float) -> None:
    rng = np.random.default_rng(2)
    d, clip, scale = 50, 1.0, 5.0
    dim = dd.padded_dim(d)
    bound = dd.rounded_l2_bound(scale * clip, dim, beta)
    x = rng.normal(size=d)
    norms = [np.linalg.norm(dd.encode(x, clip, scale, 7, rng, beta)) for _ in range(2000)]
    assert max(norms) <= bound
    if beta > 0:
        assert bound < scale * clip + math.sqrt(dim)
    # the L1 bound of an integer vector
    v = dd.encode(x, clip, scale, 7, rng, beta)
    assert np.abs(v).sum() <= dd.rounded_l1_bound(bound, dim)


def test_monte_carlo_neighbours_stay_under_claim() -> None:
    n, d, clip, scale, bits, seed = 3, 3, 1.0, 10.0, 16, 99
    dim = dd.padded_dim(d)
    l2 = dd.rounded_l2_bound(scale * clip, dim)
    l1 = dd.rounded_l1_bound(l2, dim)
    local_variance = 120.0
    dd.check_bits(bits, n, scale * clip, dim, local_variance)
    eps, delta, _ = dd.skellam_epsilon(l2, l1, local_variance, n, 1, 1e-5)
    target = np.array([1.0, 0.0, 0.0])
    others = [np.array([0.0, 0.6, 0.0]), np.array([0.0, 0.0, -0.8])]

    def run(which: str, run_seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(run_seed)
        first = target if which == "D" else np.zeros(d)  # zero-out: the client still adds noise
        total = np.zeros(dim, dtype=np.int64)
        for u in [first, *others]:
            share = dd.encode(u, clip, scale, seed, rng) + dd.skellam_share(dim, local_variance,
                                                                             rng)
            total = np.mod(total + dd.to_modular(share, bits), 1 << bits)
        return {"sum": dd.decode(total, bits, scale, seed, d)}

    report = test_mechanism(run, runs=1500, claim=Claim(eps, delta, "zero-out"), seed=3)
    assert report.passed, report.describe()
    assert report.epsilon > 0.3  # the test does see the signal (it is not vacuous)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="too small for this cohort"):
        dd.check_bits(10, 100, 1e3, 1 << 10, 1e4)
    dd.check_bits(24, 100, 1e3, 1 << 10, 1e4)  # enough bits: accepted
    with pytest.raises(ValueError, match="subtract every noise share"):
        dd.skellam_epsilon(10.0, 10.0, 100.0, 5, 1, 1e-5, colluding=5)
    with pytest.raises(ValueError, match="subtract every noise share"):
        dd.ddg_epsilon(10.0, 10.0, 10.0, 3, 4, 1, 1e-5, colluding=4)
    with pytest.raises(ValueError, match="positive"):
        dd.skellam_epsilon(10.0, 10.0, 0.0, 5, 1, 1e-5)
    with pytest.raises(ValueError, match="positive"):
        dd.encode(np.ones(3), -1.0, 10.0, 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="positive"):
        dd.skellam_share(4, -1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="rounds"):
        dd.skellam_epsilon(10.0, 10.0, 100.0, 5, 0, 1e-5)
    with pytest.raises(ValueError, match="1/2 integer units"):
        dd.ddg_epsilon(10.0, 10.0, 0.3, 5, 4, 1, 1e-5)
    with pytest.raises(ValueError, match="beta"):
        dd.rounded_l2_bound(10.0, 4, 1.0)


# ---------------------------------------------------------------- the run's plan


def test_the_plan_epsilon_equals_independent_computations() -> None:
    """A run's accounting (:meth:`DistributedPlan.epsilon`) against (a) the closed form
    for equal rounds, checked above against exact Renyi divergences, and (b) the Gaussian
    mechanism it tends to (dp-accounting's GaussianDpEvent at the same noise over the
    integer sensitivity), to 1%; dropouts and colluders only raise it."""
    from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
    from dp_accounting.rdp import RdpAccountant

    plan = dd.DistributedPlan.make(1.0, 2.0, 20, 26_010, 10, 0)
    eps = plan.epsilon([10] * 20, 1e-5)
    closed = dd.skellam_epsilon(plan.l2, plan.l1, plan.local_variance, 10, 20, 1e-5)[0]
    assert abs(eps - closed) <= 1e-9 * closed
    acc = RdpAccountant(orders=list(dd.ORDERS))
    z = math.sqrt(10 * plan.local_variance) / plan.l2
    acc.compose(SelfComposedDpEvent(GaussianDpEvent(z), 20))
    gaussian = acc.get_epsilon(1e-5)
    assert abs(eps - gaussian) <= 0.01 * gaussian, (eps, gaussian)
    assert plan.epsilon([10] * 19 + [7], 1e-5) > eps  # three dropped in one round
    colluded = dd.DistributedPlan.make(1.0, 2.0, 20, 26_010, 10, 3)
    assert colluded.local_variance > plan.local_variance  # the noise is planned over 7
    # the same honest noise (its scale differs slightly, so its rounding does too)
    assert colluded.epsilon([10] * 20, 1e-5) == pytest.approx(eps, rel=2e-3)
    assert colluded.epsilon([3], 1e-5) == math.inf  # only colluders' noise was left


def test_the_aggregate_as_run_stays_under_its_claim_and_fails_without_noise() -> None:
    """The mechanism fedpriv runs (each client's :func:`client_vector`, their modular sum,
    the server's :func:`server_sum`) on neighbouring datasets: client 0's update present
    or zeroed (zero-out), against the plan's epsilon after one round. The mutation (no
    noise shares) is caught."""
    plan = dd.DistributedPlan.make(1.0, 0.7, 16, 3, 3, 0)  # claims epsilon 7.2
    eps = plan.epsilon([3], 1e-5)
    updates = [np.array([1.0, 0.0, 0.0]), np.array([0.0, 0.6, 0.0]),
               np.array([0.0, 0.0, -0.8])]

    def run(which: str, run_seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(run_seed)
        first = updates[0] if which == "D" else np.zeros(3)
        total = sum(dd.client_vector(u, plan, 7, rng) for u in [first, *updates[1:]])
        return {"sum": dd.server_sum(total, plan, 7)}

    claim = Claim(eps, 1e-5, "zero-out")
    report = test_mechanism(run, runs=1500, claim=claim, seed=5)
    assert report.passed, report.describe()
    assert report.epsilon > 1.0  # it sees the signal (measured: 1.58)
    # the mutation: a plan claiming a small epsilon (z = 3), its noise shares removed
    strong = dd.DistributedPlan.make(1.0, 3.0, 16, 3, 3, 0)
    silent = dd.DistributedPlan(**{**strong.__dict__, "local_variance": 1e-9})

    def noiseless(which: str, run_seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(run_seed)
        first = updates[0] if which == "D" else np.zeros(3)
        total = sum(dd.client_vector(u, silent, 7, rng) for u in [first, *updates[1:]])
        return {"sum": dd.server_sum(total, silent, 7)}

    weak = Claim(strong.epsilon([3], 1e-5), 1e-5, "zero-out")
    assert not test_mechanism(noiseless, runs=400, claim=weak, seed=5).passed


def test_the_plan_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="rounding to integers"):
        dd.DistributedPlan.make(1.0, 1e-3, 8, 1 << 16, 100, 0)
    with pytest.raises(ValueError, match="subtract every noise share"):
        dd.DistributedPlan.make(1.0, 1.0, 20, 100, 5, 5)


def test_bad_distributed_settings_are_refused_before_start(tmp_path) -> None:
    """No secure aggregation, HE, colluders at the cohort, bits the 32-bit sum cannot
    hold: refused by the config; a plan whose modular sum would wrap or whose rounding
    would swamp the update: refused by the pre-flight check, before any process starts."""
    from experiments.preflight.checks import preflight
    from tasks.config import validate
    from tasks.errors import ConfigError

    base = {"dp": "distributed", "secure-aggregation": "secagg+",
            "results-dir": str(tmp_path)}
    for values, why in (({"secure-aggregation": "off"}, "needs secure-aggregation"),
                        ({"secure-aggregation": "he"}, "every client holds the decryption"),
                        ({"distributed-colluding": 10}, "could subtract every noise share"),
                        ({"num-clients": 256, "distributed-bits": 24},
                         "clients x 2\\^bits must stay below 2\\^32"),
                        ({"client-sampling": "poisson"}, "no amplification is claimed")):
        with pytest.raises(ConfigError, match=why):
            validate({**base, **values})
    with pytest.raises(ConfigError, match="rounding to integers"):
        preflight(validate({**base, "distributed-bits": 8, "num-clients": 100,
                            "noise-multiplier": 2.0}))
    with pytest.raises(ConfigError, match="cannot learn"):  # z sqrt(d) / m = 16 > 10
        preflight(validate({**base, "noise-multiplier": 1.0}))
    preflight(validate({**base, "num-clients": 100, "noise-multiplier": 2.0}))


def test_fedpriv_dp_test_runs_distributed_dp_as_the_product_does() -> None:
    """``fedpriv dp-test`` on a dp = "distributed" configuration: the clients' encode and
    noise, the modular sum, the server's decode and FedAvg's division, for the linear
    model, stays under the plan's epsilon and sees the extra client (measured: 1.31 vs
    10.81 at z = 0.5, 200 runs a side)."""
    from experiments.neighbour_mechanisms import mechanism_for
    from experiments.neighbour_mechanisms import test_config as run_test
    from tasks.config import validate

    cfg = validate({"dp": "distributed", "secure-aggregation": "secagg+", "model": "linear",
                    "noise-multiplier": 0.5})
    assert mechanism_for(cfg) == "distributed"
    report = run_test(cfg, runs=200)
    assert report.passed, report.describe()
    assert report.epsilon > 0.5 and report.claim.epsilon == pytest.approx(10.81, rel=0.01)
