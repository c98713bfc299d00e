"""One round at a time: the interface every round runner implements, and the plain runner.

A :class:`RoundRunner` takes the global model and returns the next one with a
:class:`RoundLog` of what the server observed. :class:`PlainRounds` drives any Flower
Message-API strategy (FedAvg, FedProx, FedAdam..., fedpriv's DP-FedAvg) through one
round; :class:`strategies.secure.SecureRounds` runs a SecAgg+ round instead. Both:

* **sample reproducibly**: node ids are handed over ordered by partition id and
  Python's ``random`` is seeded per round (:mod:`tasks.seeding`), so the same seed
  samples the same clients whatever ids the runtime gave the nodes;
* **aggregate in a fixed order**: replies sorted by partition id, so floating-point
  sums do not depend on arrival order;
* **log the round**: who was sampled, what each client sent, which replies were
  errors, and how long training took.

A round in which every sampled client failed raises :class:`RoundFailed` with the
clients' error messages instead of silently keeping the old model. Clients that decline
to train (``dp-skipped``: their privacy budget is spent) are logged and left out of the
aggregate.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from tasks import messages
from tasks.seeding import seed_sampling

from .grid import FederationGrid
from .state import RunnerState, restore_strategy, strategy_state


def short_reason(reason: str) -> str:
    """The innermost 'SomeError: message' line of a client error reported through Ray."""
    found = re.findall(r"^\s*((?:\w+\.)*\w*(?:Error|Exception)\b[^:\n]*: .+)$", reason, re.M)
    return (found[-1] if found else reason.strip().splitlines()[-1][:500]).strip().rstrip("'>")


class RoundFailed(RuntimeError):
    """Every client sampled in a round replied with an error."""


class WorkerLost(RoundFailed):
    """A simulated client's Ray worker died in this round.

    Flower 1.41's actor pool keeps a dead actor and hands it every later job, so the
    federation only shrinks from here. The round is not recorded; fedpriv restarts the
    simulation from the last checkpoint (:func:`experiments.api.resume`), which gives
    every client a live worker and redoes this round as it would have run.
    """


# How Flower reports a job whose Ray actor died (ray.exceptions.RayActorError and its
# subclasses ActorDiedError, ActorUnavailableError).
DEAD_WORKER = re.compile(r"ray\.exceptions\.(RayActorError|ActorDiedError|ActorUnavailableError)")


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
    refused: str | None = None  # why no aggregate was made though clients replied (HE)

    def check_not_all_failed(self, min_replies: int = 1) -> None:
        """Raise :class:`RoundFailed` when failures left fewer than ``min_replies``
        clients (``min-train-clients``) with an answer: the federation can no longer do
        what the run asked of it; :class:`WorkerLost` when a simulated client's worker
        died."""
        dead = [f for f in self.failures if DEAD_WORKER.search(f["error"])]
        if dead:
            raise WorkerLost(f"round {self.round}: the Ray worker serving client "
                             f"{dead[0]['partition-id']} died ({short_reason(dead[0]['error'])})")
        answered = len(self.clients) + len(self.skipped)
        if self.failures and (not self.clients or answered < min_replies):
            reasons = "; ".join(f"client {f['partition-id']}: {short_reason(f['error'])}"
                                for f in self.failures[:3])
            what = (f"all {len(self.failures)} sampled clients failed" if not self.clients
                    else f"only {answered} of {answered + len(self.failures)} sampled "
                    f"clients answered, fewer than min-train-clients = {min_replies}")
            raise RoundFailed(f"round {self.round}: {what}. First errors: {reasons}")


@dataclass(frozen=True)
class Reply:
    """What one client sent back, as the server received it."""

    partition_id: int
    arrays: ArrayRecord | None  # its new weights (None: it declined to train)
    metrics: dict[str, Any]


@dataclass
class RoundResult:
    arrays: ArrayRecord | None  # the new global model; None when the round produced none
    log: RoundLog
    sent: ArrayRecord | None = None  # the global model the clients were sent
    replies: list[Reply] = field(default_factory=list)  # empty: nothing per client (SecAgg+)


class RoundRunner(Protocol):
    def run_round(self, server_round: int, arrays: ArrayRecord) -> RoundResult: ...

    def state(self) -> RunnerState:
        """What the next round needs besides the global model (for checkpoints)."""
        ...

    def restore(self, state: RunnerState) -> None: ...


def metrics_of(msg: Message) -> dict[str, Any]:
    """Every metric a reply carries, merged."""
    out: dict[str, Any] = {}
    for record in msg.content.metric_records.values():
        out.update(record)
    return out


def update_problem(received: ArrayRecord | None, sent: ArrayRecord) -> str | None:
    """Why a client's returned weights cannot be aggregated with the others, or None."""
    if received is None:
        return "no weights in the reply"
    if list(received.keys()) != list(sent.keys()):
        missing = [k for k in sent.keys() if k not in received]
        extra = [k for k in received.keys() if k not in sent]
        return f"weights named differently (missing {missing[:3]}, extra {extra[:3]})"
    for key in sent.keys():
        got, want = received[key], sent[key]
        # the kind of number must match; its width may not (FedAdam's float64 model,
        # the clients' float32 weights)
        if tuple(got.shape) != tuple(want.shape) or \
                np.dtype(got.dtype).kind != np.dtype(want.dtype).kind:
            return (f"{key}: shape {tuple(got.shape)} {got.dtype}, expected "
                    f"{tuple(want.shape)} {want.dtype}")
        values = got.numpy()
        if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            return f"{key} holds NaN or Inf"
    return None


def split_replies(grid: FederationGrid, partition_of: Mapping[int, int],
                  replies: Iterable[Message], sent: ArrayRecord | None = None,
                  check: Callable[[Message], str | None] | None = None,
                  asked: Iterable[int] = (), timeout: float | None = None
                  ) -> tuple[list[Message], list[dict], list[dict]]:
    """(updates to aggregate, clients that declined to train, failures), each in
    partition order. A reply is refused as a failure before anything is aggregated when
    its weights do not match ``sent`` (the global model of a training round: missing or
    extra keys, other shapes, another kind of number, NaN or Inf), or when ``check``
    finds a problem with it; a node in ``asked`` that did not answer within ``timeout``
    is a failure too, so a round nobody answered is never taken for a quiet one."""
    ok, skipped, failures = [], [], []
    replies = list(replies)
    answered = {grid.node_of(m) for m in replies}
    for node in asked:
        if node not in answered:
            failures.append({"partition-id": partition_of.get(node, -1), "node-id": node,
                             "error": f"NoReply: no answer within {timeout:g} s "
                                      "(round-timeout)" if timeout is not None
                             else "NoReply: no answer"})
    for msg in replies:
        node = grid.node_of(msg)
        pid = partition_of.get(node, -1)
        bad = None
        if not msg.has_error() and not metrics_of(msg).get("dp-skipped"):
            if sent is not None:
                bad = update_problem(msg.content.array_records.get("arrays"), sent)
            if bad is None and check is not None:
                bad = check(msg)
        if msg.has_error() or bad:
            failures.append({"partition-id": pid, "node-id": node,
                             "error": msg.error.reason if msg.has_error()
                             else f"UpdateRejected: {bad}"})
        elif metrics_of(msg).get("dp-skipped"):
            skipped.append({"partition-id": pid, **metrics_of(msg)})
        else:
            ok.append(msg)
    ok.sort(key=lambda m: (partition_of.get(m.metadata.src_node_id, -1), m.metadata.src_node_id))
    skipped.sort(key=lambda c: c["partition-id"])
    failures.sort(key=lambda f: f["partition-id"])
    return ok, skipped, failures


class PlainRounds:
    """Rounds of a Flower Message-API strategy, one :meth:`run_round` at a time.

    Training messages are typed ``action`` (:mod:`tasks.messages`) so the ClientApp
    routes them to the right handler.
    """

    def __init__(self, strategy: Strategy, grid: Grid, partition_of: Mapping[int, int],
                 seed: int, timeout: float, train_config: Mapping[str, Any],
                 action: str = messages.FIT, min_replies: int = 1) -> None:
        self.strategy = strategy
        self.grid = grid if isinstance(grid, FederationGrid) else FederationGrid(
            grid, partition_of)
        self.partition_of = dict(partition_of)
        self.seed = seed
        self.timeout = timeout
        self.train_config = dict(train_config)
        self.action = action
        self.min_replies = min_replies

    def _partition(self, node_id: int) -> int:
        return self.partition_of.get(node_id, -1)

    def state(self) -> RunnerState:
        return strategy_state(self.strategy)

    def restore(self, state: RunnerState) -> None:
        restore_strategy(self.strategy, state)

    def _split(self, replies: Iterable[Message], sent: ArrayRecord | None = None,
               asked: Iterable[int] = ()) -> tuple[list[Message], list[dict], list[dict]]:
        return split_replies(self.grid, self.partition_of, replies, sent, asked=asked,
                             timeout=self.timeout)

    def _logged(self, replies: list[Message]) -> list[dict[str, Any]]:
        return [{"partition-id": self._partition(m.metadata.src_node_id), **metrics_of(m)}
                for m in replies]

    def run_round(self, server_round: int, arrays: ArrayRecord) -> RoundResult:
        log = RoundLog(server_round)
        seed_sampling(self.seed, server_round, 0)  # Flower samples with `random`
        out = list(self.strategy.configure_train(server_round, arrays,
                                                 ConfigRecord(dict(self.train_config)),
                                                 self.grid))
        for msg in out:
            msg.metadata.message_type = self.action
        log.sampled = sorted(self._partition(m.metadata.dst_node_id) for m in out)
        ok, log.skipped, log.failures = self._split(
            self.grid.send_and_receive(out, timeout=self.timeout), arrays,
            [m.metadata.dst_node_id for m in out])
        log.clients = self._logged(ok)
        log.check_not_all_failed(self.min_replies)
        new, _ = self.strategy.aggregate_train(server_round, ok)
        log.train_done = time.perf_counter()
        self._evaluate(server_round, new or arrays, log)
        replies = [Reply(self._partition(m.metadata.src_node_id), m.content.array_records.get(
            "arrays"), metrics_of(m)) for m in ok]
        return RoundResult(new, log, arrays, replies)

    def _evaluate(self, server_round: int, arrays: ArrayRecord, log: RoundLog) -> None:
        """Federated evaluation on the clients' own data (when the strategy samples any)."""
        seed_sampling(self.seed, server_round, 1)
        out = list(self.strategy.configure_evaluate(server_round, arrays, ConfigRecord(),
                                                    self.grid))
        if not out:
            return
        ok, _, failures = self._split(self.grid.send_and_receive(out, timeout=self.timeout))
        log.evaluated = self._logged(ok)
        log.failures += [{**f, "phase": "evaluate"} for f in failures]
        self.strategy.aggregate_evaluate(server_round, ok)
