"""Catching a false epsilon in one run: a mechanism that adds half the
noise its accountant claims is rejected by the audit; the same settings with the noise
it claims are not. Both use the project's own mechanism code: (a) local DP-SGD through
Opacus' PrivacyEngine (``privacy.dp.dpsgd.make_private``, the client's training loop and
its canary rows), (b) central DP-FedAvg's server-side clip, sum and noise
(``privacy.dp.dpfedavg``) with the z/2 mistake."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from clients.update import with_canary_rows
from privacy.attacks.audit_suite import audit_all, claim_check
from privacy.attacks.canaries import GradientCanaries, canary_inclusion
from privacy.dp.accounting import epsilon
from privacy.dp.dpfedavg import CentralAccountant, DPFedAvg, DPFedAvgParams, clipped_sum
from privacy.dp.dpsgd import make_private
from tasks.training import make_loader, sgd, train_epochs

DELTA = 1e-5
CLIP = 1.0


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def local_dpsgd(sigma_claimed: float, sigma_used: float, canaries: int = 3000,
                steps: int = 4, seed: int = 0) -> dict:
    """DP-SGD on a small model (4,160 parameters) with 40 real records and ``canaries``
    Dirac canaries, full-batch Poisson sampling (q = 1), ``steps`` steps; the audit of the
    update against the epsilon the accountant gives for ``sigma_claimed``."""
    torch.manual_seed(seed)
    model = nn.Linear(64, 64)
    x, y = torch.randn(40, 64), torch.randint(0, 64, (40,))
    can = GradientCanaries.make(canaries, sum(p.numel() for p in model.parameters()), CLIP,
                                seed)
    included = canary_inclusion(canaries, seed + 1)
    x, y, ids = with_canary_rows(x, y, included)
    private = make_private(model, sgd(model, 0.5), make_loader(x, y, len(y), seed, ids),
                           noise_multiplier=sigma_used, max_grad_norm=CLIP, seed=seed)
    assert private.sample_rate == 1.0
    before = _flat(private.module())
    train_epochs(private.model, private.loader, private.optimizer, steps, torch.device("cpu"),
                 criterion=private.criterion, canaries=can.inject)
    assert private.history() == [(sigma_used, 1.0, steps)]  # Opacus noised with sigma_used
    claimed = epsilon([(sigma_claimed, 1.0, steps)], DELTA)
    bounds = audit_all(can.scores(_flat(private.module()) - before), included, DELTA, 0.95, 0.2)
    return {**bounds.record(), "epsilon-claimed": claimed,
            **claim_check(bounds, claimed, gaussian_claim=True)}


@pytest.mark.parametrize("halved", [True, False])
def test_local_dpsgd_with_half_the_claimed_noise_is_caught(halved):
    sigma = 4.0  # 4 full-batch steps: mu = 0.5, claimed epsilon about 2.2 at 1e-5
    result = local_dpsgd(sigma, sigma / 2 if halved else sigma)
    assert 1.8 < result["epsilon-claimed"] < 2.6
    assert result["claim-consistent"] is (not halved), result
    if halved:
        assert result["epsilon-estimate-gdp"] > 1.3 * result["epsilon-claimed"]
        assert "gdp" in result["claim-rejected-by"]
    else:  # and the bounds are not vacuous on the correct run
        assert result["epsilon-estimate-gdp"] > 0.4 * result["epsilon-claimed"]


def central_dpfedavg(z_claimed: float, z_used: float, canaries: int = 5000, rounds: int = 2,
                     seed: int = 0) -> dict:
    """DP-FedAvg, every client every round: ``canaries`` canary clients, each sending a
    Dirac update of norm C on its own coordinate when included (nothing when not), beside
    20 clients with random updates; the server clips, sums and noises with ``z_used``; the
    accountant claims ``z_claimed`` (client-level, Gaussian: no sampling)."""
    rng = np.random.default_rng(seed)
    dim, population = 6000, canaries + 20
    can = GradientCanaries.make(canaries, dim, CLIP, seed)
    included = canary_inclusion(canaries, seed + 1)
    claim = DPFedAvgParams(noise_multiplier=z_claimed, clipping_norm=CLIP,
                           population=population, delta=DELTA)
    used = DPFedAvgParams(noise_multiplier=z_used, clipping_norm=CLIP, population=population,
                          delta=DELTA)
    server = DPFedAvg(used, seed=seed)
    total = np.zeros(dim)
    for r in range(1, rounds + 1):
        updates = [[rng.normal(0, 1, dim)] for _ in range(20)]  # clipped to C like any
        for k in np.flatnonzero(included):
            dirac = np.zeros(dim)
            dirac[can.index[k]] = -CLIP  # the update moves against the canary's gradient
            updates.append([dirac])
        clipped, _ = clipped_sum(updates, CLIP, [(dim,)])
        total += server.release(r, clipped).update[0]
    claimed = CentralAccountant(claim).epsilon_after(rounds)
    bounds = audit_all(can.scores(torch.from_numpy(total)), included, DELTA, 0.95, 0.2)
    return {**bounds.record(), "epsilon-claimed": claimed,
            **claim_check(bounds, claimed, gaussian_claim=True)}


@pytest.mark.parametrize("halved", [True, False])
def test_central_dpfedavg_with_half_the_claimed_z_is_caught(halved):
    z = 2.8  # 2 rounds: mu = 0.505, claimed epsilon about 2.2 at 1e-5
    result = central_dpfedavg(z, z / 2 if halved else z)
    assert 1.8 < result["epsilon-claimed"] < 2.6
    assert result["claim-consistent"] is (not halved), result
    if halved:
        assert result["epsilon-estimate-gdp"] > 1.3 * result["epsilon-claimed"]
        assert "gdp" in result["claim-rejected-by"]
    else:
        assert result["epsilon-estimate-gdp"] > 0.4 * result["epsilon-claimed"]
