"""A strategy wrapper that makes client sampling reproducible and records each round.

``Observed(inner)`` delegates every decision to ``inner`` (any Flower strategy,
including the DP wrappers) and adds three things:

* **Reproducible sampling.** Flower samples ``random.sample(grid.get_node_ids(), k)``.
  Node ids are random per run, so the wrapper hands the inner strategy a grid view
  whose node ids are ordered by partition id and seeds Python's ``random`` from
  (seed, round, phase) just before sampling: the same seed samples the same clients.
* **Deterministic aggregation order.** Replies are sorted by partition id before
  aggregation, so floating-point sums do not depend on arrival order.
* **A round log.** Which partitions were sampled, what each client reported, which
  replies were errors, and phase timings, for the server's ledger.

A round in which every sampled client failed raises :class:`RoundFailed` with the
clients' error messages instead of silently keeping the old model. Clients that decline
to train (``dp-skipped``: their privacy budget is spent) are recorded and left out of
the aggregate.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.dpfedavg import poisson_sample


def short_reason(reason: str) -> str:
    """The innermost 'SomeError: message' line of a client error reported through Ray."""
    found = re.findall(r"^\s*((?:\w+\.)*\w*(?:Error|Exception)\b[^:\n]*: .+)$", reason, re.M)
    return (found[-1] if found else reason.strip().splitlines()[-1][:500]).strip().rstrip("'>")


def sampling_seed(seed: int, server_round: int, phase: int) -> int:
    """The seed of Python's ``random`` when clients are sampled (phase 0 train, 1 evaluate)."""
    return seed * 1_000_003 + server_round * 2 + phase


def sample_cohort(ordered: Sequence[int], rng: Any, size: int = 0,
                  rate: float | None = None) -> list[int]:
    """The clients of one round, from node ids ordered by partition.

    A fixed-size cohort is ``rng.sample(ordered, size)``, exactly Flower's rule; with a
    ``rate`` each client is taken independently with that probability (Poisson
    sampling, :func:`privacy.dpfedavg.poisson_sample`). ``rng`` is Python's ``random``
    seeded with :func:`sampling_seed` (or a ``random.Random`` of that seed).
    """
    if rate is not None:
        return poisson_sample(ordered, rate, rng)
    return rng.sample(list(ordered), min(size or len(ordered), len(ordered)))


class RoundFailed(RuntimeError):
    """Every client sampled in a round replied with an error."""


class PartitionOrderedGrid(Grid):
    """A view of a Grid whose node ids come out ordered by partition id."""

    def __init__(self, grid: Grid, partition_of: Mapping[int, int]) -> None:
        self._grid = grid
        self._rank = partition_of

    def get_node_ids(self) -> Iterable[int]:
        ids = list(self._grid.get_node_ids())
        return sorted(ids, key=lambda n: (self._rank.get(n, len(self._rank)), n))

    # Everything else is the wrapped grid's.
    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return self._grid.send_and_receive(messages, timeout=timeout)


@dataclass
class RoundLog:
    """What the server observed in one round."""

    round: int
    started: float = field(default_factory=time.perf_counter)
    train_done: float | None = None
    sampled: list[int] = field(default_factory=list)
    clients: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)  # e.g. DP budget exhausted
    evaluated: list[dict[str, Any]] = field(default_factory=list)


def metrics_of(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for record in msg.content.metric_records.values():
        out.update(record)
    return out


class Observed(Strategy):
    """Delegate to ``inner``; sample reproducibly, aggregate in a fixed order, log the round."""

    def __init__(self, inner: Strategy, seed: int, partition_of: Mapping[int, int]) -> None:
        self.inner = inner
        self.seed = seed
        self.partition_of = dict(partition_of)
        self.current: RoundLog | None = None

    def _seed_sampling(self, server_round: int, phase: int) -> None:
        random.seed(sampling_seed(self.seed, server_round, phase))

    def _partition(self, node_id: int) -> int:
        return self.partition_of.get(node_id, -1)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.current = RoundLog(server_round)
        self._seed_sampling(server_round, 0)
        messages = list(self.inner.configure_train(
            server_round, arrays, config, PartitionOrderedGrid(grid, self.partition_of)))
        self.current.sampled = sorted(self._partition(m.metadata.dst_node_id) for m in messages)
        return messages

    def _split_replies(self, replies: Iterable[Message]
                       ) -> tuple[list[Message], list[dict], list[dict]]:
        """(updates to aggregate, clients that declined to train, error replies)."""
        ok, skipped, failures = [], [], []
        for msg in replies:
            pid = self._partition(msg.metadata.src_node_id)
            if msg.has_error():
                failures.append({"partition-id": pid, "node-id": msg.metadata.src_node_id,
                                 "error": msg.error.reason})
            elif metrics_of(msg).get("dp-skipped"):
                skipped.append({"partition-id": pid, **metrics_of(msg)})
            else:
                ok.append(msg)
        ok.sort(key=lambda m: (self._partition(m.metadata.src_node_id), m.metadata.src_node_id))
        skipped.sort(key=lambda c: c["partition-id"])
        return ok, skipped, failures

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        log = self.current if self.current is not None else RoundLog(server_round)
        ok, skipped, failures = self._split_replies(replies)
        log.failures, log.skipped = failures, skipped
        log.clients = [{"partition-id": self._partition(m.metadata.src_node_id),
                        **metrics_of(m)} for m in ok]
        if not ok and failures:
            reasons = "; ".join(f"client {f['partition-id']}: {short_reason(f['error'])}"
                                for f in failures[:3])
            raise RoundFailed(f"round {server_round}: all {len(failures)} sampled clients "
                              f"failed. First errors: {reasons}")
        arrays, metrics = self.inner.aggregate_train(server_round, ok)
        log.train_done = time.perf_counter()
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        self._seed_sampling(server_round, 1)
        return self.inner.configure_evaluate(
            server_round, arrays, config, PartitionOrderedGrid(grid, self.partition_of))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        ok, _, failures = self._split_replies(replies)
        if self.current is not None:
            self.current.evaluated = [{"partition-id": self._partition(m.metadata.src_node_id),
                                       **metrics_of(m)} for m in ok]
            self.current.failures += [{**f, "phase": "evaluate"} for f in failures]
        return self.inner.aggregate_evaluate(server_round, ok)

    def summary(self) -> None:
        self.inner.summary()
