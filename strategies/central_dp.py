"""Central (client-level) DP in Flower's Message API: DP-FedAvg with a fixed denominator.

The mechanism and its accounting live in :mod:`privacy.dp.dpfedavg` (McMahan et al. 2018;
adaptive clipping of Andrew et al. 2021); this module makes them the server's aggregation
(:class:`CentralDPAggregation`), the same over every protocol. Flower's own DP wrappers
are not used: they divide the noisy sum by the number of replies, so one client can move
the release by 2C/m whatever the sampling,
and their adaptive clipping moves C the wrong way (they count *clipped* updates where
Andrew et al. count unclipped ones, so C shrinks when too many updates are clipped).

Clipping happens on the server (``server-*``) or on the clients (``client-*``, needed
with secure aggregation). In the plain path the server clips what it receives in
either case, so a client that skipped clipping cannot weaken the guarantee.

Trust model: this protects the released model from its users. The server still sees
every raw update; only local DP-SGD (or local noise) protects a client from the server.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from privacy.dp.accounting import clients_per_round
from privacy.dp.dpfedavg import (
    CLIP_KEY,
    NEIGHBOURS,
    UNCLIPPED_KEY,
    CentralAccountant,
    DPFedAvg,
    DPFedAvgParams,
    calibrate,
    clipped_sum,
)
from tasks.config import RunConfig
from tasks.seeding import sample_cohort

from .aggregation import Collected, State, with_arrays
from .replies import metrics_of

if TYPE_CHECKING:  # imported by the runs that audit (scipy: half a second)
    from privacy.attacks.canary_clients import CanaryClientAudit


def central_params(cfg: RunConfig, num_clients: int,
                   quantization_slack: float = 0.0) -> DPFedAvgParams:
    """The DP-FedAvg mechanism a run config describes, over ``num_clients`` clients;
    ``quantization_slack``: how much the aggregation protocol can lengthen one update
    (SecAgg+'s rounding, CKKS's encoding), accounted as extra sensitivity."""
    p, fed = cfg.privacy, cfg.federation
    poisson = p.client_sampling == "poisson"
    params = DPFedAvgParams(
        noise_multiplier=p.noise_multiplier, clipping_norm=p.clipping_norm,
        population=num_clients, sampling=p.client_sampling, fraction=fed.fraction_train,
        cohort=0 if poisson else clients_per_round(num_clients, fed.fraction_train,
                                                     fed.min_train_clients),
        adaptive=p.central_clipping.endswith("adaptive"), delta=p.delta,
        max_epsilon=p.max_epsilon, secure_rng=p.secure_rng,
        quantization_slack=quantization_slack, accountant=p.accountant,
        mechanism=p.central_mechanism, groups=p.cyclic_groups, bands=p.mf_bands,
        rounds=fed.num_server_rounds)
    if p.target_epsilon:  # the noise for that epsilon over the planned rounds
        return calibrate(params, p.target_epsilon, fed.num_server_rounds)
    return params


def central_privacy(cfg: RunConfig, num_clients: int, slack: float = 0.0) -> CentralPrivacy:
    """DP-FedAvg's mechanism and accountant for a run, ``slack`` accounted (see
    :func:`central_params`)."""
    return CentralPrivacy(central_params(cfg, num_clients, slack),
                          cfg.privacy.central_clipping, cfg.training.seed)


class CentralPrivacy:
    """The mechanism, its accountant and what the ledger records about them."""

    def __init__(self, params: DPFedAvgParams, clipping: str, seed: int) -> None:
        self.params = params
        self.clipping = clipping
        self.mechanism = DPFedAvg(params, seed)
        self.accountant = CentralAccountant(params)
        self.last_round_released = False

    @property
    def clipping_norm(self) -> float:
        return self.mechanism.clipping_norm

    @property
    def epsilon(self) -> float:
        return self.accountant.epsilon

    def stop_reason(self, server_round: int) -> str | None:
        """Why round ``server_round`` must not run (it would exceed max-epsilon), if so."""
        if self.accountant.would_exceed(server_round):
            return (f"round {server_round} would take client-level epsilon from "
                    f"{self.epsilon:.3f} past max-epsilon = {self.params.max_epsilon}")
        return None

    def release(self, server_round: int, current: list[np.ndarray], clipped_total: list,
                unclipped: list[bool] = ()) -> list[np.ndarray]:
        """The new global model: current + (noisy clipped sum) / d; the round is accounted."""
        out = self.mechanism.release(server_round, clipped_total, unclipped)
        self.accountant.record_release(server_round)
        self.last_round_released = True
        return [(c + u).astype(c.dtype) for c, u in zip(current, out.update, strict=True)]

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: rounds released so far and the (adaptive) clipping norm."""
        return {"releases": self.accountant.releases,
                "clipping-norm": self.mechanism.clipping_norm}

    def restore(self, state: dict[str, Any]) -> None:
        self.accountant.releases = int(state["releases"])
        self.mechanism.clipping_norm = float(state["clipping-norm"])
        self.mechanism.resume()

    def describe(self) -> dict[str, Any]:
        """The privacy part of a ledger record."""
        p = self.params
        out = {"mode": "central", "epsilon": self.epsilon, "delta": p.target_delta,
               "noise-multiplier": p.noise_multiplier,
               "update-noise-multiplier": p.update_multiplier, "clipping": self.clipping,
               "clipping-norm": self.clipping_norm, "sampling": p.sampling,
               "denominator": p.denominator, "population": p.population,
               "releases": self.accountant.releases,
               "released-this-round": self.last_round_released,
               "neighbours": NEIGHBOURS, "accounting": p.describe_accounting(),
               "accountant": f"dp-accounting {p.accountant.upper()}"}
        if p.sampling in ("poisson", "cyclic-poisson"):
            out["sampling-rate"] = p.fraction
        elif p.sampling == "fixed":
            out["cohort"] = p.cohort or p.population
        if p.matrix is not None:
            out.update({"mechanism": p.mechanism, "cyclic-groups": p.groups,
                        "bands": p.matrix.bands if p.mechanism == "banded-mf" else None,
                        "blt-buffers": p.matrix.blt_buffers or None})
        return out


class CentralDPAggregation:
    """DP-FedAvg as the server's aggregation: the cohort by the mechanism's sampling rule;
    every update the server sees clipped (again, if the client clipped), the sum noised,
    divided by the fixed denominator and accounted. Under SecAgg+/HE the server sees only
    the sum of the clients' clipped updates, which it noises the same way.

    ``canaries``: the canary-client audit (Andrew et al. 2024, ``canary-clients``): the
    round's canary clients (sampled at the run's rate by the audit) are clients like any
    other: their updates are clipped, summed (added to the secure sum under SecAgg+/HE)
    and noised with the real clients', and each release is counted for the audit."""

    def __init__(self, privacy: CentralPrivacy, client_side: bool,
                 canaries: CanaryClientAudit | None = None) -> None:
        self.privacy = privacy
        self.client_side = client_side
        self.canaries = canaries
        self.round = 1  # the round being sampled (begin_round)

    def begin_round(self, server_round: int) -> None:
        self.privacy.last_round_released = False
        self.round = server_round

    def client_config(self) -> dict[str, Any]:
        return {CLIP_KEY: self.privacy.clipping_norm} if self.client_side else {}

    def sample(self, ordered: Sequence[int], rng: Any, size: int,
               partition_of: Mapping[int, int] | None = None) -> list[int]:
        """The mechanism's cohort; under cyclic sampling the round's group (partition ids
        congruent to round - 1 mod groups, by ``partition_of``, never by position: a
        client missing from the list must not move the others to other groups),
        Poisson-thinned for cyclic-poisson."""
        p = self.privacy.params
        if p.cyclic:
            turn = (self.round - 1) % p.groups
            group = [n for i, n in enumerate(ordered)
                     if (partition_of[n] if partition_of is not None else i) % p.groups == turn]
            rate = p.fraction if p.sampling == "cyclic-poisson" else None
            return sample_cohort(group, rng, 0, rate) if rate is not None else group
        return sample_cohort(ordered, rng, 0 if p.everyone else p.cohort,
                             p.fraction if p.sampling == "poisson" else None)

    def configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                  grid: Grid) -> Iterable[Message]:
        # the round runner has seeded `random` and ordered the node ids by partition
        chosen = self.sample(list(grid.get_node_ids()), random, 0,
                             getattr(grid, "partition_of", None))
        record = RecordDict({"arrays": arrays, "config": config})
        return [Message(record, message_type=MessageType.TRAIN, dst_node_id=n) for n in chosen]

    def combine(self, server_round: int, arrays: ArrayRecord, got: Collected
                ) -> ArrayRecord:
        current = arrays.to_numpy_ndarrays()
        norm = self.privacy.clipping_norm
        if got.total is not None:  # equal weights: the sum of the clients' clipped updates
            total = got.total
            if self.canaries is not None:  # each canary update already has norm C
                extra = self._canaries(server_round, current, norm, summed=True)
                total = [np.asarray(t, dtype=np.float64) + e
                         for t, e in zip(total, extra, strict=True)]
            return self._released(server_round, arrays,
                                  self.privacy.release(server_round, current, total))
        updates = [[np.asarray(new, dtype=np.float64) - old for new, old in
                    zip(r.content["arrays"].to_numpy_ndarrays(), current, strict=True)]
                   for r in got.replies]
        canary = ([] if self.canaries is None else
                  self._canaries(server_round, current, norm, summed=False))
        total, bits = clipped_sum([*updates, *canary], norm, [a.shape for a in current])
        if self.client_side and self.privacy.params.adaptive:
            bits = [bool(metrics_of(r).get(UNCLIPPED_KEY, 0)) for r in got.replies]
        # a canary's norm is C exactly (rounding must not make it count as clipped)
        bits = [*bits[:len(updates)], *[True] * len(canary)]
        return self._released(server_round, arrays,
                              self.privacy.release(server_round, current, total, bits))

    def _canaries(self, server_round: int, current: list[np.ndarray], norm: float,
                  summed: bool) -> Any:
        """The round's canary updates (or their sum) for a model of ``current``'s arrays."""
        assert self.canaries is not None
        size = sum(int(np.size(a)) for a in current)
        if size != self.canaries.clients.directions.dim:
            raise ValueError(f"the canary clients' directions have "
                             f"{self.canaries.clients.directions.dim} entries and the model "
                             f"{size}: canary-clients needs the model's parameter count")
        if summed:
            return self.canaries.round_sum(server_round, current, norm)
        return self.canaries.replies(server_round, current, norm)

    def _released(self, server_round: int, arrays: ArrayRecord, new: list[np.ndarray]
                  ) -> ArrayRecord:
        if self.canaries is not None:
            self.canaries.released(server_round)
        return with_arrays(arrays, new)

    def state(self) -> State:
        meta: dict[str, Any] = {"central": self.privacy.state()}
        saved: dict[str, np.ndarray] = {}
        if self.canaries is not None:  # the audit goes on from the model the run started at
            start = self.canaries.start or []
            meta["canary-clients"] = {**self.canaries.state(), "start-arrays": len(start)}
            saved = {f"canary-start.{i}": a for i, a in enumerate(start)}
        return meta, saved

    def restore(self, state: State) -> None:
        meta, saved = state
        self.privacy.restore(meta["central"])
        audit = meta.get("canary-clients")
        if self.canaries is not None and audit is not None:
            start = [saved[f"canary-start.{i}"] for i in range(int(audit["start-arrays"]))]
            if start:
                self.canaries.restore(audit, start)
            else:
                from privacy.attacks.canary_clients import released_rounds

                self.canaries.released_rounds = released_rounds(audit)
