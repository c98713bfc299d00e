"""Flower's message-API strategies by name, configured from a run config."""

from __future__ import annotations

from collections.abc import Mapping
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

WEIGHT_KEY = "num-examples"
# Client metrics that are meaningful as an example-weighted mean; everything else a
# client reports (partition id, timings, epsilon...) is kept per client by the server.
AVERAGED_METRICS = ("train-loss", "train-accuracy", "eval-loss", "eval-accuracy")


def weighted_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """Example-weighted mean of the loss/accuracy metrics in client replies.

    Always weighted by ``num-examples``, whatever key weights the model average: under
    central DP the models are averaged with equal weights, the metrics still per example.
    """
    totals: dict[str, float] = {}
    weight_sum = 0.0
    for record in records:
        metrics = next(iter(record.metric_records.values()))
        w = float(metrics[WEIGHT_KEY])
        weight_sum += w
        for key in AVERAGED_METRICS:
            if key in metrics:
                totals[key] = totals.get(key, 0.0) + w * float(metrics[key])
    return MetricRecord({k: v / weight_sum for k, v in totals.items()} if weight_sum else {})


def build_strategy(cfg: Mapping[str, Any], num_clients: int) -> Strategy:
    """Instantiate the strategy named by ``cfg['strategy']`` for ``num_clients`` clients.

    With ``dp = "central"`` training rounds are DP-FedAvg with a client-level accountant
    (:class:`strategies.central_dp.CentralDP`); a plain FedAvg serves client evaluation.
    """
    name = cfg["strategy"]
    if cfg["dp"] == "central":
        from .central_dp import CentralDP

        return CentralDP(build_strategy({**cfg, "dp": "none"}, num_clients), cfg, num_clients)
    fraction_evaluate = float(cfg["fraction-evaluate"])
    common: dict[str, Any] = {
        "fraction_train": float(cfg["fraction-train"]),
        "fraction_evaluate": fraction_evaluate,
        "min_train_nodes": min(int(cfg["min-train-clients"]), num_clients),
        "min_evaluate_nodes": 1 if fraction_evaluate > 0 else 0,
        "min_available_nodes": num_clients,
        "weighted_by_key": WEIGHT_KEY,
        "train_metrics_aggr_fn": weighted_metrics,
        "evaluate_metrics_aggr_fn": weighted_metrics,
    }
    server_lr = float(cfg["server-lr"])
    if name == "fedavg":
        return FedAvg(**common)
    if name == "fedprox":
        return FedProx(**common, proximal_mu=float(cfg["proximal-mu"]))
    if name == "fedadam":
        extra = {"eta": server_lr} if server_lr > 0 else {}
        return FedAdam(**common, eta_l=float(cfg["lr"]), **extra)
    if name == "fedavgm":
        return FedAvgM(**common, server_learning_rate=server_lr if server_lr > 0 else 1.0,
                       server_momentum=float(cfg["server-momentum"]))
    if name == "fedmedian":
        return FedMedian(**common)
    if name == "fedtrimmedavg":
        return FedTrimmedAvg(**common, beta=float(cfg["trim-beta"]))
    raise ValueError(f"unknown strategy {name!r}")
