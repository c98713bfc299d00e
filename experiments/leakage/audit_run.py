"""The whole-run audit: each audited client's canary scores combined over every round
it was observed in, audited by the three estimators (:mod:`privacy.attacks.audit_suite`)
and compared with the client's cumulative epsilon through its last observed round.

**Combining rounds.** A Dirac canary moves its own coordinate each round the client
trains: by the same expected amount (learning rate x C x steps it is sampled in / the
expected batch) in every round, under noise of the same variance, while the rounds'
noises are independent. For two Gaussians of equal variance differing in the mean,
the likelihood ratio of the rounds together is a function of the *sum* of the rounds'
movements: the sum is the sufficient statistic, and the whole run's mu is the
per-round mu times sqrt(rounds) (a round's lr and batch are the run's, so no
weighting is needed). The audited output (the observed updates) is a post-processing
of everything the client released up to its last observed round, so the claim it is
compared with is the cumulative epsilon at that round.

**Confidence.** Every audit of the run (each observation's, plus one whole-run audit per
client observed in two rounds or more) is one test of a Bonferroni family: each is made
at 1 - (1 - audit-confidence) / family, so all of them hold jointly at audit-confidence
(and inside each, the three estimators share it again, see ``audit_suite``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from privacy.attacks.audit_suite import audit_all, claim_check
from privacy.attacks.audit_view import summed
from tasks.config import RunConfig


@dataclass
class AuditedRound:
    """One observation's canary scores and what the accountant claimed at that round."""

    round: int
    scores: np.ndarray
    claimed: dict[str, Any]  # epsilon-claimed, delta, claimed-by, gaussian-claim
    audited: str


def audit_line(cfg: RunConfig, scores: np.ndarray, included: np.ndarray,
               claimed: dict[str, Any], family: int) -> dict[str, Any]:
    """The three bounds for ``scores`` and the claim check, at the family's share of the
    audit's confidence."""
    lk = cfg.leakage
    delta = claimed["delta"] if claimed.get("delta") is not None else 1e-5
    confidence = 1 - (1 - lk.audit_confidence) / family
    bounds = audit_all(scores, included, delta, confidence, lk.audit_guess_fraction)
    return {**bounds.record(), "confidence": lk.audit_confidence,
            "per-observation-confidence": confidence, "observations-audited": family,
            **{k: v for k, v in claimed.items() if k not in ("gaussian-claim", "view")},
            "delta": delta,
            **claim_check(bounds, claimed.get("epsilon-claimed"),
                          bool(claimed.get("gaussian-claim")), claimed.get("view"))}


def family_size(audited_clients: dict[Any, int]) -> int:
    """How many audits the run makes: one per observation, plus one whole-run audit per
    client observed more than once (``audited_clients``: client -> observations)."""
    return max(1, sum(audited_clients.values())
               + sum(1 for n in audited_clients.values() if n > 1))


def _summed_view(seen: list[AuditedRound]) -> Any:
    """The view of the observed rounds' summed scores (None when a round has none)."""
    views = [a.claimed.get("view") for a in seen]
    return summed(views) if all(v is not None for v in views) else None


def whole_run_lines(cfg: RunConfig, name: str, rounds: dict[Any, list[AuditedRound]],
                    included: dict[Any, np.ndarray], family: int) -> list[dict[str, Any]]:
    """One leakage.jsonl line per client audited in two rounds or more (``scope: run``)."""
    lines = []
    for client, seen in rounds.items():
        if len(seen) < 2:
            continue
        seen = sorted(seen, key=lambda a: a.round)
        total = np.sum([a.scores for a in seen], axis=0)
        last = seen[-1]
        lines.append({"round": last.round, "client": client, "attack": name, "scope": "run",
                      "rounds": [a.round for a in seen], "audited": last.audited,
                      **audit_line(cfg, total, included[client],
                                   {**last.claimed, "view": _summed_view(seen)}, family)})
    return lines
