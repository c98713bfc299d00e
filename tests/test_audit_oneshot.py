"""Audits judged against what they can see, through the project's own mechanisms:

- local DP-SGD with Poisson batches (Opacus through ``privacy.dp.dpsgd.make_private``,
  the client's training loop and its canary rows): the one-shot estimate (Andrew et al.,
  ICLR 2024) reaches most of the exact epsilon of the released update
  (:mod:`privacy.attacks.audit_view`, Steinke et al. 2025), far below the claim;
- full-batch DP-SGD: the one-shot bound reaches most of the claim;
- central DP-FedAvg with canary clients (``privacy.dp.dpfedavg``'s release and
  ``clipped_sum``): the client-level audit reaches most of the claim with 1,000 canary
  clients and catches z / 2.

A halved noise is rejected, the claimed noise never."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

from clients.update import with_canary_rows
from privacy.attacks.audit_gdp import gdp_epsilon
from privacy.attacks.audit_suite import audit_all, claim_check
from privacy.attacks.audit_view import CanaryView
from privacy.attacks.canaries import DirectionCanaries, GradientCanaries, canary_inclusion
from privacy.attacks.canary_clients import (
    CanaryClients,
    central_noise_for,
    simulate_dpfedavg_audit,
)
from privacy.dp.accounting import calibrate_noise, epsilon
from privacy.dp.correlated import tree_nodes
from privacy.dp.dpfedavg import DPFedAvgParams
from privacy.dp.dpsgd import make_private
from tasks.training import make_loader, sgd, train_epochs

DELTA = 1e-5


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@functools.cache
def local_dpsgd(target: float, q: float, canaries: int, shape: tuple[int, int],
                halved: bool = False, epochs: int = 3, seed: int = 0) -> dict:
    """DP-SGD on nn.Linear(*shape) with 40 real records and ``canaries`` Dirac canaries
    (at most the parameter count), ``epochs`` epochs at Poisson rate ``q``, sigma
    calibrated to ``target`` (dp-accounting PLD) and used as is or halved; the audit of
    the update against the claim and the claimed mechanism's view."""
    torch.manual_seed(seed)
    model = nn.Linear(*shape)
    x, y = torch.randn(40, shape[0]), torch.randint(0, shape[1], (40,))
    can = GradientCanaries.make(canaries, sum(p.numel() for p in model.parameters()), 1.0,
                                seed)
    included = canary_inclusion(canaries, seed + 1)
    x, y, ids = with_canary_rows(x, y, included)
    batch = len(y) if q == 1 else int(round(len(y) * q))
    steps = int(np.ceil(len(y) / batch)) * epochs
    sigma = calibrate_noise(target, DELTA, batch / len(y), steps)
    used = sigma / 2 if halved else sigma
    private = make_private(model, sgd(model, 1.0), make_loader(x, y, batch, seed, ids),
                           noise_multiplier=used, max_grad_norm=1.0, seed=seed,
                           noise_seed=seed + 7)
    before = _flat(private.module()).clone()
    train_epochs(private.model, private.loader, private.optimizer, epochs, torch.device("cpu"),
                 criterion=private.criterion, canaries=can.inject)
    assert private.history() == [(used, private.sample_rate, steps)]
    scores = can.scores(_flat(private.module()) - before)
    claimed = epsilon([(sigma, private.sample_rate, steps)], DELTA)
    view = CanaryView(sigma, private.sample_rate, steps)  # the claimed mechanism's
    bounds = audit_all(scores, included, DELTA, 0.95, 0.2)
    return {**bounds.record(), "epsilon-claimed": claimed, "sigma": sigma, "steps": steps,
            "q": private.sample_rate, "scores": scores, "included": included,
            **claim_check(bounds, claimed, gaussian_claim=q == 1, view=view)}


POISSON = dict(q=0.1, canaries=20_000, shape=(160, 128))  # 20,608 parameters, 30 steps
FULL = dict(q=1.0, canaries=10_000, shape=(128, 80))  # 10,320 parameters, 3 steps


@pytest.mark.parametrize("target", [8.0, 2.0])
def test_poisson_dpsgd_audit_reaches_most_of_what_the_update_shows(target):
    r = local_dpsgd(target, **POISSON)
    claimed, view = r["epsilon-claimed"], r["epsilon-view"]
    assert claimed == pytest.approx(target, rel=2e-3)
    assert view < (0.7 if target == 8 else 0.9) * claimed  # the server sees only sums
    assert r["epsilon-estimate-oneshot"] >= 0.8 * view, r["fraction-of-view"]
    # the equal-variance GDP estimate stays far below it (the mixture is wider)
    assert r["epsilon-estimate-gdp"] < 0.8 * r["epsilon-estimate-oneshot"]
    assert r["claim-consistent"] is True and r["claim-checked-by"] == "steinke, oneshot"
    assert r["fraction-of-view"]["epsilon-estimate-oneshot"] == pytest.approx(
        r["epsilon-estimate-oneshot"] / view)


def test_the_view_models_what_opacus_does():
    """Held-out canaries' coordinates are the noise alone, N(0, T sigma^2); included ones
    add Binomial(T, q) steps of C: scale-free, mean_in / sd_out and sd_in / sd_out are
    the view's (within sampling error of 10,000 canaries a side)."""
    r = local_dpsgd(8.0, **POISSON)
    s, inc = r["scores"], r["included"]
    m1, s1, _, s0 = CanaryView(r["sigma"], r["q"], r["steps"]).moments()
    unit = s[~inc].std() / s0  # lr C / expected batch
    assert abs(s[~inc].mean()) / unit < 0.1
    assert s[inc].mean() / unit == pytest.approx(m1, rel=0.05)
    assert s[inc].std() / unit == pytest.approx(s1, rel=0.03)


def test_poisson_dpsgd_with_half_the_noise_is_rejected():
    r = local_dpsgd(8.0, halved=True, **POISSON)
    assert r["claim-consistent"] is False and r["claim-rejected-by"] == ["oneshot"], r
    assert r["epsilon-lower-bound-oneshot"] > 1.3 * r["epsilon-claimed"]


@pytest.mark.parametrize("target", [8.0, 2.0])
def test_full_batch_dpsgd_audit_reaches_most_of_the_claim(target):
    r = local_dpsgd(target, **FULL)
    claimed = r["epsilon-claimed"]
    assert r["epsilon-view"] == pytest.approx(claimed, rel=2e-3)  # q = 1: one Gaussian
    assert r["epsilon-lower-bound-oneshot"] >= 0.8 * claimed, r["fraction-of-claim"]
    assert r["claim-consistent"] is True
    assert r["claim-checked-by"] == "steinke, fdp, gdp, oneshot"
    halved = local_dpsgd(target, halved=True, **FULL)
    assert halved["claim-consistent"] is False
    assert "oneshot" in halved["claim-rejected-by"] and "gdp" in halved["claim-rejected-by"]


@pytest.mark.parametrize("target", [8.0, 2.0])
def test_client_level_audit_of_dpfedavg_with_canary_clients(target):
    """1,000 canary clients (and 1,000 held-out directions), the small CNN's 26,010
    parameters, 20 real clients, every client in each of 3 rounds: the one-shot bound
    reaches at least half the claim near 8; z / 2 is rejected, z never."""
    z = central_noise_for(target, 3)
    honest = simulate_dpfedavg_audit(z, canary_clients=1000, held_out=1000, rounds=3)
    assert honest["epsilon-claimed"] == pytest.approx(target, rel=5e-3)
    # dp-accounting's PLD claim is the Gaussian composition, the view's exact epsilon
    assert honest["epsilon-view"] == pytest.approx(honest["epsilon-claimed"], rel=5e-3)
    assert honest["claim-consistent"] is True, honest
    assert honest["claim-checked-by"] == "oneshot, gdp"
    if target == 8.0:
        assert honest["epsilon-lower-bound-oneshot"] >= 0.5 * target
    halved = simulate_dpfedavg_audit(z, z / 2, canary_clients=1000, held_out=1000, rounds=3)
    assert halved["claim-consistent"] is False
    assert halved["epsilon-lower-bound-oneshot"] > target


def test_client_level_audit_with_poisson_client_sampling():
    """Canary clients sampled like every client (q = 0.5 a round, 6 rounds, z = 0.9): the
    view is the Binomial mixture; the claim (RDP, amplified) is above it and never
    exceeded."""
    r = simulate_dpfedavg_audit(0.9, canary_clients=1000, held_out=1000, rounds=6,
                                sampling="poisson", fraction=0.5, dim=20_000)
    assert r["client-sampling-rate"] == 0.5
    assert r["epsilon-view"] < r["epsilon-claimed"]
    assert r["claim-consistent"] is True
    assert r["epsilon-estimate-oneshot"] > 0.5 * r["epsilon-view"]


@pytest.mark.parametrize("mechanism", ["gaussian", "banded-mf", "tree"])
def test_client_level_audit_under_cyclic_groups(mechanism):
    """Canary clients in 4 cyclic groups over 8 rounds: the view is a Gaussian with mu =
    m / (z ||1^T M||) (m = 2 chances, M the mechanism's noise matrix, computed here from
    the strategy independently of the audit's code), at most the claim; the honest run
    stands, a run at a tenth of the noise is rejected (the tree's claim is twice the
    others' at equal z, so it runs at z = 2 to stay where 600 canaries can reject)."""
    z = 2.0 if mechanism == "tree" else 1.0
    run = {"canary_clients": 600, "held_out": 600, "rounds": 8, "dim": 3000,
           "real_clients": 40, "sampling": "cyclic", "groups": 4, "mechanism": mechanism,
           "seed": 2}
    honest = simulate_dpfedavg_audit(z, **run)
    matrix = DPFedAvgParams(noise_multiplier=z, clipping_norm=1.0, population=40,
                            sampling="cyclic", groups=4, rounds=8, mechanism=mechanism).matrix
    if mechanism == "tree":  # the released prefix: every node of both finished trees
        spread = np.sqrt(2 * len(tree_nodes(4)))
    else:
        spread = np.linalg.norm(np.linalg.inv(matrix.strategy()).sum(axis=0))
    mu = 2 / (z * spread)
    assert honest["epsilon-view"] == pytest.approx(gdp_epsilon(mu, 1e-5), rel=1e-3)
    assert honest["epsilon-view"] <= honest["epsilon-claimed"] * 1.001
    assert honest["claim-consistent"] is True, honest
    assert honest["claim-checked-by"] == "oneshot, gdp"
    assert honest["epsilon-estimate-oneshot"] > 0.4 * honest["epsilon-view"], honest
    weak = simulate_dpfedavg_audit(z, z / 10, **run)
    assert weak["claim-consistent"] is False, weak


def test_canary_clients_in_cyclic_groups_take_part_with_their_group():
    params = DPFedAvgParams(noise_multiplier=1.0, clipping_norm=1.0, population=12,
                            sampling="cyclic-poisson", groups=3, rounds=9, fraction=0.5)
    clients = CanaryClients.for_mechanism(params, 300, 30, 40, seed=1)
    assert clients.groups == 3 and clients.sampling_rate == 0.5
    for r in range(1, 10):
        taking = clients.participants(r)
        assert set(taking % 3) <= {(r - 1) % 3}
        assert 0.35 < len(taking) / 100 < 0.65


def test_canary_clients_take_part_as_sampled_and_sum_as_sent():
    params = DPFedAvgParams(noise_multiplier=1.0, clipping_norm=2.0, population=10,
                            sampling="poisson", fraction=0.3)
    clients = CanaryClients.for_mechanism(params, 400, 100, 50, seed=3)
    taking = [len(clients.participants(r)) for r in range(1, 51)]
    assert 0.25 < np.mean(taking) / 400 < 0.35
    assert list(clients.participants(7)) == list(clients.participants(7))  # reproducible
    shapes = [(5, 6), (20,)]
    total = clients.round_sum(2, shapes)
    expected = sum(2.0 * clients.directions.direction(int(k))
                   for k in clients.participants(2))
    assert np.allclose(np.concatenate([a.reshape(-1) for a in total]), expected)
    for update in clients.round_updates(2, shapes):  # the clipping norm: clipping is a no-op
        assert np.sqrt(sum((a ** 2).sum() for a in update)) == pytest.approx(2.0)
    fixed = DPFedAvgParams(noise_multiplier=1.0, clipping_norm=1.0, population=10,
                           sampling="fixed", fraction=0.5, cohort=5)
    with pytest.raises(ValueError, match="fixed-size cohort"):
        CanaryClients.for_mechanism(fixed, 100, 100, 50, seed=0)


def test_direction_canaries_are_unit_and_nearly_orthogonal():
    d = DirectionCanaries(50, 4000, 1.5, seed=1)
    v = d.direction(3)
    assert np.linalg.norm(v) == pytest.approx(1.0)
    assert np.allclose(d.direction(3), v)
    assert d.cosines(v)[3] == pytest.approx(1.0)
    others = np.delete(d.cosines(v), 3)
    assert np.abs(others).max() < 5 / np.sqrt(4000)
    assert np.linalg.norm(d.update(0)) == pytest.approx(1.5)


def test_the_server_side_audit_through_central_privacy():
    """The server's own DP-FedAvg object (``strategies.central_dp.CentralPrivacy``, the one
    ``CentralDPAggregation.combine`` releases through) with :class:`CanaryClientAudit`
    added to each round's replies, as the aggregation would: 600 canary clients, a
    20,000-parameter model in two arrays, 2 rounds at the z of a claim of 8."""
    from privacy.attacks.canary_clients import CanaryClientAudit
    from privacy.dp.dpfedavg import clipped_sum
    from strategies.central_dp import CentralPrivacy

    z = central_noise_for(8.0, 2)
    params = DPFedAvgParams(noise_multiplier=z, clipping_norm=1.0, population=10,
                            delta=DELTA)
    privacy = CentralPrivacy(params, "server-fixed", seed=0)
    audit = CanaryClientAudit.for_run(params, 600, 600, 20_000, seed=1)
    rng = np.random.default_rng(2)
    model = [rng.normal(0, 0.1, (100, 150)), rng.normal(0, 0.1, (5000,))]
    for r in (1, 2):
        replies = [[rng.normal(0, 0.1, a.shape) for a in model] for _ in range(10)]
        replies += audit.replies(r, model, privacy.clipping_norm)
        total, _ = clipped_sum(replies, privacy.clipping_norm, [a.shape for a in model])
        model = privacy.release(r, model, total)
        audit.released(r)
    out = audit.result(model, privacy.epsilon)
    assert out["rounds"] == 2 and out["epsilon-claimed"] == pytest.approx(8.0, rel=5e-3)
    assert out["claim-consistent"] is True
    assert out["epsilon-lower-bound-oneshot"] > 0.5 * out["epsilon-claimed"], out


def test_the_view_counts_only_the_rounds_that_released_a_model():
    """A round refused under SecAgg+ or HE releases nothing: no canary took part and its
    row of the noise is dropped, so the view is over the released rounds' rows only."""
    params = DPFedAvgParams(noise_multiplier=1.0, clipping_norm=1.0, population=12,
                            sampling="cyclic", groups=3, rounds=6, mechanism="banded-mf")
    clients = CanaryClients.for_mechanism(params, 30, 30, 40, seed=1)
    noise = params.matrix.noise_matrix()
    skipped = clients.view(1.0, 5, noise, released=[1, 2, 4, 5, 6])
    spread = np.linalg.norm(noise[[0, 1, 3, 4, 5]].sum(axis=0))
    # groups 0 and 1 had two chances each (rounds 1, 4 and 2, 5), group 2 one (round 6)
    assert skipped.steps == 2
    assert skipped.noise_multiplier * np.sqrt(2) == pytest.approx(spread)
    assert clients.view(1.0, 5, noise).noise_multiplier * np.sqrt(2) == pytest.approx(
        np.linalg.norm(noise[:5].sum(axis=0)))  # the first 5 rounds, by default


def test_gradient_canaries_land_on_their_coordinates_whatever_the_layout():
    """A plain client's convolutions are channels-last: each canary's gradient lands on
    the coordinate it names in the model's flat (NCHW) order, as on contiguous weights,
    and the scores read it back there."""
    from tasks.models import build_model
    from tasks.training import convolutions_channels_last

    grads = []
    for channels_last in (False, True):
        model = build_model("small-cnn", (1, 28, 28), 10)
        if channels_last:
            convolutions_channels_last(model, torch.device("cpu"))
        params = list(model.parameters())
        assert channels_last == (not params[2].is_contiguous())  # the second convolution
        for p in params:
            p.grad = torch.zeros_like(p)
        can = GradientCanaries.make(40, sum(p.numel() for p in params), 1.0, 5)
        ids = torch.tensor([-1, 3, 17, -2, 3, 39])
        can.inject(params, ids)
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
    assert torch.equal(grads[0], grads[1])
    hit = grads[1].nonzero().flatten().numpy()
    assert sorted(hit) == sorted(set(can.index[[3, 17, 39]]))
    assert np.isclose(grads[1][can.index[3]].item(), 2 / 6)  # two rows hold canary 3
