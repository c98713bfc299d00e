"""How the cohort's updates travel to the server, one module per protocol.

A protocol runs the exchange of one round — send the global model to the cohort, collect
what comes back — and hands the server what it may hold (:class:`~strategies.aggregation.
Collected`): every reply (``plain``), or only their sum (``secagg+``: Flower's SecAgg+;
``he``: CKKS homomorphic encryption). Adding one is a new module with a class following
:class:`Protocol` and one line registering it in :data:`PROTOCOLS` (keyed by the
run-config value of ``secure-aggregation``, whose allowed values and cross-checks the
schema keeps: a protocol changes what the other keys may be).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import Protocol as Interface

from flwr.app import ArrayRecord

from privacy.dp.accounting import clients_per_round
from privacy.registry import Registry
from tasks.config import ConfigError, RunConfig
from tasks.seeding import sampling_rng

from ..aggregation import Aggregation, Collected
from ..rounds import RoundLog

PROTOCOLS: Registry = Registry(
    "aggregation protocol", where="strategies.protocols.PROTOCOLS", error=ConfigError,
    signature="a class following strategies.protocols.Protocol, built by its "
              "for_run(cfg, grid, partition_of, *, evaluation, context, max_weight, "
              "num_parameters)")
PROTOCOLS.register("off", "strategies.protocols.plain:PlainProtocol")
PROTOCOLS.register("secagg+", "strategies.protocols.secagg:SecAggProtocol")
PROTOCOLS.register("he", "strategies.protocols.he:HEProtocol")


class Protocol(Interface):
    """One round's exchange; ``individual_updates``: whether the server sees each update."""

    individual_updates: bool
    partition_of: dict[int, int]  # node id -> partition id, for the run's nodes

    @staticmethod
    def slack(cfg: RunConfig, num_parameters: int) -> float:
        """How much the protocol can lengthen one update (L2): central DP accounts it as
        extra sensitivity."""
        ...

    def collect(self, server_round: int, arrays: ArrayRecord, config: dict[str, Any],
                aggregation: Aggregation, log: RoundLog) -> Collected | None:
        """Send ``arrays`` with ``config`` to the round's cohort; fill ``log``; return what
        the server holds of the updates (None: nothing to aggregate this round)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What run.json records of the protocol (its ``aggregation`` entry)."""
        ...

    def evaluate(self, server_round: int, arrays: ArrayRecord, log: RoundLog) -> None:
        """Federated evaluation on the clients' own data, where the protocol has it."""
        ...


def per_round(cfg: RunConfig, num_clients: int) -> int:
    """How many clients a secure round samples: the plain rounds' rule (Flower's)."""
    return clients_per_round(num_clients, cfg.federation.fraction_train,
                             cfg.federation.min_train_clients)


def cohort(aggregation: Aggregation, partition_of: Mapping[int, int], seed: int,
           server_round: int, size: int) -> list[int]:
    """Node ids of a round's clients, sampled by the aggregation from the nodes in partition
    order with the round's own stream (:mod:`tasks.seeding`), so every protocol picks the
    clients the plain rounds pick."""
    ordered = sorted(partition_of, key=lambda nid: partition_of[nid])
    return aggregation.sample(ordered, sampling_rng(seed, server_round), size, partition_of)
