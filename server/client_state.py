"""On a resume, every client that trained must still hold its state, or nothing resumes.

A client's DP-SGD ledger lives on the client (:mod:`clients.state_store`), keyed by the
run's id. A resume whose client state was deleted, damaged or swapped for another run's
would start that ledger again from zero and under-report epsilon: the server asks every
client what it kept (``query.state``) before the first round and refuses the resume when
a client that had trained reports fewer DP-SGD steps than the checkpoint recorded for it
(more is fine: it trained the round that was lost in the crash, and its ledger replays
that round without paying twice), or when a federated-CVAE client lost its CVAE.
"""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import ConfigRecord, Message, RecordDict

from strategies.grid import FederationGrid
from strategies.rounds import short_reason
from tasks import messages
from tasks.config import RunConfig

from .checkpoint import ResumeError


def check_client_state(grid: FederationGrid, partition_of: Mapping[int, int], cfg: RunConfig,
                       recorded_steps: Mapping[int, int], where: str) -> None:
    """Raise :class:`ResumeError` (which client, what it reported, what to restore) unless
    every client kept the state the checkpoint says it has. ``where``: where the clients'
    state lives, for the message."""
    out = [Message(RecordDict({"config": ConfigRecord({})}), message_type=messages.STATE_CHECK,
                   dst_node_id=n) for n in partition_of]
    replies = {grid.node_of(m): m
               for m in grid.send_and_receive(out, timeout=cfg.federation.round_timeout)}
    problems = []
    for node, pid in sorted(partition_of.items(), key=lambda kv: kv[1]):
        reply = replies.get(node)
        if reply is None:
            problems.append(f"client {pid} did not answer")
            continue
        if reply.has_error():
            problems.append(f"client {pid}: {short_reason(reply.error.reason)}")
            continue
        got = reply.content["metrics"]
        want = int(recorded_steps.get(pid, 0))
        if cfg.privacy.dp == "local" and int(got.get("dp-steps", 0)) < want:
            problems.append(f"client {pid}'s DP-SGD ledger holds {int(got.get('dp-steps', 0))} "
                            f"steps, but the checkpoint recorded {want}")
        elif cfg.anonymization.anonymizer == "cvae-federated" and not got.get("has-state"):
            problems.append(f"client {pid} no longer holds its CVAE")
    if problems:
        raise ResumeError(
            "refusing to resume: " + "; ".join(problems) + f". The clients' saved state "
            f"({where}) is missing, damaged or another run's, so resuming would restart their "
            "privacy ledgers from zero and under-report epsilon. Restore the state files "
            "(partition-<id>.state) from a backup, or start the run again as a new run.")
