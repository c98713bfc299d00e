"""Attacks on what a server observes of a client's update, in plain PyTorch (no Flower).

They take what an honest-but-curious server holds — the weights it sent, the weights
that came back, the round's training configuration, what the client disclosed
(:class:`.observation.Observation`) — and return reconstructions or scores; the
scoring against the client's real data happens elsewhere
(:mod:`privacy.analysis.leakage_metrics`), with ground truth the attacks never see.

- :mod:`.inversion`: Inverting Gradients (Geiping et al. 2020) and DLG (Zhu et al. 2019)
- :mod:`.labels`: labels from the last layer (iDLG; counts for larger batches)
- :mod:`.membership`: loss-threshold, loss-drop and gradient-alignment membership inference
- :mod:`.audit`: one-run DP auditing with canaries (Steinke et al. 2023); beside it
  :mod:`.audit_fdp`, :mod:`.audit_gdp`, :mod:`.audit_oneshot` (Andrew et al. 2024) and
  :mod:`.audit_suite`, judged against the claim and against the exact epsilon of what
  the auditor sees (:mod:`.audit_view`, Steinke et al. 2025)
- :mod:`.canary_clients`: the client-level audit of central DP-FedAvg with canary
  clients (Andrew et al. 2024)

:mod:`.registry` names them (:data:`ATTACKS`, extensible with plugins) and states the
contract an attack meets; :mod:`.builtin` adapts the attacks above to it.
"""

from .registry import (
    ATTACKS,
    AttackContext,
    AttackInfo,
    AttackSettings,
    AttackSkipped,
    CanaryScores,
    LabelGuess,
    MembershipScores,
)

__all__ = ["ATTACKS", "AttackContext", "AttackInfo", "AttackSettings", "AttackSkipped",
           "CanaryScores", "LabelGuess", "MembershipScores"]
