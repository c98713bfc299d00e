"""SecAgg+ rounds (Bell et al. 2020): the server learns only the sum of the updates.

SecAgg+ lives in Flower's legacy workflow API (``SecAggPlusWorkflow`` on the server,
``secaggplus_mod`` on the client). :class:`SecAggProtocol` runs one such workflow per
round and hands it a small legacy strategy that

* samples the clients the plain rounds sample (the aggregation's rule over node ids in
  partition order, the round's own stream: :func:`strategies.protocols.cohort`),
* receives from the workflow only the unmasked **weighted average** of the clients'
  updates (every client's update is quantized, masked with pairwise and private masks
  and summed; no individual update is ever visible to the server), plus whatever
  the disclosure policy lets clients send in the clear (:mod:`privacy.dp.disclosure`:
  their partition id, and with local DP their DP status; nothing data-dependent),
* under central DP (client-side clipping, every weight 1) turns the average back into
  the clipped sum (times the number of clients, which the server knows), which the
  aggregation releases as it does every other sum (:mod:`strategies.central_dp`).

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
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import LegacyContext, ServerConfig
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp.strategy import Strategy

from privacy.dp import distributed
from privacy.dp.disclosure import declined
from tasks.config import RunConfig, SecAggConfig
from tasks.distributed_dp import plan_for

from ..aggregation import Aggregation, Collected
from ..grid import FederationGrid
from ..rounds import RoundLog
from . import cohort, per_round


def quantization_slack(s: SecAggConfig, num_parameters: int) -> float:
    """The most SecAgg+'s stochastic rounding can lengthen one update (L2)."""
    return math.sqrt(num_parameters) * 2 * s.clipping_range / s.quantization_range


def max_weight(cfg: RunConfig, sizes: list[int], num_clients: int, train_size: int) -> float:
    """SecAgg+'s bound on one client's weight: 1 under central DP (equal weights); else
    ``secagg-max-weight``, or the largest client when sizes are disclosed (local DP),
    or the training set's size, which bounds every client without asking any."""
    if cfg.privacy.dp in ("central", "distributed"):
        return 1.0
    if cfg.secagg.max_weight:
        return float(cfg.secagg.max_weight)
    return float(max(sizes)) if sizes and len(sizes) == num_clients else float(train_size)


class SecAggProtocol:
    """One SecAgg+ workflow per round, over the nodes found by client discovery."""

    individual_updates = False

    def __init__(self, cfg: RunConfig, grid: FederationGrid, context: Context,
                 partition_of: Mapping[int, int], max_weight: float) -> None:
        s = cfg.secagg
        self.grid = grid
        self.seed = cfg.training.seed
        self.partition_of = dict(partition_of)
        # the clients send weight 1
        self.equal_weights = cfg.privacy.dp in ("central", "distributed")
        self.cfg = cfg
        self.per_round = per_round(cfg, len(self.partition_of))
        self.max_weight = max_weight
        clipping, levels = s.clipping_range, s.quantization_range
        if cfg.privacy.dp == "distributed":
            # the clients send integers in [-2^(b-1), 2^(b-1)): with these settings
            # Flower's quantization maps them to v + 2^(b-1) exactly (no clipping, no
            # rounding), so the unmasked sum is the clients' modular sum
            bits = cfg.privacy.distributed_bits
            clipping, levels, self.max_weight = float(2 ** (bits - 1)), 2 ** bits, 1.0
        self.settings = {"num-shares": s.num_shares,
                         "reconstruction-threshold": s.reconstruction_threshold,
                         "clipping-range": clipping, "quantization-range": levels}
        self.workflow = SecAggPlusWorkflow(
            num_shares=s.num_shares, reconstruction_threshold=s.reconstruction_threshold,
            max_weight=self.max_weight, clipping_range=clipping, quantization_range=levels,
            timeout=cfg.federation.round_timeout)
        self._shapes: list[tuple[int, ...]] = []
        self.legacy = LegacyContext(context, config=ServerConfig(
            num_rounds=cfg.federation.num_server_rounds), strategy=SecureFedAvg(self))
        self._round: tuple[int, dict[str, Any], Aggregation, RoundLog] | None = None
        self._got: Collected | None = None

    @classmethod
    def for_run(cls, cfg: RunConfig, grid: FederationGrid, partition_of: Mapping[int, int],
                *, evaluation: Strategy | None = None, context: Context | None = None,
                max_weight: float = 0.0, num_parameters: int = 0) -> SecAggProtocol:
        if context is None:
            raise ValueError("SecAgg+ rounds need the ServerApp's Context")
        return cls(cfg, grid, context, partition_of, max_weight)

    @staticmethod
    def slack(cfg: RunConfig, num_parameters: int) -> float:
        return quantization_slack(cfg.secagg, num_parameters)

    def describe(self) -> dict[str, Any]:
        return {"protocol": "SecAgg+", "individual-updates-visible": False, **self.settings,
                "max-weight": self.max_weight}

    def collect(self, server_round: int, arrays: ArrayRecord, config: dict[str, Any],
                aggregation: Aggregation, log: RoundLog) -> Collected | None:
        """Train and securely aggregate one round: the server gets the unmasked average."""
        self._round = (server_round, config, aggregation, log)
        self._got = None
        self._shapes = [tuple(a.shape) for a in arrays.to_numpy_ndarrays()]
        self.legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
            ndarrays_to_parameters(arrays.to_numpy_ndarrays()), keep_input=True)
        self.legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {Key.CURRENT_ROUND: server_round, Key.START_TIME: time.time()})
        errors: list[dict[str, Any]] = []
        self.workflow(_ErrorsNoted(self.grid, self.partition_of, errors), self.legacy)
        known = {(f.get("partition-id"), f.get("error")) for f in log.failures}
        log.failures += [e for e in errors if (e["partition-id"], e["error"]) not in known]
        if self._got is None and log.refused is None:
            refusals = sorted({e["partition-id"] for e in errors
                               if "ContributionRefused" in e["error"]})
            log.refused = (
                "no sum was unmasked: " + (f"client(s) {refusals} refused to answer this "
                                           "model for this cohort (their contribution "
                                           "records), and " if refusals else "")
                + "too few clients took part for SecAgg+'s threshold")
        log.check_not_all_failed()
        return self._got

    def evaluate(self, server_round: int, arrays: ArrayRecord, log: RoundLog) -> None:
        return None  # the clients' own evaluation would send per-client numbers in the clear

    def configure(self, server_round: int) -> tuple[list[int], dict[str, Any]]:
        """The round's cohort and its training config (for the legacy strategy)."""
        assert self._round is not None
        _, config, aggregation, log = self._round
        node_ids = cohort(aggregation, self.partition_of, self.seed, server_round,
                          self.per_round)
        log.sampled = sorted(self.partition_of[n] for n in node_ids)
        return node_ids, config

    def aggregated(self, average: list[np.ndarray], clients: list[dict[str, Any]],
                   failures: list[str]) -> None:
        """Called by the legacy strategy with the unmasked average and per-client metrics."""
        assert self._round is not None
        log = self._round[3]
        replied = sorted(clients, key=lambda c: c.get("partition-id", -1))
        # A client out of DP budget, or whose screen refused the weights, replied with
        # weight 0: it is in no sum.
        log.clients = [c for c in replied if not declined(c)]
        log.skipped = [c for c in replied if declined(c)]
        log.failures = [{"partition-id": -1, "error": f} for f in failures]
        if not log.clients:
            return  # nobody trained (the workflow divided by a total weight of 0)
        if self.cfg.privacy.dp == "distributed":
            self._got = Collected(total=self._decoded(average[0], len(clients)),
                                  weight=float(len(clients)), count=len(log.clients))
        elif self.equal_weights:  # the sum is k times the average
            self._got = Collected(total=[a.astype(np.float64) * len(clients) for a in average],
                                  weight=float(len(clients)), count=len(log.clients))
        else:  # the weights stay secret: only the mean is known
            self._got = Collected(total=list(average), weight=1.0, count=len(log.clients))


    def _decoded(self, average: np.ndarray, k: int) -> list[np.ndarray]:
        """The noisy sum of the k clients' clipped updates, in the model's shapes: Flower
        hands back ((sum of v_i + k 2^(b-1)) mod 2^32 - k 2^(b-1)) / k, so k times it is
        the clients' sum mod 2^32, hence mod 2^b (:func:`privacy.dp.distributed.server_sum`)."""
        dim = sum(int(np.prod(s)) for s in self._shapes)
        plan = plan_for(self.cfg, dim)
        total = np.rint(np.asarray(average, dtype=np.float64) * k).astype(np.int64)
        flat = distributed.server_sum(total, plan, distributed.sign_seed(
            self.seed, self._round[0] if self._round else 0))
        out, i = [], 0
        for shape in self._shapes:
            n = int(np.prod(shape))
            out.append(flat[i:i + n].reshape(shape))
            i += n
        return out


class _ErrorsNoted:
    """The grid as SecAgg+'s workflow sees it, noting every error reply (a client that
    refused a stage, e.g. by its contribution record) for the round's log."""

    def __init__(self, grid: FederationGrid, partition_of: Mapping[int, int],
                 errors: list[dict[str, Any]]) -> None:
        self._grid, self._partition_of, self._errors = grid, partition_of, errors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for r in replies:
            if r.has_error():
                self._errors.append({"partition-id": self._partition_of.get(
                    r.metadata.src_node_id, -1), "node-id": r.metadata.src_node_id,
                    "error": r.error.reason.strip().splitlines()[-1][:500]})
        return replies


class SecureFedAvg(LegacyStrategy):
    """The legacy strategy SecAggPlusWorkflow drives: it samples and hands the average on."""

    def __init__(self, protocol: SecAggProtocol) -> None:
        self.protocol = protocol

    def initialize_parameters(self, client_manager: Any) -> Any:
        return None

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any):
        node_ids, config = self.protocol.configure(server_round)
        fit_ins = FitIns(parameters, dict(config))
        grid = self.protocol.grid
        return [(GridClientProxy(nid, grid, grid.run.run_id), fit_ins) for nid in node_ids]

    def aggregate_fit(self, server_round: int, results: list, failures: list):
        if not results:
            return None, {}
        # SecAgg+ has put the same unmasked weighted average into every result.
        average = parameters_to_ndarrays(results[0][1].parameters)
        clients = [dict(res.metrics) for _, res in results]
        self.protocol.aggregated(average, clients, [str(f) for f in failures])
        return None, {}

    def configure_evaluate(self, server_round: int, parameters: Any, client_manager: Any):
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list):
        return None, {}

    def evaluate(self, server_round: int, parameters: Any):
        return None
