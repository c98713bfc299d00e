"""The correlated-noise core (banded Toeplitz matrix factorization, DP-FTRL's tree, BLT) against
computations outside it: jax-privacy's optimiser, inverse and sensitivity, dense linear
algebra, dp-accounting's tree accountant and the Gaussian closed form."""

from __future__ import annotations

import numpy as np
import pytest

from privacy.dp import correlated as cn
from privacy.dp.noise import noise_rng


@pytest.fixture(scope="module")
def jp():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    from jax_privacy.matrix_factorization import sensitivity, toeplitz

    return toeplitz, sensitivity


@pytest.mark.parametrize(("n", "bands"), [(20, 2), (50, 4), (100, 8)])
def test_the_banded_strategy_is_jax_privacys_and_so_is_its_error(jp, n, bands):
    toeplitz, _ = jp
    theirs = np.asarray(toeplitz.optimize_banded_toeplitz(n, bands))
    mine = cn.optimize_banded(n, bands)
    np.testing.assert_allclose(mine, theirs, rtol=1e-6)
    assert abs(np.linalg.norm(mine) - 1) < 1e-12
    # the objective: jax-privacy's loss (mean error x sensitivity^2) on the same coefficients
    assert cn.prefix_errors(mine, n).mean() == pytest.approx(float(toeplitz.loss(theirs, n)),
                                                            rel=1e-9)
    # better than independent noise (one band: DP-FedAvg) and than the max-error start
    start = cn.max_error_coefs(bands) / np.linalg.norm(cn.max_error_coefs(bands))
    assert cn.prefix_errors(mine, n).mean() <= cn.prefix_errors(start, n).mean() + 1e-12
    assert cn.prefix_errors(mine, n).mean() < 0.6 * cn.prefix_errors(np.ones(1), n).mean()


def test_one_band_is_independent_noise():
    assert cn.optimize_banded(30, 1).tolist() == [1.0]
    assert cn.prefix_errors(np.ones(1), 30).tolist() == list(range(1, 31))
    with pytest.raises(ValueError, match="bands must be in 1..30"):
        cn.optimize_banded(30, 31)


def test_the_inverse_series_is_the_dense_inverse_and_the_max_error_start_squares_to_a():
    c = cn.optimize_banded(12, 3)
    dense = cn.banded_matrix(c, 12)
    np.testing.assert_allclose(np.linalg.inv(dense)[:, 0], cn.inverse_coefs(c, 12), atol=1e-12)
    root = cn.banded_matrix(cn.max_error_coefs(12), 12)  # Fichtenberger et al.: C C = A
    np.testing.assert_allclose(root @ root, np.tril(np.ones((12, 12))), atol=1e-12)


def test_banded_noise_is_c_inverse_of_the_rounds_draws_and_rebuilds_exactly(jp):
    import jax.numpy as jnp

    toeplitz, _ = jp
    n, shapes, std, seed = 9, [(3,), (2, 2)], 0.7, 5
    c = cn.optimize_banded(n, 3)
    gen = cn.BandedNoise(c, shapes, std, seed)
    w = [gen.next(t) for t in range(1, n + 1)]
    # the draws themselves, from the same per-round generators
    z = [[noise_rng(seed, t, False).normal(0.0, std, s) for s in shapes][0]
         for t in range(1, n + 1)]
    first = np.stack([r[0] for r in w])  # rounds x 3
    np.testing.assert_allclose(cn.banded_matrix(c, n) @ first, np.stack(z), atol=1e-12)
    # jax-privacy's streaming C^-1 (forward substitution) on the same draws
    inv = toeplitz.inverse_as_streaming_matrix(np.asarray(c))
    np.testing.assert_allclose(np.asarray(inv @ jnp.asarray(np.stack(z))), first, atol=1e-10)
    again = cn.BandedNoise(c, shapes, std, seed)  # started late (a resume): rounds 1-6 drawn again
    for t in (7, 8, 9):
        for a, b in zip(again.advance(t), w[t - 1], strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="in order"):
        again.next(3)


@pytest.mark.parametrize("t", [1, 2, 5, 6, 7, 8, 13])
def test_tree_nodes_are_the_binary_decomposition(t):
    nodes = cn.tree_nodes(t)
    covered = [r for level, i in nodes for r in range((i << level) + 1, ((i + 1) << level) + 1)]
    assert covered == list(range(1, t + 1))
    assert len(nodes) == bin(t).count("1")


def test_the_tree_noise_on_the_running_sum_is_its_nodes_and_restarts_keep_the_old():
    shapes, std, seed = [(4,)], 1.0, 3
    gen = cn.TreeNoise(shapes, std, seed)
    running = np.zeros(4)
    for t in range(1, 12):
        running += gen.next(t)[0]
        nodes = sum(gen._node(0, level, i)[0] for level, i in cn.tree_nodes(t))
        np.testing.assert_allclose(running, nodes, atol=1e-12)
    # restarts every 4 rounds: the running sum keeps each finished tree's full prefix
    gen = cn.TreeNoise(shapes, std, seed, restart=4)
    running = np.zeros(4)
    for t in range(1, 11):
        running += gen.next(t)[0]
    finished = sum(gen._node(k, 2, 0)[0] for k in (0, 1))  # trees 0, 1: rounds 1-4, 5-8
    current = sum(gen._node(2, level, i)[0] for level, i in cn.tree_nodes(2))
    np.testing.assert_allclose(running, finished + current, atol=1e-12)


def test_tree_noise_variance_by_monte_carlo():
    """The running sum after t rounds carries popcount(t) node Gaussians: its variance,
    over 4,000 seeds, is std^2 x popcount(t) (within 10%)."""
    std, t = 0.5, 7
    sums = np.array([sum(cn.TreeNoise([(1,)], std, s).next(r)[0][0] for r in range(1, t + 1))
                     for s in range(4000)])
    assert np.var(sums) == pytest.approx(std ** 2 * 3, rel=0.1)


def test_banded_sensitivity_is_jax_privacys_min_separation_bound(jp):
    toeplitz, sens = jp
    n, bands = 24, 4
    c = cn.optimize_banded(n, bands)
    dense = cn.banded_matrix(c, n)
    # cyclic groups of `bands` rounds apart: client g takes part in rounds g, g+b, ...
    schedule = [range(g, n, bands) for g in range(bands)]
    mine = cn.sensitivity(dense, schedule)
    bound = float(sens.get_min_sep_sensitivity_upper_bound(dense, min_sep=bands,
                                                           max_participations=n // bands))
    closed = float(toeplitz.minsep_sensitivity_squared(np.asarray(c), bands, n // bands, n))
    assert mine == pytest.approx(bound, rel=1e-9)
    assert mine ** 2 == pytest.approx(closed, rel=1e-9)
    assert mine <= np.sqrt(n // bands) + 1e-12  # disjoint columns of norm <= 1


def test_tree_sensitivity_and_epsilon_equal_dp_accountings_tree_accountant():
    """One participation per tree of G rounds, restarted n/G times: sensitivity
    sqrt(trees x depth) from the matrix; the Gaussian's epsilon at sigma / that equals
    dp-accounting's RDP for its tree-aggregation event (Kairouz et al. 2021): the same
    RDP curve, so the same RDP epsilon."""
    from dp_accounting import GaussianDpEvent, NeighboringRelation, SelfComposedDpEvent
    from dp_accounting import SingleEpochTreeAggregationDpEvent as Tree
    from dp_accounting.rdp import RdpAccountant

    group, trees, sigma = 7, 3, 4.0
    matrix, _ = cn.tree_matrix(group)
    assert cn.sensitivity(matrix, [[r] for r in range(group)]) ** 2 == pytest.approx(
        cn.tree_depth(group))
    units = np.sqrt(trees * cn.tree_depth(group))
    tree = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
    tree.compose(SelfComposedDpEvent(Tree(sigma, group), trees))
    gauss = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
    gauss.compose(GaussianDpEvent(sigma / units))
    assert tree.get_epsilon(1e-5) == pytest.approx(gauss.get_epsilon(1e-5), rel=1e-9)
    # the PLD of that Gaussian is the tight figure fedpriv reports; RDP's is above it
    assert cn.gaussian_epsilon(sigma / units, 1e-5) < tree.get_epsilon(1e-5)


def _blt_loss(coefs: np.ndarray, n: int, groups: int) -> float:
    """Mean prefix error of C^-1 times the squared sensitivity over cyclic groups, by
    dense linear algebra (not the optimiser's code)."""
    dense = cn.banded_matrix(coefs, n)
    prefix = np.tril(np.ones((n, n))) @ np.linalg.inv(dense)
    error = np.mean(np.sum(prefix ** 2, axis=1))
    sens2 = max(np.sum(dense[:, g::groups].sum(axis=1) ** 2) for g in range(groups))
    return float(error * sens2)


def test_the_blt_optimiser_does_at_least_as_well_as_jax_privacys(jp):
    """BLT for 20 rounds in 4 cyclic groups (Dvijotham et al. 2024): fedpriv's L-BFGS
    against jax-privacy 2.0's buffered_toeplitz.optimize (min-sep 4, 5 participations,
    mean error), both scored by the same dense computation; and jax-privacy's min-sep
    sensitivity of fedpriv's BLT equals the cyclic schedule's."""
    from jax_privacy.matrix_factorization import buffered_toeplitz

    toeplitz, _ = jp
    n, groups = 20, 4
    theta, omega = cn.optimize_blt(n, groups)
    mine = cn.blt_coefs(theta, omega, n)
    theirs = buffered_toeplitz.optimize(n=n, min_sep=groups, max_participations=5,
                                        error="mean")
    their_coefs = np.asarray(theirs.toeplitz_coefs(n))
    assert _blt_loss(mine, n, groups) <= 1.01 * _blt_loss(their_coefs, n, groups)
    assert np.all(np.diff(mine[1:]) <= 0) and np.all(mine > 0)  # decreasing, positive
    closed = float(toeplitz.minsep_sensitivity_squared(mine, groups, 5, n))
    schedule = [range(g, n, groups) for g in range(groups)]
    assert cn.sensitivity(cn.banded_matrix(mine, n), schedule) ** 2 == pytest.approx(
        closed, rel=1e-9)
    # one group (everyone every round): correlation cannot help, the identity is optimal
    assert _blt_loss(cn.blt_coefs(*cn.optimize_blt(12, 1), 12), 12, 1) == pytest.approx(
        _blt_loss(np.ones(1), 12, 1), rel=1e-6)


def test_blt_noise_is_c_inverse_of_the_rounds_draws_and_rebuilds_exactly():
    n, shapes, std, seed = 11, [(3,), (2, 2)], 0.6, 4
    theta, omega = np.array([0.8, 0.3]), np.array([0.4, 0.2])
    gen = cn.BLTNoise(theta, omega, shapes, std, seed)
    got = [gen.next(t) for t in range(1, n + 1)]
    inv = np.linalg.inv(cn.banded_matrix(cn.blt_coefs(theta, omega, n), n))
    from privacy.dp.noise import gaussian_noise
    draws = []
    for t in range(1, n + 1):  # each round's generator draws its arrays in order
        rng = noise_rng(seed, t, False)
        draws.append([gaussian_noise(shape, std, rng) for shape in shapes])
    for k in range(len(shapes)):
        z = np.stack([d[k].reshape(-1) for d in draws])
        w = np.stack([g[k].reshape(-1) for g in got])
        np.testing.assert_allclose(w, inv @ z, atol=1e-12)
    late = cn.BLTNoise(theta, omega, shapes, std, seed)  # a resume at round 8
    for a, b in zip(late.advance(8), got[7], strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="rounds must come in order"):
        late.next(3)
