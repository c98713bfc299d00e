"""Rounds aggregated with Flower's SecAgg+ (Bell et al. 2020): the server learns only the sum.

SecAgg+ lives in Flower's legacy workflow API (``SecAggPlusWorkflow`` on the server,
``secaggplus_mod`` on the client). :class:`SecureRounds` runs one such workflow per
round and hands it a small legacy strategy that

* samples the same clients, in the same way, as :class:`strategies.Observed` does for
  plain rounds (partition order, Python's ``random`` seeded per round),
* receives from the workflow only the unmasked **weighted average** of the clients'
  updates (every client's update is quantized, masked with pairwise and private masks
  and summed; no individual update is ever visible to the server), plus whatever
  the disclosure policy lets clients send in the clear (:mod:`privacy.disclosure`:
  their partition id, and with local DP their DP status; nothing data-dependent),
* for central DP (client-side clipping) turns the average back into the clipped sum
  (times the number of clients, which the server knows) and releases it through the
  same DP-FedAvg mechanism as the plain path (:mod:`privacy.dpfedavg`).

It produces the same :class:`strategies.observed.RoundLog` as ``Observed`` so the
server's ledger is written by one piece of code.

Quantization: SecAgg+ clips each coordinate of an update to [-r, r] (r =
``secagg-clipping-range``), which never lengthens it, and rounds it stochastically to a
grid of step 2r / L (L = ``secagg-quantization-range``), which can lengthen it by up to
sqrt(D) 2r / L for D parameters. Central DP accounts that slack as extra sensitivity.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid

from privacy.accounting import clients_per_round
from privacy.dpfedavg import CLIP_KEY

from .central_dp import CentralPrivacy, central_params
from .observed import RoundLog, sample_cohort, sampling_seed


def quantization_slack(cfg: Mapping[str, Any], num_parameters: int) -> float:
    """The most SecAgg+'s stochastic rounding can lengthen one update (L2)."""
    step = 2 * float(cfg["secagg-clipping-range"]) / int(cfg["secagg-quantization-range"])
    return math.sqrt(num_parameters) * step


def secure_central(cfg: Mapping[str, Any], num_clients: int,
                   num_parameters: int) -> CentralPrivacy:
    """Central DP over SecAgg+ rounds: DP-FedAvg with quantization's slack accounted."""
    return CentralPrivacy(central_params(cfg, num_clients,
                                         quantization_slack(cfg, num_parameters)),
                          str(cfg["central-clipping"]), int(cfg["seed"]))


class SecureRounds:
    """One SecAgg+ round at a time, over the nodes found by client discovery."""

    def __init__(self, cfg: Mapping[str, Any], grid: Grid, context: Context,
                 partition_of: Mapping[int, int], max_weight: float,
                 central: CentralPrivacy | None = None) -> None:
        from flwr.server import LegacyContext, ServerConfig
        from flwr.server.workflow import SecAggPlusWorkflow

        self.cfg = cfg
        self.grid = grid
        self.seed = int(cfg["seed"])
        self.partition_of = dict(partition_of)
        self.central = central
        n = len(self.partition_of)
        self.per_round = clients_per_round(n, float(cfg["fraction-train"]),
                                           int(cfg["min-train-clients"]))
        self.workflow = SecAggPlusWorkflow(
            num_shares=int(cfg["secagg-num-shares"]),
            reconstruction_threshold=int(cfg["secagg-reconstruction-threshold"]),
            max_weight=max_weight, clipping_range=float(cfg["secagg-clipping-range"]),
            quantization_range=int(cfg["secagg-quantization-range"]),
            timeout=float(cfg["round-timeout"]))
        self.legacy = LegacyContext(context, config=ServerConfig(
            num_rounds=int(cfg["num-server-rounds"])), strategy=_SecureFedAvg(self))
        self.current: RoundLog | None = None
        self._global: list[np.ndarray] = []
        self._result: list[np.ndarray] | None = None

    def sample(self, server_round: int) -> list[int]:
        """Node ids of this round's clients: Observed's rule, so both paths pick the same."""
        ordered = sorted(self.partition_of, key=lambda nid: self.partition_of[nid])
        return sample_cohort(ordered, random.Random(sampling_seed(self.seed, server_round, 0)),
                             self.per_round)

    def run_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord | None:
        """Train, securely aggregate and (for central DP) noise one round; None if it halted."""
        import flwr.compat.common.recorddict_compat as compat
        from flwr.common import ndarrays_to_parameters
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

        if self.central is not None:
            self.central.check(server_round)
        self.current = RoundLog(server_round)
        self._result = None
        keys = list(arrays.keys())
        self._global = arrays.to_numpy_ndarrays()
        self.legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
            ndarrays_to_parameters(arrays.to_numpy_ndarrays()), keep_input=True)
        self.legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {Key.CURRENT_ROUND: server_round, Key.START_TIME: time.time()})
        self.workflow(self.grid, self.legacy)
        self.current.train_done = time.perf_counter()
        if self._result is None:
            return None
        return ArrayRecord({k: Array(np.asarray(v)) for k, v in
                            zip(keys, self._result, strict=True)})

    def fit_config(self, server_round: int) -> dict[str, Any]:
        config: dict[str, Any] = {"server-round": server_round,
                                  "local-epochs": int(self.cfg["local-epochs"])}
        if self.central is not None:
            config[CLIP_KEY] = self.central.clipping_norm
        return config

    def aggregated(self, server_round: int, average: list[np.ndarray],
                   clients: list[dict[str, Any]], failures: list[str]) -> None:
        """Called by the legacy strategy with the unmasked average and per-client metrics."""
        log = self.current
        assert log is not None
        replied = sorted(clients, key=lambda c: c.get("partition-id", -1))
        # A local-DP client out of budget replied with weight 0: it is in no sum.
        log.clients = [c for c in replied if not c.get("dp-skipped")]
        log.skipped = [c for c in replied if c.get("dp-skipped")]
        log.failures = [{"partition-id": -1, "error": f} for f in failures]
        if not log.clients:
            return  # nobody trained (the workflow divided by a total weight of 0)
        if self.central is not None:  # equal weights: the sum is k times the average
            total = [a.astype(np.float64) * len(clients) for a in average]
            self._result = self.central.release(server_round, self._global, total)
        else:
            self._result = [(g + a).astype(g.dtype) for g, a in
                            zip(self._global, average, strict=True)]


def _secure_fedavg_class():
    """The legacy strategy class (built lazily: flwr.server is only needed with SecAgg+)."""
    from flwr.server.strategy import Strategy as LegacyStrategy

    class SecureFedAvg(LegacyStrategy):
        def __init__(self, rounds: SecureRounds) -> None:
            self.rounds = rounds

        def initialize_parameters(self, client_manager: Any) -> Any:
            return None

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any):
            from flwr.common import FitIns
            from flwr.server.compat.grid_client_proxy import GridClientProxy

            rounds = self.rounds
            node_ids = rounds.sample(server_round)
            assert rounds.current is not None
            rounds.current.sampled = sorted(rounds.partition_of[n] for n in node_ids)
            fit_ins = FitIns(parameters, rounds.fit_config(server_round))
            run_id = rounds.grid.run.run_id
            return [(GridClientProxy(nid, rounds.grid, run_id), fit_ins) for nid in node_ids]

        def aggregate_fit(self, server_round: int, results: list, failures: list):
            from flwr.common import parameters_to_ndarrays

            if not results:
                return None, {}
            # SecAgg+ has put the same unmasked weighted average into every result.
            average = parameters_to_ndarrays(results[0][1].parameters)
            clients = [dict(res.metrics) for _, res in results]
            self.rounds.aggregated(server_round, average, clients,
                                   [str(f) for f in failures])
            return None, {}

        def configure_evaluate(self, server_round: int, parameters: Any, client_manager: Any):
            return []

        def aggregate_evaluate(self, server_round: int, results: list, failures: list):
            return None, {}

        def evaluate(self, server_round: int, parameters: Any):
            return None

    return SecureFedAvg


def _SecureFedAvg(rounds: SecureRounds) -> Any:  # noqa: N802 - a class factory
    return _secure_fedavg_class()(rounds)
