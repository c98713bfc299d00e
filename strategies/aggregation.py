"""The server's side of a round: who is sampled, and how what the clients sent becomes the
next global model.

A round runner (:mod:`strategies.runner`) pairs one **aggregation** with one transport
**protocol** (:mod:`strategies.protocols`). The protocol decides what the server holds of
the cohort's updates: every reply (plain) or only their weighted sum (SecAgg+, HE), a
:class:`Collected`. The aggregation turns that into the next model:

* :class:`FlowerAggregation` — a Flower Message-API strategy (FedAvg, FedProx, FedAdam...)
  builds the round's messages and aggregates the replies; over a sum it takes the
  weighted mean (only FedAvg is allowed there: the config checks refuse the others);
* :class:`strategies.central_dp.CentralDPAggregation` — DP-FedAvg: clip each update the
  server sees, noise the sum, divide by a fixed denominator, account.

Each aggregation owns what a checkpoint must keep of it (``state``/``restore``), as
Opacus' accountants own their ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from tasks.seeding import sample_cohort

State = tuple[dict[str, Any], dict[str, np.ndarray]]  # (JSON-able, arrays) for checkpoints
# Flower's strategies keep their optimizer state as attributes: FedAdam (FedOpt) its
# moments, FedAvgM its momentum vector.
MOMENTS = ("m_t", "v_t", "momentum_vector")


@dataclass
class Collected:
    """What the server holds of a round's updates: each reply (``replies``: plain), or only
    the weighted sum ``total`` of the updates and the sum of the weights (SecAgg+, HE;
    ``total / weight`` is the weighted mean, and with equal weights ``total`` is the sum)."""

    replies: list[Message] = field(default_factory=list)
    total: list[np.ndarray] | None = None
    weight: float = 0.0
    count: int = 0

    def held(self, sent: ArrayRecord) -> ArrayRecord:
        """``sent`` plus the mean update the server holds before its aggregation's own
        processing (central DP's clipping and noise): what a malicious server reads."""
        current = sent.to_numpy_ndarrays()
        if self.total is not None:
            mean = [np.asarray(t, dtype=np.float64) / self.weight for t in self.total]
        else:
            news = [r.content["arrays"].to_numpy_ndarrays() for r in self.replies]
            mean = [np.mean([np.asarray(n[i], dtype=np.float64) - c for n in news], axis=0)
                    for i, c in enumerate(current)]
        return with_arrays(sent, [c + m for c, m in zip(current, mean, strict=True)])


class Aggregation(Protocol):
    """The server's rule for a round: its cohort, what clients are told, the next model."""

    privacy: Any  # central DP's mechanism and accountant (CentralPrivacy), or None

    def begin_round(self, server_round: int) -> None: ...

    def client_config(self) -> dict[str, Any]:
        """What every client of the round is told besides the global model (e.g. a clipping
        norm)."""
        ...

    def sample(self, ordered: Sequence[int], rng: Any, size: int,
               partition_of: Mapping[int, int] | None = None) -> list[int]:
        """The cohort, from node ids in partition order (protocols that sample themselves);
        ``partition_of`` maps node ids to partition ids (None: a node's position is its
        partition, every node present)."""
        ...

    def configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                  grid: Grid) -> Iterable[Message]:
        """The round's training messages (the plain protocol: sampling included)."""
        ...

    def combine(self, server_round: int, arrays: ArrayRecord, got: Collected
                ) -> ArrayRecord | None: ...

    def state(self) -> State: ...

    def restore(self, state: State) -> None: ...


def with_arrays(like: ArrayRecord, values: Sequence[np.ndarray]) -> ArrayRecord:
    """``values`` under ``like``'s keys."""
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(like.keys(), values,
                                                                 strict=True)})


class FlowerAggregation:
    """A Flower strategy: it samples and aggregates the replies; over a sum, the mean."""

    privacy = None  # no central DP

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def begin_round(self, server_round: int) -> None:
        return None

    def client_config(self) -> dict[str, Any]:
        return {}

    def sample(self, ordered: Sequence[int], rng: Any, size: int,
               partition_of: Mapping[int, int] | None = None) -> list[int]:
        return sample_cohort(ordered, rng, size)

    def configure(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                  grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def combine(self, server_round: int, arrays: ArrayRecord, got: Collected
                ) -> ArrayRecord | None:
        if got.total is None:
            return self.strategy.aggregate_train(server_round, got.replies)[0]
        current = arrays.to_numpy_ndarrays()
        return with_arrays(arrays, [(g + t / got.weight).astype(g.dtype)
                                    for g, t in zip(current, got.total, strict=True)])

    def state(self) -> State:
        meta: dict[str, Any] = {}
        arrays: dict[str, np.ndarray] = {}
        for name in MOMENTS:
            value = getattr(self.strategy, name, None)
            if value is None:
                continue
            keys = list(value) if isinstance(value, dict) else list(range(len(value)))
            meta[name] = {"dict": isinstance(value, dict), "keys": [str(k) for k in keys]}
            for i, k in enumerate(keys):
                arrays[f"{name}.{i}"] = np.asarray(value[k])
        return meta, arrays

    def restore(self, state: State) -> None:
        meta, arrays = state
        for name in MOMENTS:
            if name not in meta:
                continue
            keys = meta[name]["keys"]
            values = [arrays[f"{name}.{i}"] for i in range(len(keys))]
            setattr(self.strategy, name, dict(zip(keys, values, strict=True))
                    if meta[name]["dict"] else values)
