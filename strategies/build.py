"""Flower's Message-API strategies, configured from a run config (the targets of
strategies.registry.STRATEGIES)."""

from __future__ import annotations

from typing import Any

from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    Strategy,
)

from tasks.config import FederationConfig, RunConfig

from .registry import STRATEGIES

WEIGHT_KEY = "num-examples"
# Client metrics that are meaningful as an example-weighted mean; everything else a
# client reports (partition id, timings, epsilon...) is kept per client by the server.
AVERAGED_METRICS = ("train-loss", "train-accuracy", "eval-loss", "eval-accuracy")


def weighted_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """Example-weighted mean of the loss/accuracy metrics in client replies."""
    totals: dict[str, float] = {}
    weight_sum = 0.0
    for record in records:
        metrics = next(iter(record.metric_records.values()))
        w = float(metrics.get(WEIGHT_KEY, 0))
        weight_sum += w
        for key in AVERAGED_METRICS:
            if key in metrics:
                totals[key] = totals.get(key, 0.0) + w * float(metrics[key])
    return MetricRecord({k: v / weight_sum for k, v in totals.items()} if weight_sum else {})


def common_args(fed: FederationConfig, num_clients: int) -> dict[str, Any]:
    """The arguments every Flower strategy takes."""
    return {"fraction_train": fed.fraction_train, "fraction_evaluate": fed.fraction_evaluate,
            "min_train_nodes": min(fed.min_train_clients, num_clients),
            "min_evaluate_nodes": 1 if fed.fraction_evaluate > 0 else 0,
            # a round goes on with the nodes still connected (a SuperNode may die; Flower
            # would otherwise wait for it forever, checking once a second)
            "min_available_nodes": min(fed.min_train_clients, num_clients),
            "weighted_by_key": WEIGHT_KEY,
            "train_metrics_aggr_fn": weighted_metrics,
            "evaluate_metrics_aggr_fn": weighted_metrics}


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
    """The strategy ``cfg`` names, for ``num_clients`` clients.

    With ``dp = "central"`` training rounds are DP-FedAvg with a client-level accountant
    (:class:`strategies.central_dp.CentralDP`); a plain FedAvg serves client evaluation.
    """
    fed = cfg.federation
    strategy = STRATEGIES.load(fed.strategy)(fed, common_args(fed, num_clients), cfg.training.lr)
    if cfg.privacy.dp == "central":
        from .central_dp import CentralDP  # imports dp-accounting: only central-DP runs

        return CentralDP(strategy, cfg, num_clients)
    return strategy
