"""The federation as a run sees it: a view of Flower's Grid over the run's own nodes.

Every runner (plain, SecAgg+, the CVAE phase) talks to the clients through a
:class:`FederationGrid`, which

* lists only the run's nodes, **ordered by partition id**, so Flower's sampling (seeded
  per round, :mod:`tasks.seeding`) picks the same partitions whatever ids the runtime
  gave the nodes;
* in simulation, **tells each node which partition it serves**: simulated nodes are
  interchangeable workers that can all read every partition, so the server pairs the
  run's N nodes (sorted by id) with partitions 0..N-1 for the whole run instead of
  asking every node which one it holds (one message per node: 25 s for 1,000 nodes).
  The pairing travels in every message (``fedpriv.node``), and
  :func:`clients.app.assignment_mod` makes it the node's ``node_config`` for that message;
  with it, the folder where each client keeps its state for a resume
  (``state-dir``, :mod:`clients.state_store`);
* in a sweep run inside one simulation, **tells each node which cell** the message
  belongs to (``fedpriv.cell``: the cell's index and the run-config keys in which it
  differs from the simulation's own), so warm clients serve every cell in turn.

On real SuperNodes the node's own ``node_config`` is the truth (its data are its own):
the view only orders and filters, and adds nothing to the messages.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from tasks.messages import CELL_RECORD, NODE_RECORD, STATE_DIR


def is_flower_grid(grid: Grid, kind: str) -> bool:
    """Whether ``grid`` is Flower's ``InMemoryGrid`` (``kind="inmemory"``, the simulation)
    or ``HttpGrid`` (``"http"``, a real SuperLink), asked without importing them: a
    process that never loaded one has none, and each import costs 0.4-0.8 s (Flower's
    link state and SQL store) in a runtime that never uses it."""
    module = sys.modules.get(f"flwr.superlink.grid.{kind}_grid")
    cls = {"inmemory": "InMemoryGrid", "http": "HttpGrid"}[kind]
    return module is not None and isinstance(grid, getattr(module, cls))


class TooFewClients(RuntimeError):
    """Fewer clients than a round needs stayed connected for longer than round-timeout."""


class FederationGrid(Grid):
    """A Grid restricted to the run's nodes, ordered by partition, stamping each message."""

    def __init__(self, grid: Grid, partition_of: Mapping[int, int], *, assign: bool = False,
                 cell: Mapping[str, Any] | None = None, state_dir: str = "",
                 poll_interval: float = 0.2, min_nodes: int = 0,
                 wait_limit: float | None = None) -> None:
        self._grid = grid.grid if isinstance(grid, FederationGrid) else grid
        self.partition_of = dict(partition_of)
        self.assign = assign
        self.cell = dict(cell) if cell else None
        self.state_dir = state_dir
        self.poll_interval = poll_interval
        self._sent_to: dict[str, int] = {}  # message id -> the node it was sent to
        self._order = sorted(self.partition_of, key=lambda n: (self.partition_of[n], n))
        self.min_nodes = min_nodes
        self.wait_limit = wait_limit
        self._short_since: float | None = None  # when fewer than min_nodes were connected

    @property
    def grid(self) -> Grid:
        """The runtime's own grid."""
        return self._grid

    def get_node_ids(self) -> Iterable[int]:
        """The run's connected nodes, by partition. Flower's strategies wait (forever) until
        ``min_nodes`` are connected; after ``wait_limit`` s short of them this raises
        :class:`TooFewClients` instead, so a federation that lost its nodes stops with a
        cause (and its checkpoint) rather than hanging."""
        live = set(self._grid.get_node_ids())
        nodes = [n for n in self._order if n in live]
        if len(nodes) >= self.min_nodes or self.wait_limit is None:
            self._short_since = None
            return nodes
        now = time.monotonic()
        self._short_since = self._short_since or now
        if now - self._short_since > self.wait_limit:
            gone = sorted(self.partition_of[n] for n in self._order if n not in live)
            raise TooFewClients(
                f"only {len(nodes)} of the run's {len(self._order)} clients have been connected "
                f"for {self.wait_limit:.0f} s (round-timeout), fewer than the "
                f"{self.min_nodes} a round needs (min-train-clients); not connected: client(s) "
                f"{', '.join(map(str, gone))}. Restart their SuperNodes, then resume the run "
                "from its last checkpointed round (fedpriv deploy run --resume RUN_FOLDER).")
        return nodes

    def node_of(self, reply: Message) -> int:
        """The node a reply is about: its sender, or, for an error the SuperLink answered
        in a node's place (e.g. NODE_UNAVAILABLE after a SuperNode died), the node the
        message went to."""
        src = reply.metadata.src_node_id
        if src in self.partition_of:
            return src
        return self._sent_to.get(reply.metadata.reply_to_message_id, src)

    def stamp(self, msg: Message) -> Message:
        """Add the node's partition (in simulation) and the sweep cell to ``msg``.

        A strategy may give all its messages one shared content object, so each stamped
        message gets a shallow copy of its own (the arrays themselves are not copied).
        """
        node = msg.metadata.dst_node_id
        extra: dict[str, ConfigRecord] = {}
        if self.assign and node in self.partition_of:
            extra[NODE_RECORD] = ConfigRecord({"partition-id": self.partition_of[node],
                                               "num-partitions": len(self.partition_of),
                                               **({STATE_DIR: self.state_dir}
                                                  if self.state_dir else {})})
        if self.cell is not None:
            extra[CELL_RECORD] = ConfigRecord(self.cell)
        if extra:
            msg.content = RecordDict({**msg.content, **extra})
        return msg

    # Everything else is the runtime grid's, with each outgoing message stamped.
    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages([self.stamp(m) for m in messages])

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Send, then collect replies until all are in or ``timeout`` passes. The
        simulation's in-memory grid keeps its own loop; on a real SuperLink replies are
        checked every ``poll_interval`` s instead of Flower's fixed 3 s."""
        stamped = [self.stamp(m) for m in messages]
        if not is_flower_grid(self._grid, "http"):  # the simulation's in-memory grid, in-process
            return self._grid.send_and_receive(stamped, timeout=timeout)
        ids = list(self._grid.push_messages(stamped))
        # only the latest batch: its replies are read before the next one is sent
        self._sent_to = {i: m.metadata.dst_node_id for i, m in zip(ids, stamped, strict=True)}
        waiting = set(ids)
        end = time.monotonic() + (timeout or 0.0)
        replies: list[Message] = []
        while waiting:
            got = list(self._grid.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (timeout is not None and time.monotonic() >= end):
                break
            time.sleep(self.poll_interval)
        return replies
