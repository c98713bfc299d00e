"""Plain rounds: every client's reply reaches the server as sent (Flower's Message API).

The aggregation builds the round's messages (a Flower strategy samples with Python's
``random``, seeded here per round, from node ids in partition order: :mod:`tasks.seeding`),
so the same seed samples the same clients whatever ids the runtime gave the nodes. Replies
are checked and sorted by partition id (:mod:`strategies.replies`), so floating-point sums
do not depend on arrival order. Training messages are typed ``action``
(:mod:`tasks.messages`) so the ClientApp routes them to the right handler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp.strategy import Strategy

from tasks import messages
from tasks.config import RunConfig
from tasks.seeding import GLOBAL_RNG, seed_sampling

from ..aggregation import Aggregation, Collected
from ..grid import FederationGrid
from ..replies import metrics_of, split_replies
from ..rounds import RoundLog


class PlainProtocol:
    """Send the global model, collect each reply; evaluate on the clients when asked."""

    individual_updates = True

    def __init__(self, grid: FederationGrid, partition_of: Mapping[int, int], seed: int,
                 timeout: float, *, action: str = messages.FIT, min_replies: int = 1,
                 evaluation: Strategy | None = None) -> None:
        self.grid = grid
        self.partition_of = dict(partition_of)
        self.seed = seed
        self.timeout = timeout
        self.action = action
        self.min_replies = min_replies
        self.evaluation = evaluation

    @classmethod
    def for_run(cls, cfg: RunConfig, grid: FederationGrid, partition_of: Mapping[int, int],
                *, evaluation: Strategy | None = None, context: Context | None = None,
                max_weight: float = 0.0, num_parameters: int = 0) -> PlainProtocol:
        fed = cfg.federation
        return cls(grid, partition_of, cfg.training.seed, fed.round_timeout,
                   min_replies=min(fed.min_train_clients, len(partition_of)),
                   evaluation=evaluation)

    @staticmethod
    def slack(cfg: RunConfig, num_parameters: int) -> float:
        return 0.0

    def describe(self) -> dict[str, Any]:
        return {"protocol": "plain", "individual-updates-visible": True}

    def _partition(self, node_id: int) -> int:
        return self.partition_of.get(node_id, -1)

    def _logged(self, replies: list[Message]) -> list[dict[str, Any]]:
        return [{"partition-id": self._partition(m.metadata.src_node_id), **metrics_of(m)}
                for m in replies]

    def collect(self, server_round: int, arrays: ArrayRecord, config: dict[str, Any],
                aggregation: Aggregation, log: RoundLog) -> Collected:
        with GLOBAL_RNG:  # Flower samples with `random`
            seed_sampling(self.seed, server_round, 0)
            out = list(aggregation.configure(server_round, arrays,
                                             ConfigRecord(dict(config)), self.grid))
        for msg in out:
            msg.metadata.message_type = self.action
        log.sampled = sorted(self._partition(m.metadata.dst_node_id) for m in out)
        ok, log.skipped, log.failures = split_replies(
            self.grid, self.partition_of, self.grid.send_and_receive(out, timeout=self.timeout),
            arrays, asked=[m.metadata.dst_node_id for m in out], timeout=self.timeout)
        log.clients = self._logged(ok)
        log.check_not_all_failed(self.min_replies)
        return Collected(replies=ok, count=len(ok))

    def evaluate(self, server_round: int, arrays: ArrayRecord, log: RoundLog) -> None:
        """Federated evaluation on the clients' own data (when the strategy samples any)."""
        if self.evaluation is None:
            return
        with GLOBAL_RNG:
            seed_sampling(self.seed, server_round, 1)
            out = list(self.evaluation.configure_evaluate(server_round, arrays,
                                                          ConfigRecord(), self.grid))
        if not out:
            return
        ok, _, failures = split_replies(self.grid, self.partition_of,
                                        self.grid.send_and_receive(out, timeout=self.timeout),
                                        timeout=self.timeout)
        log.evaluated = self._logged(ok)
        log.failures += [{**f, "phase": "evaluate"} for f in failures]
        self.evaluation.aggregate_evaluate(server_round, ok)
