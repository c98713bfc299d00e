"""A run's distributed-DP plan (:class:`privacy.dp.distributed.DistributedPlan`) from its
configuration: every client and the server compute the same one."""

from __future__ import annotations

from privacy.dp.accounting import clients_per_round
from privacy.dp.distributed import DistributedPlan

from .config import RunConfig


def plan_for(cfg: RunConfig, dim: int) -> DistributedPlan:
    """The plan of a ``dp = "distributed"`` run for a model of ``dim`` parameters, sized by
    the configured clients a round (public, fixed before the data)."""
    p, fed = cfg.privacy, cfg.federation
    cohort = clients_per_round(fed.num_clients, fed.fraction_train, fed.min_train_clients)
    return DistributedPlan.make(p.clipping_norm, p.noise_multiplier, p.distributed_bits, dim,
                                cohort, p.distributed_colluding)
