"""Which node serves which partition: assigned in simulation, asked on real SuperNodes.

In Flower's simulation runtime every node can read every partition, so
:func:`assign_partitions` pairs the run's nodes (sorted by id) with partitions 0..N-1
without a message (:class:`strategies.grid.FederationGrid` tells each node its
partition with every message): start-up does not grow with the number of clients.

On real SuperNodes each node holds its own data, so :func:`discover_clients` asks every
connected node which partition it holds (one QUERY message each). The answers map
Flower's random node ids to stable partition ids, which makes sampling reproducible, and
give each client's size and label histogram as the client itself sees them — when the
run's disclosure policy lets the client send them (:mod:`privacy.dp.disclosure`: not
under secure aggregation, and only the size under local DP).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from strategies.grid import is_flower_grid
from tasks import messages

from .console import say


@dataclass(frozen=True)
class ClientInfo:
    node_id: int
    partition_id: int
    num_partitions: int
    num_examples: int | None  # None: not disclosed by the client
    label_counts: list[int] | None
    own_data: bool = False  # the host serves its own data (data-path), not a partition
    keeps_state: bool = False  # the node keeps its state (state-dir) for a resume
    accepts_traps: bool = False  # its operator agreed to a malicious-server study

    def as_json(self) -> dict:
        out: dict = {"partition-id": self.partition_id, "node-id": self.node_id}
        if self.own_data:
            out["own-data"] = True
        if self.num_examples is not None:
            out["num-examples"] = self.num_examples
        if self.label_counts is not None:
            out["label-counts"] = self.label_counts
        return out


class DiscoveryError(RuntimeError):
    """Clients could not be reached or disagreed about the federation."""


def _query(grid: Grid, node_ids: list[int], timeout: float) -> list[ClientInfo]:
    asked = [Message(RecordDict({"config": ConfigRecord({})}),
                     message_type=messages.DESCRIBE, dst_node_id=n) for n in node_ids]
    infos, errors = [], []
    for reply in grid.send_and_receive(asked, timeout=timeout):
        if reply.has_error():
            errors.append(reply.error.reason)
            continue
        m = reply.content["metrics"]
        size = int(m["num-examples"]) if "num-examples" in m else None
        labels = [int(c) for c in m["label-counts"]] if "label-counts" in m else None
        infos.append(ClientInfo(reply.metadata.src_node_id, int(m["partition-id"]),
                                int(m["num-partitions"]), size, labels,
                                bool(m.get("own-data", 0)), bool(m.get("keeps-state", 0)),
                                bool(m.get("accepts-trap-weights", 0))))
    if errors:
        raise DiscoveryError(f"{len(errors)} client(s) failed to load their data. First "
                             f"error: {errors[0]}")
    if len(infos) < len(node_ids):
        raise DiscoveryError(f"only {len(infos)} of {len(node_ids)} clients answered within "
                             f"{timeout:.0f} s (round-timeout).")
    return infos


def runtime_of(grid: Grid) -> str:
    """The runtime behind ``grid``, as run.json names it: ``inprocess`` (fedpriv's),
    ``ray`` (Flower's simulation) or ``deployment`` (a SuperLink with real SuperNodes)."""
    inner = getattr(grid, "grid", grid)  # a FederationGrid's runtime grid
    if getattr(inner, "RUNTIME", ""):
        return str(inner.RUNTIME)
    return "ray" if is_flower_grid(inner, "inmemory") else "deployment"


def simulated(grid: Grid) -> bool:
    """True for the simulation runtime's grid (interchangeable nodes on one machine)."""
    return is_flower_grid(grid, "inmemory") or bool(getattr(grid, "assigns_partitions", False))


def assign_partitions(grid: Grid, num_clients: int, timeout: float) -> list[ClientInfo]:
    """Pair the first ``num_clients`` nodes (by id) with partitions 0..num_clients-1.

    The simulation registers its nodes while the ServerApp starts: this waits until
    ``num_clients`` nodes are there, or until their number has stopped growing. A
    federation with more nodes leaves the extra ones idle (a sweep's smaller cells run on
    its largest federation); one with fewer (``flwr run`` with a smaller
    ``num-supernodes``) runs on the nodes it has, with a note.
    """
    deadline = time.monotonic() + timeout
    seen, since = -1, time.monotonic()
    while True:
        ids = sorted(grid.get_node_ids())
        if len(ids) >= num_clients:
            break
        if len(ids) != seen:
            seen, since = len(ids), time.monotonic()
        elif ids and time.monotonic() - since > 1.0:
            say(f"note: the simulation has {len(ids)} nodes but num-clients = {num_clients}; "
                f"using {len(ids)} clients. With `flwr run`, pass --federation-config "
                f"\"num-supernodes={num_clients}\".")
            break
        if time.monotonic() > deadline:
            raise DiscoveryError(f"the simulation registered no nodes within {timeout:.0f} s "
                                 "(round-timeout).")
        time.sleep(0.05)
    n = min(num_clients, len(ids))
    return [ClientInfo(node, i, n, None, None) for i, node in enumerate(ids[:n])]


def discover_clients(grid: Grid, timeout: float) -> list[ClientInfo]:
    """Query nodes until every partition of the federation has answered; sorted by partition."""
    deadline = time.monotonic() + timeout
    known: dict[int, ClientInfo] = {}
    expected: int | None = None
    last_note = 0.0
    while True:
        new = [n for n in grid.get_node_ids() if n not in known]
        if new:
            for info in _query(grid, new, max(deadline - time.monotonic(), 1.0)):
                known[info.node_id] = info
            sizes = {i.num_partitions for i in known.values()}
            if len(sizes) > 1:
                raise DiscoveryError(f"clients disagree on num-partitions: {sorted(sizes)}. "
                                     "Start every SuperNode with the same num-partitions.")
            expected = sizes.pop()
        if expected is not None and len(known) >= expected:
            break
        if time.monotonic() > deadline:
            raise DiscoveryError(f"{len(known)} of {expected or '?'} clients connected after "
                                 f"{timeout:.0f} s (round-timeout).")
        if time.monotonic() - last_note > 10:
            say(f"waiting for clients: {len(known)} of {expected or '?'} connected")
            last_note = time.monotonic()
        time.sleep(0.5)
    infos = sorted(known.values(), key=lambda i: i.partition_id)
    pids = [i.partition_id for i in infos]
    if len(set(pids)) != len(pids):
        raise DiscoveryError(f"two nodes claim the same partition id: {pids}.")
    return infos
