"""Rounds aggregated with Flower's SecAgg+ (Bell et al. 2020): the server learns only the sum.

SecAgg+ lives in Flower's legacy workflow API (``SecAggPlusWorkflow`` on the server,
``secaggplus_mod`` on the client). :class:`SecureRounds` runs one such workflow per
round and hands it a small legacy strategy that

* samples the same clients, in the same way, as :class:`strategies.rounds.PlainRounds`
  does (partition order, Python's ``random`` seeded per round, :mod:`tasks.seeding`),
* receives from the workflow only the unmasked **weighted average** of the clients'
  updates (every client's update is quantized, masked with pairwise and private masks
  and summed; no individual update is ever visible to the server), plus whatever
  the disclosure policy lets clients send in the clear (:mod:`privacy.dp.disclosure`:
  their partition id, and with local DP their DP status; nothing data-dependent),
* for central DP (client-side clipping) turns the average back into the clipped sum
  (times the number of clients, which the server knows) and releases it through the
  same DP-FedAvg mechanism as the plain path (:mod:`privacy.dp.dpfedavg`).

It is a :class:`strategies.rounds.RoundRunner` like ``PlainRounds``, so the server's
loop and ledger do not care which one runs.

Quantization: SecAgg+ clips each coordinate of an update to [-r, r] (r =
``secagg-clipping-range``), which never lengthens it, and rounds it stochastically to a
grid of step 2r / L (L = ``secagg-quantization-range``), which can lengthen it by up to
sqrt(D) 2r / L for D parameters. Central DP accounts that slack as extra sensitivity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import LegacyContext, ServerConfig
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from privacy.dp.accounting import clients_per_round
from privacy.dp.dpfedavg import CLIP_KEY
from tasks.config import RunConfig, SecAggConfig
from tasks.seeding import sample_cohort, sampling_rng

from .central_dp import CentralPrivacy, central_params
from .rounds import RoundLog, RoundResult
from .state import RunnerState


def quantization_slack(s: SecAggConfig, num_parameters: int) -> float:
    """The most SecAgg+'s stochastic rounding can lengthen one update (L2)."""
    return math.sqrt(num_parameters) * 2 * s.clipping_range / s.quantization_range


def secure_central(cfg: RunConfig, num_clients: int, num_parameters: int) -> CentralPrivacy:
    """Central DP over SecAgg+ rounds: DP-FedAvg with quantization's slack accounted."""
    return CentralPrivacy(central_params(cfg, num_clients,
                                         quantization_slack(cfg.secagg, num_parameters)),
                          cfg.privacy.central_clipping, cfg.training.seed)


def cohort(partition_of: Mapping[int, int], seed: int, server_round: int,
           size: int) -> list[int]:
    """Node ids of a secure round's clients: the plain rounds' rule, so all pick the same."""
    ordered = sorted(partition_of, key=lambda nid: partition_of[nid])
    return sample_cohort(ordered, sampling_rng(seed, server_round), size)


class SecureRounds:
    """One SecAgg+ round at a time, over the nodes found by client discovery."""

    def __init__(self, cfg: RunConfig, grid: Grid, context: Context,
                 partition_of: Mapping[int, int], max_weight: float,
                 central: CentralPrivacy | None = None) -> None:
        s = cfg.secagg
        self.cfg = cfg
        self.grid = grid
        self.seed = cfg.training.seed
        self.partition_of = dict(partition_of)
        self.central = central
        self.per_round = clients_per_round(len(self.partition_of), cfg.federation.fraction_train,
                                           cfg.federation.min_train_clients)
        self.workflow = SecAggPlusWorkflow(
            num_shares=s.num_shares, reconstruction_threshold=s.reconstruction_threshold,
            max_weight=max_weight, clipping_range=s.clipping_range,
            quantization_range=s.quantization_range, timeout=cfg.federation.round_timeout)
        self.legacy = LegacyContext(context, config=ServerConfig(
            num_rounds=cfg.federation.num_server_rounds), strategy=SecureFedAvg(self))
        self.current = RoundLog(0)
        self._global: list[np.ndarray] = []
        self._result: list[np.ndarray] | None = None

    def state(self) -> RunnerState:
        return ({"central": self.central.state()} if self.central is not None else {}), {}

    def restore(self, state: RunnerState) -> None:
        if self.central is not None:
            self.central.restore(state[0]["central"])

    def sample(self, server_round: int) -> list[int]:
        return cohort(self.partition_of, self.seed, server_round, self.per_round)

    def run_round(self, server_round: int, arrays: ArrayRecord) -> RoundResult:
        """Train, securely aggregate and (for central DP) noise one round."""
        if self.central is not None:
            self.central.last_round_released = False
        self.current = RoundLog(server_round)
        self._result = None
        keys = list(arrays.keys())
        self._global = arrays.to_numpy_ndarrays()
        self.legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
            ndarrays_to_parameters(self._global), keep_input=True)
        self.legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {Key.CURRENT_ROUND: server_round, Key.START_TIME: time.time()})
        self.workflow(self.grid, self.legacy)
        self.current.train_done = time.perf_counter()
        self.current.check_not_all_failed()
        new = None if self._result is None else ArrayRecord(
            {k: Array(np.asarray(v)) for k, v in zip(keys, self._result, strict=True)})
        return RoundResult(new, self.current, arrays)

    def fit_config(self, server_round: int) -> dict[str, Any]:
        config: dict[str, Any] = {"server-round": server_round,
                                  "local-epochs": self.cfg.training.local_epochs}
        if self.central is not None:
            config[CLIP_KEY] = self.central.clipping_norm
        return config

    def aggregated(self, server_round: int, average: list[np.ndarray],
                   clients: list[dict[str, Any]], failures: list[str]) -> None:
        """Called by the legacy strategy with the unmasked average and per-client metrics."""
        log = self.current
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


class SecureFedAvg(LegacyStrategy):
    """The legacy strategy SecAggPlusWorkflow drives: it samples and hands the average on."""

    def __init__(self, rounds: SecureRounds) -> None:
        self.rounds = rounds

    def initialize_parameters(self, client_manager: Any) -> Any:
        return None

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any):
        rounds = self.rounds
        node_ids = rounds.sample(server_round)
        rounds.current.sampled = sorted(rounds.partition_of[n] for n in node_ids)
        fit_ins = FitIns(parameters, rounds.fit_config(server_round))
        run_id = rounds.grid.run.run_id
        return [(GridClientProxy(nid, rounds.grid, run_id), fit_ins) for nid in node_ids]

    def aggregate_fit(self, server_round: int, results: list, failures: list):
        if not results:
            return None, {}
        # SecAgg+ has put the same unmasked weighted average into every result.
        average = parameters_to_ndarrays(results[0][1].parameters)
        clients = [dict(res.metrics) for _, res in results]
        self.rounds.aggregated(server_round, average, clients, [str(f) for f in failures])
        return None, {}

    def configure_evaluate(self, server_round: int, parameters: Any, client_manager: Any):
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list):
        return None, {}

    def evaluate(self, server_round: int, parameters: Any):
        return None
