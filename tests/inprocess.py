"""A federation in one process for tests: the in-process runtime's grid
(:mod:`experiments.runtime.inprocess`) built from a RunConfig, in this test process.

Every node's handler runs here with its own persistent ``Context`` (so DP ledgers in
``Context.state`` carry over between rounds). Strategies, round runners, mods and
handlers are fedpriv's and Flower's own; only the transport is skipped. The end-to-end
tests (marked slow) run the same code through Flower's simulation runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from unittest import mock

from flwr.app import Message
from flwr.serverapp import Grid

import clients.app as client_app
from experiments.runtime import inprocess
from experiments.runtime.inprocess import NODE_ID_BASE
from tasks.config import RunConfig

__all__ = ["NODE_ID_BASE", "InProcessGrid", "LocalGrid"]


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


class InProcessGrid(inprocess.InProcessGrid):
    """``num_clients`` nodes, node ``NODE_ID_BASE + i`` holding partition i (plus what
    ``node_config(i)`` adds to its node config, as a SuperNode's host would). Not
    ``simulated`` (the default here): each node serves its own node_config's partition,
    as a real SuperNode does."""

    def __init__(self, cfg: RunConfig, num_clients: int | None = None,
                 node_ids: Iterable[int] | None = None, simulated: bool = False,
                 node_config: Callable[[int], dict] | None = None) -> None:
        super().__init__(client_app.app, cfg.flat(),
                         num_clients or cfg.federation.num_clients, node_ids=node_ids,
                         simulated=simulated, node_config=node_config, keep_sent=True)

    def deliver(self, msg: Message) -> Message:
        # a simulated federation's nodes trust the server's assignment, as Flower's Ray
        # workers do (clients.app.in_simulation); real SuperNodes' do not
        with mock.patch.object(client_app, "in_simulation", return_value=self.assigns_partitions):
            return super().deliver(msg)
