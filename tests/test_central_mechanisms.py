"""Central DP's mechanisms across rounds (central-mechanism: gaussian, banded-mf, tree) under
cyclic participation: epsilon against computations outside fedpriv (jax-privacy's
sensitivity and amplified-BandMF event, the analytic Gaussian), the neighbouring-datasets
tester over the whole run, resume, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from privacy.dp.correlated import MatrixMechanism
from privacy.dp.dpfedavg import CentralAccountant, DPFedAvg, DPFedAvgParams
from tasks.config import ConfigError, validate


def params(mechanism: str, sampling: str = "cyclic", *, groups: int = 4, rounds: int = 20,
           z: float = 1.5, fraction: float = 1.0, **extra) -> DPFedAvgParams:
    return DPFedAvgParams(noise_multiplier=z, clipping_norm=1.0, population=40,
                          sampling=sampling, fraction=fraction, mechanism=mechanism,
                          groups=groups, rounds=rounds, delta=1e-5, **extra)


def analytic(multiplier: float, delta: float = 1e-5) -> float:
    """Balle & Wang's analytic Gaussian (dp-accounting's closed form, not its PLD)."""
    from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

    return get_epsilon_gaussian(multiplier, delta)


@pytest.fixture(scope="module")
def jp():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    from jax_privacy.experimental import accounting
    from jax_privacy.matrix_factorization import toeplitz

    return toeplitz, accounting


@pytest.mark.parametrize("mechanism", ["banded-mf", "blt"])
@pytest.mark.parametrize("upto", [4, 13, 20])
def test_toeplitz_epsilon_is_the_gaussian_at_jax_privacys_sensitivity(jp, upto, mechanism):
    """Banded MF and BLT: the Gaussian mechanism (analytic, Balle & Wang) at jax-privacy's
    min-separation sensitivity of the same coefficients."""
    toeplitz, _ = jp
    p = params(mechanism, groups=4)
    coefs = np.asarray(p.matrix.coefs)[:upto]
    k = len(range(0, upto, 4))  # group 0 takes part the most
    # jax-privacy's min-separation sensitivity of the Toeplitz strategy over `upto` rounds
    sens = float(np.sqrt(toeplitz.minsep_sensitivity_squared(coefs, 4, k, upto)))
    assert p.matrix.sensitivity(upto) == pytest.approx(sens, rel=1e-9)
    assert CentralAccountant(p).epsilon_after(upto) == pytest.approx(analytic(1.5 / sens),
                                                                     rel=0.01)


def test_amplified_banded_mf_epsilon_is_jax_privacys_event(jp):
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import PLDAccountant

    _, accounting = jp
    p = params("banded-mf", "cyclic-poisson", groups=4, fraction=0.3, z=1.2)
    event = accounting.amplified_bandmf_event(1.2, 20, num_bands=4, sampling_prob=0.3)
    pld = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE)
    pld.compose(event)
    assert CentralAccountant(p).epsilon_after(20) == pytest.approx(pld.get_epsilon(1e-5),
                                                                   rel=0.01)


def test_tree_and_cyclic_gaussian_epsilons_have_closed_forms():
    """The tree restarted every G rounds: each client in one leaf of each of the
    ceil(n/G) trees, floor(log2 G) + 1 nodes each; independent noise: sqrt(k)."""
    tree = params("tree", groups=8, rounds=24, z=3.0)
    assert tree.matrix.sensitivity(24) == pytest.approx(np.sqrt(3 * 4))
    assert CentralAccountant(tree).epsilon_after(24) == pytest.approx(
        analytic(3.0 / np.sqrt(12)), rel=0.01)
    gauss = params("gaussian", groups=5, rounds=20, z=2.0)
    assert CentralAccountant(gauss).epsilon_after(20) == pytest.approx(
        analytic(2.0 / 2.0), rel=0.01)
    # and the first G rounds of the tree: one leaf, floor(log2 t) + 1 nodes completed
    assert tree.matrix.sensitivity(3) == pytest.approx(np.sqrt(2))


def test_banded_noise_beats_independent_noise_on_the_running_model_at_equal_epsilon():
    """What banded MF buys: at the same accounted epsilon, the noise on the running sum
    (the model) is smaller on average over the run than DP-FedAvg's under the same cyclic
    schedule (Choquette-Choo et al. 2023), measured by Monte Carlo of the noise the
    mechanisms actually add."""
    from privacy.dp.correlated import prefix_errors

    rounds, groups = 16, 4
    banded, plain = params("banded-mf", groups=groups, rounds=rounds), \
        params("gaussian", groups=groups, rounds=rounds)
    scale = banded.matrix.sensitivity(rounds) / plain.matrix.sensitivity(rounds)
    assert CentralAccountant(params("banded-mf", groups=groups, rounds=rounds,
                                    z=1.5 * scale)).epsilon_after(rounds) == pytest.approx(
        CentralAccountant(params("gaussian", groups=groups, rounds=rounds, z=1.5)
                          ).epsilon_after(rounds), rel=0.01)

    def running_variance(p: DPFedAvgParams) -> np.ndarray:
        sums = []
        for seed in range(300):
            mech = DPFedAvg(p, seed)
            total, out = np.zeros(64), []
            for t in range(1, rounds + 1):
                total = total + mech.release(t, [np.zeros(64)]).update[0] * \
                    p.denominator
                out.append(np.mean(total ** 2))
            sums.append(out)
        return np.mean(sums, axis=0)

    mf = running_variance(params("banded-mf", groups=groups, rounds=rounds, z=1.5 * scale))
    iid = running_variance(params("gaussian", groups=groups, rounds=rounds, z=1.5))
    assert mf.mean() < 0.8 * iid.mean()
    expected = prefix_errors(banded.matrix.coefs, rounds) / 1.0  # unit noise, ||c|| = 1
    np.testing.assert_allclose(mf / (1.5 * scale) ** 2, expected, rtol=0.15)


@pytest.mark.parametrize("mechanism", ["banded-mf", "tree", "blt"])
def test_a_resumed_run_continues_the_correlated_noise_exactly(mechanism):
    p = params(mechanism, groups=4, rounds=12)
    shapes = [np.zeros((3, 2)), np.zeros(5)]
    whole = DPFedAvg(p, seed=7)
    expected = [whole.release(t, shapes).update for t in range(1, 13)]
    resumed = DPFedAvg(p, seed=7)
    resumed.resume()
    for t in range(7, 13):
        for a, b in zip(resumed.release(t, shapes).update, expected[t - 1], strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_cohort_is_the_rounds_group_and_poisson_thins_it():
    import random

    from strategies.central_dp import CentralDPAggregation, CentralPrivacy

    privacy = CentralPrivacy(params("banded-mf", groups=4), "server-fixed", 0)
    agg = CentralDPAggregation(privacy, client_side=False)
    ids = [100 + i for i in range(10)]
    seen = {}
    for t in range(1, 9):
        agg.begin_round(t)
        seen[t] = agg.sample(ids, random.Random(t), 0)
    assert seen[1] == [100, 104, 108] and seen[2] == [101, 105, 109] and seen[4] == [103, 107]
    assert seen[5] == seen[1]
    # a node missing (partition 4 disconnected): the others keep their groups
    present = [n for n in ids if n != 104]
    partition_of = {n: n - 100 for n in present}
    agg.begin_round(1)
    assert agg.sample(present, random.Random(1), 0, partition_of) == [100, 108]
    agg.begin_round(2)
    assert agg.sample(present, random.Random(2), 0, partition_of) == [101, 105, 109]
    thinned = CentralPrivacy(params("banded-mf", "cyclic-poisson", groups=2, fraction=0.5),
                             "server-fixed", 0)
    agg = CentralDPAggregation(thinned, client_side=False)
    agg.begin_round(2)
    picks = [tuple(agg.sample(ids, random.Random(s), 0)) for s in range(200)]
    assert all(set(x) <= {101, 103, 105, 107, 109} for x in picks)
    assert 1.5 < np.mean([len(x) for x in picks]) < 3.5  # 5 members at q = 0.5
    assert thinned.params.denominator == 10.0  # 40 / 2 groups x q = 0.5


def _tested(mechanism: str, sampling: str, z: float):
    from experiments.neighbour_mechanisms import test_config

    sets = {"dp": "central", "dataset": "breast-cancer", "model": "linear", "num-clients": 8,
            "num-server-rounds": 8, "noise-multiplier": z, "client-sampling": sampling,
            "cyclic-groups": 4, "central-mechanism": mechanism}
    if sampling == "cyclic-poisson":
        sets["fraction-train"] = 0.5
    return test_config(validate(sets), runs=200)


@pytest.mark.parametrize(("mechanism", "sampling"), [
    ("gaussian", "cyclic"), ("banded-mf", "cyclic"), ("banded-mf", "cyclic-poisson"),
    ("tree", "cyclic"), ("blt", "cyclic")])
def test_each_mechanism_keeps_its_claim_over_the_whole_run(mechanism, sampling):
    """One client more (its update 10 C on one coordinate, clipped, the same in each of
    its rounds) against the same federation without it, every round's release (and, for
    correlated noise, the releases whitened by the noise's covariance, where the noise is
    iid again): the tester's lower bound stays under the claimed epsilon. At noise
    multiplier 0.5 on a 62-weight model the tester sees the client (a bound above 0)
    except through Poisson sampling."""
    report = _tested(mechanism, sampling, 0.5)
    assert report.passed, f"{report.describe()}\n{report.table()}"
    assert "8 rounds" in report.claim.source
    if sampling == "cyclic":
        assert max(b.epsilon for b in report.statistics) > 0.3, report.table()


def test_an_understated_sensitivity_is_caught_by_the_tester(monkeypatch):
    """The tester has the power to see a wrong claim over a whole run: with the
    sensitivity understated 30-fold (noise multiplier 0.3: the client stands out), the
    claim is refuted."""
    real = MatrixMechanism.sensitivity
    monkeypatch.setattr(MatrixMechanism, "sensitivity", lambda self, upto: real(self, upto) / 30)
    report = _tested("banded-mf", "cyclic", 0.3)
    assert report.claim.epsilon < 1 and not report.passed, report.describe()


def test_the_noise_matrix_is_what_the_generators_draw():
    """M (each round's noise = M z) against the generators themselves: C^-1 for banded
    noise exactly, and the tree's covariance M M^T by Monte Carlo over 4,000 seeds."""
    from privacy.dp.correlated import BandedNoise, TreeNoise

    banded = MatrixMechanism("banded-mf", 6, 3)
    np.testing.assert_allclose(banded.noise_matrix(), np.linalg.inv(banded.strategy()))
    tree = MatrixMechanism("tree", 10, 4)
    m = tree.noise_matrix()
    draws = np.array([[TreeNoise([(1,)], 1.0, s, restart=4).next(t)[0][0]
                       for t in range(1, 11)] for s in range(4000)])
    np.testing.assert_allclose(np.cov(draws.T), m @ m.T, atol=0.2)
    assert np.diag(m @ m.T).tolist() == [1, 2, 1, 3, 1, 2, 1, 3, 1, 2]
    blt = MatrixMechanism("blt", 8, 2)
    np.testing.assert_allclose(blt.noise_matrix(), np.linalg.inv(blt.strategy()))
    gen = BandedNoise(banded.coefs, [(1,)], 1.0, 0)
    assert len([gen.next(t) for t in range(1, 7)]) == 6


@pytest.mark.parametrize(("sets", "says"), [
    ({"dp": "central", "central-mechanism": "banded-mf"}, "cannot promise"),
    ({"dp": "central", "client-sampling": "cyclic-poisson", "cyclic-groups": 2,
      "fraction-train": 0.5, "central-mechanism": "blt"}, "only banded-mf's"),
    ({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 2,
      "central-mechanism": "blt", "mf-bands": 2}, "only banded-mf has bands"),
    ({"dp": "central", "central-mechanism": "tree", "client-sampling": "poisson",
      "fraction-train": 0.5}, "cannot promise"),
    ({"dp": "local", "central-mechanism": "tree"}, "Set dp = 'central'"),
    ({"dp": "none", "client-sampling": "cyclic", "cyclic-groups": 2}, "cyclic groups are"),
    ({"dp": "central", "client-sampling": "cyclic"}, "cyclic-groups = 0"),
    ({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 11,
      "num-server-rounds": 10}, "between 1 and min"),
    ({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 2,
      "fraction-train": 0.5}, "trains its whole group"),
    ({"dp": "central", "client-sampling": "cyclic-poisson", "cyclic-groups": 2,
      "fraction-train": 0.5, "central-mechanism": "tree"}, "no amplification"),
    ({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 2,
      "central-mechanism": "banded-mf", "mf-bands": 3}, "take part twice within 3"),
    ({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 2,
      "central-mechanism": "tree", "mf-bands": 2}, "only banded-mf has bands"),
    ({"dp": "central", "cyclic-groups": 2}, "only cyclic sampling has groups"),
    ({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 2,
      "central-clipping": "server-adaptive"}, "adaptive clipping"),
    ({"dp": "central", "client-sampling": "cyclic-poisson", "cyclic-groups": 2,
      "fraction-train": 0.5, "secure-aggregation": "secagg+",
      "central-clipping": "client-fixed"}, "too small for SecAgg"),
])
def test_what_the_mechanisms_cannot_honour_is_refused_before_start(sets, says):
    with pytest.raises(ConfigError, match=says):
        validate(sets)


def test_a_valid_schedule_is_accepted_and_described():
    from strategies.central_dp import central_privacy

    cfg = validate({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 5,
                    "central-mechanism": "banded-mf", "mf-bands": 3, "num-clients": 20,
                    "num-server-rounds": 10})
    privacy = central_privacy(cfg, 20)
    described = privacy.describe()
    assert described["mechanism"] == "banded-mf" and described["bands"] == 3
    assert described["cyclic-groups"] == 5 and "banded matrix factorization, 3 bands" in \
        described["accounting"]
    assert privacy.params.denominator == 4


@pytest.mark.parametrize("sets", [
    {"client-sampling": "poisson", "fraction-train": 0.2, "num-clients": 50},
    {"client-sampling": "cyclic", "cyclic-groups": 5, "central-mechanism": "banded-mf",
     "num-clients": 50}])
def test_target_epsilon_calibrates_the_least_noise_for_the_run(sets):
    """dp = central with target-epsilon: the reported epsilon after the planned rounds is
    at most the target, and 0.2% less noise would exceed it."""
    import dataclasses

    from strategies.central_dp import central_params

    cfg = validate({"dp": "central", "target-epsilon": 4.0, "num-server-rounds": 10, **sets})
    p = central_params(cfg, 50)
    assert CentralAccountant(p).epsilon_after(10) <= 4.0
    less = dataclasses.replace(p, noise_multiplier=p.noise_multiplier / 1.002)
    assert CentralAccountant(less).epsilon_after(10) > 4.0
    with pytest.raises(ConfigError, match="noise-multiplier = 0 adds no noise"):
        validate({"dp": "central", "noise-multiplier": 0})
    validate({"dp": "central", "noise-multiplier": 0, "target-epsilon": 2})  # the target rules
    tiny = validate({"dp": "central", "target-epsilon": 1e-6, "num-server-rounds": 10, **sets})
    with pytest.raises(ValueError, match=r"at 10000: .*; set target-epsilon to at least"):
        central_params(tiny, 50)


def test_max_epsilon_counts_rounds_that_released_nothing():
    """Under cyclic sampling every round up to the current counts (its row of C is
    spent whether or not it released): after rounds 1-3 and a round 4 that released
    nothing, round 5 would take epsilon from 2.94 to 3.71, past max-epsilon 3."""
    from strategies.central_dp import CentralPrivacy

    p = params("gaussian", groups=2, rounds=8, z=2.0, max_epsilon=3.0)
    privacy = CentralPrivacy(p, "server-fixed", 0)
    zeros = [np.zeros(3)]
    for t in (1, 2, 3):
        assert privacy.stop_reason(t) is None
        privacy.release(t, zeros, [np.zeros(3)])
    assert privacy.epsilon == pytest.approx(CentralAccountant(p).epsilon_after(3))
    assert CentralAccountant(p).epsilon_after(4) <= 3.0 < CentralAccountant(p).epsilon_after(5)
    assert privacy.stop_reason(5) is not None  # round 4 released nothing


def test_unequal_groups_share_one_denominator():
    """41 clients in 4 groups (11, 10, 10, 10): every round divides by N / groups, so the
    rounds' correlated noise keeps its weights on the model."""
    p = DPFedAvgParams(noise_multiplier=1.0, clipping_norm=1.0, population=41,
                       sampling="cyclic", mechanism="tree", groups=4, rounds=8)
    mech = DPFedAvg(p, 0)
    d = {mech.release(t, [np.zeros(2)]).update[0][0] * 0 + p.denominator for t in range(1, 9)}
    assert d == {41 / 4}


def test_the_membership_claim_of_a_correlated_run_is_its_own_curve():
    """The record-level claim checked against membership attacks under central DP: for
    correlated noise the whole release's curve (sensitivity 2C in each of the client's
    rounds), whose epsilon at delta is the claim's."""
    from dp_accounting.pld import PLDAccountant

    from experiments.leakage.claims import membership_claim
    from privacy.attacks.observation import Observation

    cfg = validate({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 4,
                    "central-mechanism": "banded-mf", "num-clients": 40,
                    "num-server-rounds": 20, "noise-multiplier": 1.5})
    p = params("banded-mf", groups=4, rounds=20, z=1.5)
    obs = Observation.__new__(Observation)
    claim = membership_claim(cfg, obs, [], (p, 20))
    assert "banded-mf noise over 20 round(s)" in claim.by
    acc = PLDAccountant()
    acc.compose(p.matrix.record_event(1.5, 20))
    assert claim.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=0.01)
    # the curve passes through the claim: delta(epsilon) at the claimed epsilon is ~1e-5
    eps, deltas = zip(*claim.profile, strict=True)
    assert np.interp(claim.epsilon, eps, deltas) == pytest.approx(1e-5, rel=0.5)
    # and is not DP-FedAvg's every-round curve (twice the multiplier's worth weaker)
    independent = membership_claim(cfg, obs, [], (params("gaussian", "fixed", groups=0,
                                                          rounds=0, z=1.5), 20))
    assert np.interp(claim.epsilon, *zip(*independent.profile, strict=True)) > 1e-3


def test_he_refuses_groups_smaller_than_its_minimum_cohort():
    with pytest.raises(ConfigError, match="cyclic-groups = 5 samples 2 client"):
        validate({"dp": "central", "client-sampling": "cyclic", "cyclic-groups": 5,
                  "num-clients": 10, "secure-aggregation": "he",
                  "central-clipping": "client-fixed", "he-min-cohort": 3})
