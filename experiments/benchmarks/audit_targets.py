"""How tight the whole-run white-box audit of local DP-SGD is, against the claim and
against what the audit can see (the exact epsilon of the released updates' view,
:mod:`privacy.attacks.audit_view`, Steinke et al. 2025), and how tight the client-level
audit of central DP-FedAvg with canary clients is (Andrew et al., ICLR 2024).

The client is the project's: the run's model (the small CNN on embedded MNIST), 50 real
digits plus Dirac canaries as rows (``clients.update.with_canary_rows``), Opacus'
PrivacyEngine through ``privacy.dp.dpsgd.make_private``, the client's training loop with
the canary hook, the noise calibrated by the project's accountant
(``calibrate_noise``, RDP) to the target epsilon at delta 1e-5. The server sees one
update per round; the audit sums the rounds' canary scores (experiments.leakage.audit_run).
Two batchings: full batch (q = 1: each round is one Gaussian step per local epoch, what
the server sees is what the accountant counts) and Poisson batches of a tenth (q = 0.1:
the accountant counts amplification by subsampling per step, the server sees only the
round's sum). Each line gives the four estimators (Steinke; f-DP; GDP; the one-shot
estimate of Andrew et al. and its lower bound), the view's exact epsilon (of the summed
scores, and of the rounds as separate releases) and every epsilon as a fraction of the
claim and of the view.

``--client-level``: DP-FedAvg through ``privacy.dp.dpfedavg`` (every client every round,
3 rounds, 20 real clients, the small CNN's 26,010 parameters) with 1,000 canary clients
and 1,000 held-out directions, the claimed z and z / 2 (:mod:`privacy.attacks.canary_clients`).

Usage: python -m experiments.benchmarks.audit_targets [--canaries 20000] [--client-level]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from clients.update import with_canary_rows
from privacy.attacks.audit_suite import EPSILON_KEYS, audit_all, claim_check
from privacy.attacks.audit_view import CanaryView, view_epsilon
from privacy.attacks.canaries import GradientCanaries, canary_inclusion
from privacy.attacks.canary_clients import central_noise_for, simulate_dpfedavg_audit
from privacy.dp.accounting import calibrate_noise, epsilon
from privacy.dp.dpsgd import make_private
from tasks.config import validate
from tasks.splits import client_split, model_for
from tasks.training import make_loader, sgd, train_epochs

DELTA, CLIP, REAL = 1e-5, 1.0, 50


def audit_once(target: float, q: float, canaries: int, rounds: int, seed: int) -> dict:
    """One run: ``rounds`` rounds of one local epoch at sampling rate ``q``."""
    cfg = validate({})
    torch.manual_seed(seed)
    model, _ = model_for(cfg)
    own = client_split(cfg, 0, cfg.federation.num_clients)  # client 0's digits, as it trains
    x, y = own.x[:REAL], own.y[:REAL]
    params = sum(p.numel() for p in model.parameters())
    can = GradientCanaries.make(canaries, params, CLIP, seed)
    included = canary_inclusion(canaries, seed + 1)
    x, y, ids = with_canary_rows(x, y, included)
    batch = len(y) if q == 1 else int(round(len(y) * q))
    steps_per_round = int(np.ceil(len(y) / batch))
    sigma = calibrate_noise(target, DELTA, 1 / steps_per_round, rounds * steps_per_round)
    total = np.zeros(canaries)
    for r in range(rounds):
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        private = make_private(model, sgd(model, 0.1), make_loader(x, y, batch, seed + r, ids),
                               noise_multiplier=sigma, max_grad_norm=CLIP, seed=seed + r)
        train_epochs(private.model, private.loader, private.optimizer, 1, torch.device("cpu"),
                     criterion=private.criterion, canaries=can.inject)
        state = private.module().state_dict()
        model, _ = model_for(cfg)  # a fresh module: Opacus' hooks stay on the old one
        model.load_state_dict(state)
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        total += can.scores(after - before)  # the server's view: one update per round
    q_run = 1 / steps_per_round
    claimed = epsilon([(sigma, q_run, rounds * steps_per_round)], DELTA)
    bounds = audit_all(total, included, DELTA, 0.95, 0.2)
    view = CanaryView(sigma, q_run, rounds * steps_per_round)  # the summed scores' view
    releases = view_epsilon(sigma, q_run, steps_per_round, DELTA, rounds=rounds)
    return {"target": target, "q": q_run, "sigma": sigma, "rounds": rounds,
            "canaries": canaries, "epsilon-claimed": claimed,
            "epsilon-view-releases": releases, **bounds.record(),
            **claim_check(bounds, claimed, gaussian_claim=steps_per_round == 1, view=view)}


def client_level(target: float, halved: bool, canary_clients: int, seed: int) -> dict:
    """One DP-FedAvg run with canary clients (3 rounds, every client every round)."""
    z = central_noise_for(target, 3)
    return simulate_dpfedavg_audit(z, z / 2 if halved else None, canary_clients=canary_clients,
                                   held_out=canary_clients, rounds=3, seed=seed)


def _rounded(out: dict) -> dict:
    def r(v: object) -> object:
        if isinstance(v, float):
            return float(f"{v:.4g}")
        if isinstance(v, dict):
            return {k: r(x) for k, x in v.items()}
        return v
    return {k: r(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-level", action="store_true",
                        help="the DP-FedAvg canary-client audit instead")
    parser.add_argument("--canary-clients", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.client_level:
        for target in (8.0, 2.0):
            for halved in (False, True):
                start = time.perf_counter()
                out = client_level(target, halved, args.canary_clients, args.seed)
                out["seconds"] = time.perf_counter() - start
                print(json.dumps(_rounded({"target": target, "halved": halved, **out})),
                      flush=True)
        return
    for q in (1.0, 0.1):
        for target in (8.0, 2.0):
            start = time.perf_counter()
            out = audit_once(target, q, args.canaries, args.rounds, args.seed)
            best = max(out[k] for k in EPSILON_KEYS if k != "epsilon-estimate-oneshot")
            out["best-bound-over-claim"] = best / out["epsilon-claimed"]
            out["best-bound-over-view"] = best / out["epsilon-view"]
            out["seconds"] = time.perf_counter() - start
            print(json.dumps(_rounded(out)), flush=True)


if __name__ == "__main__":
    main()
