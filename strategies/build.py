"""A run's round runner from its config: Flower's strategies by name (the targets of
:data:`strategies.registry.STRATEGIES`), the aggregation (a strategy, or DP-FedAvg) and the
protocol (:data:`strategies.protocols.PROTOCOLS`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import Context, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    Strategy,
)

from privacy.dp.dpfedavg import DPFedAvgParams
from tasks.config import FederationConfig, RunConfig
from tasks.seeding import derive_seed

from .aggregation import Aggregation, FlowerAggregation
from .central_dp import CentralDPAggregation, central_privacy
from .grid import FederationGrid
from .protocols import PROTOCOLS
from .registry import STRATEGIES
from .runner import RoundRunner

if TYPE_CHECKING:  # imported by the runs that audit (scipy: half a second)
    from privacy.attacks.canary_clients import CanaryClientAudit

WEIGHT_KEY = "num-examples"


def no_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """What Flower's strategies aggregate of the clients' metrics: nothing. The server keeps
    every client's metrics and averages them itself (:mod:`server.recorder`), also under
    DP-FedAvg and SecAgg+, which aggregate no metrics."""
    return MetricRecord()


def common_args(fed: FederationConfig, num_clients: int) -> dict[str, Any]:
    """The arguments every Flower strategy takes."""
    return {"fraction_train": fed.fraction_train, "fraction_evaluate": fed.fraction_evaluate,
            "min_train_nodes": min(fed.min_train_clients, num_clients),
            "min_evaluate_nodes": 1 if fed.fraction_evaluate > 0 else 0,
            # a round goes on with the nodes still connected (a SuperNode may die; Flower
            # would otherwise wait for it forever, checking once a second)
            "min_available_nodes": min(fed.min_train_clients, num_clients),
            "weighted_by_key": WEIGHT_KEY,
            "train_metrics_aggr_fn": no_metrics,
            "evaluate_metrics_aggr_fn": no_metrics}


def fedavg(fed: FederationConfig, common: dict[str, Any], lr: float) -> Strategy:
    return FedAvg(**common)


def fedprox(fed: FederationConfig, common: dict[str, Any], lr: float) -> Strategy:
    return FedProx(**common, proximal_mu=fed.proximal_mu)


def fedadam(fed: FederationConfig, common: dict[str, Any], lr: float) -> Strategy:
    extra = {"eta": fed.server_lr} if fed.server_lr > 0 else {}
    return FedAdam(**common, eta_l=lr, **extra)


def fedavgm(fed: FederationConfig, common: dict[str, Any], lr: float) -> Strategy:
    return FedAvgM(**common, server_learning_rate=fed.server_lr or 1.0,
                   server_momentum=fed.server_momentum)


def fedmedian(fed: FederationConfig, common: dict[str, Any], lr: float) -> Strategy:
    return FedMedian(**common)


def fedtrimmedavg(fed: FederationConfig, common: dict[str, Any], lr: float) -> Strategy:
    return FedTrimmedAvg(**common, beta=fed.trim_beta)


def build_strategy(cfg: RunConfig, num_clients: int) -> Strategy:
    """The Flower strategy ``cfg`` names, for ``num_clients`` clients."""
    fed = cfg.federation
    return STRATEGIES.load(fed.strategy)(fed, common_args(fed, num_clients), cfg.training.lr)


CANARY_SEED = 0xCA  # the canary clients' directions and sampling: from the run seed


def canary_audit(cfg: RunConfig, params: DPFedAvgParams, num_parameters: int
                 ) -> CanaryClientAudit | None:
    """The canary-client audit of central DP-FedAvg (``canary-clients``; Andrew et al.
    2024): that many canary clients and as many held-out directions in the space of the
    model's ``num_parameters``, sampled as the mechanism ``params`` samples clients."""
    count = cfg.leakage.canary_clients
    if not count:
        return None
    if num_parameters <= 0:
        raise ValueError("canary-clients needs the model's parameter count (num_parameters)")
    # the audit's statistics (scipy, half a second) are imported by the runs that audit
    from privacy.attacks.canary_clients import CanaryClientAudit

    return CanaryClientAudit.for_run(params, count, count, num_parameters,
                                     derive_seed(cfg.training.seed, CANARY_SEED))


def build_runner(cfg: RunConfig, grid: Grid, partition_of: Mapping[int, int], *,
                 num_parameters: int = 0, context: Context | None = None,
                 max_weight: float = 0.0) -> RoundRunner:
    """The round runner ``cfg`` describes: its protocol (``secure-aggregation``) and its
    aggregation — the configured strategy, or with ``dp = "central"`` DP-FedAvg, whose
    sensitivity accounts for what the protocol can add to an update (``num_parameters``:
    the model's size). ``context`` and ``max_weight``: the ServerApp's, for SecAgg+."""
    n = len(partition_of)
    grid = grid if isinstance(grid, FederationGrid) else FederationGrid(grid, partition_of)
    protocol_class = PROTOCOLS.load(cfg.secagg.protocol)
    strategy = build_strategy(cfg, n)  # under central DP it serves client evaluation only
    aggregation: Aggregation = FlowerAggregation(strategy)
    if cfg.privacy.dp == "central":
        # sized by the configured num-clients, public, not by the clients that showed up:
        # a joining client would otherwise change the denominator and the noise, which
        # the release reveals (docs/DP_TESTER.md measures it)
        privacy = central_privacy(cfg, cfg.federation.num_clients,
                                  protocol_class.slack(cfg, num_parameters))
        aggregation = CentralDPAggregation(
            privacy, cfg.privacy.central_clipping.startswith("client"),
            canary_audit(cfg, privacy.params, num_parameters))
    protocol = protocol_class.for_run(cfg, grid, partition_of, evaluation=strategy,
                                      context=context, max_weight=max_weight,
                                      num_parameters=num_parameters)
    return RoundRunner(protocol, aggregation, {"local-epochs": cfg.training.local_epochs})
