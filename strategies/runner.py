"""The one round runner: a transport protocol and a server-side aggregation, composed.

Every round, whatever protocol carries it (:mod:`strategies.protocols`) and whatever
the server does with what arrives (:mod:`strategies.aggregation`):

1. the aggregation starts the round (e.g. DP-FedAvg resets its release flag) and says what
   every client is told besides the model (e.g. the clipping norm);
2. the protocol sends the global model to the cohort the aggregation samples and returns
   what the server may hold of the updates (each one, or only their sum), logging who was
   sampled, who replied, who declined and who failed;
3. the aggregation turns that into the next global model;
4. the protocol evaluates it on the clients' own data, where it can.

Checkpoints keep the aggregation's state (a Flower strategy's optimizer moments,
DP-FedAvg's releases and clipping norm); everything else a round needs (the sample, the
noise) is derived from the seed and the round number.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord

from .aggregation import Aggregation, State
from .central_dp import CentralPrivacy
from .protocols import Protocol
from .replies import metrics_of
from .rounds import Reply, RoundLog, RoundResult


class RoundRunner:
    """Rounds of ``protocol`` and ``aggregation``, one :meth:`run_round` at a time."""

    def __init__(self, protocol: Protocol, aggregation: Aggregation,
                 train_config: Mapping[str, Any]) -> None:
        self.protocol = protocol
        self.aggregation = aggregation
        self.train_config = dict(train_config)

    @property
    def central(self) -> CentralPrivacy | None:
        """Central DP's mechanism and accountant, when the aggregation is DP-FedAvg."""
        return self.aggregation.privacy

    def describe(self) -> dict[str, Any]:
        """What run.json records of how updates were aggregated."""
        return self.protocol.describe()

    def run_round(self, server_round: int, arrays: ArrayRecord) -> RoundResult:
        log = RoundLog(server_round)
        self.aggregation.begin_round(server_round)
        config = {**self.train_config, "server-round": server_round,
                  **self.aggregation.client_config()}
        got = self.protocol.collect(server_round, arrays, config, self.aggregation, log)
        new = None if got is None else self.aggregation.combine(server_round, arrays, got)
        log.train_done = time.perf_counter()
        self.protocol.evaluate(server_round, new or arrays, log)
        pid = self.protocol.partition_of
        replies = [] if got is None else [
            Reply(pid.get(m.metadata.src_node_id, -1), m.content.array_records.get("arrays"),
                  metrics_of(m)) for m in got.replies]
        return RoundResult(new, log, arrays, replies, got)

    def state(self) -> State:
        """What the next round needs besides the global model (for checkpoints)."""
        return self.aggregation.state()

    def restore(self, state: State) -> None:
        self.aggregation.restore(state)
