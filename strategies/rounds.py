"""What one round produced, as the server's loop and ledger see it, whatever ran it.

:class:`RoundLog` is what the server observed (who was sampled, what each client sent,
which replies were errors, how long training took); :class:`RoundResult` adds the new
global model and what the server held of each client. A round in which too many
sampled clients failed raises :class:`RoundFailed` with their error messages instead of
silently keeping the old model; :class:`WorkerLost` when a simulated client's Ray
worker died.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord


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

# What to change when every failed client's update was NaN or Inf: its training diverged
# from the model it was sent.
DIVERGED = (". Training diverged from the global model: lower lr (or local-epochs); under "
            "central DP the global model carries noise of standard deviation "
            "noise-multiplier x clipping-norm / cohort per weight, so a smaller "
            "clipping-norm or a larger cohort keeps it trainable (epsilon does not depend on "
            "the clipping norm)")


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
    tampered: str | None = None  # the malicious server's attack, when it sent trap weights

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
        refusals = sorted(f["partition-id"] for f in self.failures
                          if "ContributionRefused" in f["error"])
        if refusals and len(refusals) == len(self.failures) and answered < min_replies:
            # the clients' contribution records refused this model for this cohort: the
            # round is recorded as refused (the model stays), not a broken federation
            self.refused = self.refused or (
                f"client(s) {refusals} refused to answer this model for this cohort (they "
                "answered it for another: their contribution records); nothing aggregated")
            return
        if self.failures and (not self.clients or answered < min_replies):
            reasons = "; ".join(f"client {f['partition-id']}: {short_reason(f['error'])}"
                                for f in self.failures[:3])
            what = (f"all {len(self.failures)} sampled clients failed" if not self.clients
                    else f"only {answered} of {answered + len(self.failures)} sampled "
                    f"clients answered, fewer than min-train-clients = {min_replies}")
            raise RoundFailed(f"round {self.round}: {what}. First errors: {reasons}"
                              + (DIVERGED if all("NaN or Inf" in f["error"]
                                                 for f in self.failures) else ""))


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
    collected: Any = None  # the protocol's Collected (what the server held), for the observer
