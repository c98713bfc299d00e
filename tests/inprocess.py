"""A federation in one process: the real ClientApp answers the real ServerApp's messages.

Flower's simulation runtime runs each ClientApp in a Ray actor; here every node's
handler runs in the test process with its own persistent ``Context`` (so DP ledgers in
``Context.state`` carry over between rounds). Strategies, round runners, mods and
handlers are fedpriv's and Flower's own; only the transport is skipped. The end-to-end
tests (marked slow) run the same code through the real runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import SimpleNamespace
from unittest import mock

from flwr.app import Context, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.serverapp import Grid

import clients.app as client_app
from tasks.config import RunConfig

NODE_ID_BASE = 1000


class LocalGrid(Grid):
    """A Grid without a runtime behind it: only node ids and send_and_receive, which is all
    the round runners use."""

    def set_run(self, run):
        raise AssertionError("not used")

    @property
    def run(self):
        raise AssertionError("not used")

    def create_message(self, *a, **k):
        raise AssertionError("not used")

    def push_messages(self, messages):
        raise AssertionError("not used")

    def pull_messages(self, message_ids):
        raise AssertionError("not used")


class InProcessGrid(LocalGrid):
    """``num_clients`` nodes, node ``NODE_ID_BASE + i`` holding partition i (plus what
    ``node_config(i)`` adds to its node config, as a SuperNode's host would)."""

    def __init__(self, cfg: RunConfig, num_clients: int | None = None,
                 node_ids: Iterable[int] | None = None, simulated: bool = False,
                 node_config: Callable[[int], dict] | None = None) -> None:
        # simulated: the server pairs nodes with partitions, as in Flower's simulation
        self.assigns_partitions = simulated
        n = num_clients or cfg.federation.num_clients
        ids = list(node_ids) if node_ids is not None else [NODE_ID_BASE + i for i in range(n)]
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, state=RecordDict(), run_config=cfg.flat(),
                         node_config={"partition-id": pid, "num-partitions": n,
                                      **(node_config(pid) if node_config else {})})
            for pid, nid in enumerate(ids)}
        self.sent: list[Message] = []

    @property
    def run(self):
        """What Flower's legacy workflows (SecAgg+) read of the run: its id."""
        return SimpleNamespace(run_id=1)

    @property
    def partition_of(self) -> dict[int, int]:
        return {nid: int(c.node_config["partition-id"]) for nid, c in self.contexts.items()}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> list[Message]:
        replies = []
        # a simulated federation's nodes trust the server's assignment, as Flower's Ray
        # workers do (clients.app.in_simulation); real SuperNodes' do not
        with mock.patch.object(client_app, "in_simulation", return_value=self.assigns_partitions):
            for msg in messages:
                # what the runtime delivers is a copy (it serializes every message): a
                # client that changes its content must not change another client's
                msg.content = recorddict_from_proto(recorddict_to_proto(msg.content))
                self.sent.append(msg)
                replies.append(client_app.app(msg, self.contexts[msg.metadata.dst_node_id]))
        return replies
