"""Scoring a membership attack's output: every variant's AUC and TPR at low FPR with
bootstrap intervals, the ROC plot, and — in a DP run — each variant checked against the
curve the run's claim allows (:mod:`.claims`, :mod:`privacy.dp.tradeoff`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from privacy.analysis.membership_metrics import membership_scores
from privacy.attacks.registry import MembershipScores
from privacy.dp.tradeoff import Claim, check_roc
from strategies.central_dp import central_params
from tasks.results.folder import settings_title
from tasks.results.ledger import read_ledger

from .claims import RELEASED, membership_claim
from .plots import roc_plot

# The functions take the observation's .attack.Attacker (typed Any: attack.py imports
# this module).
Attacker = Any

UNSET: Any = object()  # an Attacker's claim before it is first asked for
MEMBERSHIP_KEYS = ("auc", "auc-ci95", "tpr-at-1%fpr", "tpr-at-1%fpr-ci95", "tpr-at-0.1%fpr",
                   "tpr-at-0.1%fpr-ci95")


def score_membership(attacker: Attacker, name: str, result: MembershipScores
                     ) -> dict[str, Any]:
    """Score every variant of a membership attack against who really was a member."""
    k = attacker.members
    curves, checks = {}, {}
    claim = membership_claim_of(attacker)
    for variant, shuffled in result.scores.items():
        s = torch.empty_like(shuffled.cpu())
        s[attacker.order] = shuffled.cpu()  # back to members first, then held-out rows
        m, n = s[:k].double().numpy(), s[k:].double().numpy()
        curves[variant] = membership_scores(m, n, seed=attacker.seed)
        if claim is not None and _covered(attacker, variant):
            checks[variant] = check_roc(m, n, claim)
    head = result.headline
    nonmembers = curves[head]["nonmembers"]
    plot = roc_plot(attacker.run_dir / "plots" / "leakage" / f"{attacker.obs.name}-{name}.png",
                    curves, f"{attacker.obs.name} · {settings_title(attacker.cfg)} · "
                            f"membership inference ({k} members, {nonmembers} held out)",
                    claim)
    roc = curves[head]["roc"]
    keep = np.unique(np.linspace(0, len(roc["fpr"]) - 1, min(200, len(roc["fpr"])))
                     .astype(int))
    out = {"attack-used": head, "members": k, "nonmembers": nonmembers,
           **{key: curves[head][key] for key in MEMBERSHIP_KEYS},
           "roc-curve": {"fpr": [roc["fpr"][i] for i in keep],
                         "tpr": [roc["tpr"][i] for i in keep]},
           "attacks": {n: {k2: v for k2, v in c.items() if k2 != "roc"}
                       for n, c in curves.items()},
           "roc": str(plot.relative_to(attacker.run_dir))}
    if checks:
        violated = [v for v, c in checks.items() if not c["consistent"]]
        out.update({"claim": {key: checks[next(iter(checks))][key] for key in
                              ("epsilon", "delta", "claimed-by", "confidence")},
                    "claim-consistent": not violated, "claim-violated-by": violated,
                    "claim-checks": {v: c["points"] for v, c in checks.items()}})
    return out


def membership_claim_of(attacker: Attacker) -> Claim | None:
    """The DP claim this observation's membership attacks are checked against (computed
    once per observation)."""
    if attacker.claim is UNSET:
        central = None
        if attacker.cfg.privacy.dp == "central":
            releases = sum(1 for r in read_ledger(attacker.run_dir)
                           if r.round <= attacker.obs.round and r.privacy)
            central = (central_params(attacker.cfg, attacker.num_clients, attacker.slack()),
                       releases)
        attacker.claim = membership_claim(attacker.cfg, attacker.obs,
                                          read_ledger(attacker.run_dir), central)
    return attacker.claim


def _covered(attacker: Attacker, variant: str) -> bool:
    """Whether the claim covers what this variant attacked: under central DP only the
    released model is (the server holds each raw update before it adds noise)."""
    return (attacker.cfg.privacy.dp != "central" or attacker.obs.client is None
            or variant in RELEASED)
