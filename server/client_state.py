"""On a resume, every client that trained must still hold its state, or nothing resumes.

A client's DP-SGD ledger lives on the client (:mod:`clients.state_store`), keyed by the
run's id. A resume whose client state was deleted, damaged or swapped for another run's
would start that ledger again from zero and under-report epsilon: the server asks every
client what it kept (``query.state``) before the first round and refuses the resume when
a client that had trained reports fewer DP-SGD steps than the checkpoint recorded for it
(more is fine: it trained the round that was lost in the crash, and its ledger replays
that round without paying twice), or when a federated-CVAE client lost its CVAE.

In simulation the clients' state files lie in the run folder (``checkpoint/clients``), so
:func:`saved_state_problems` reads them before anything starts (``fedpriv run --resume``
refuses a missing, unreadable or foreign file with exit code 2, instead of letting each
client fail on it with a traceback); ``query.state`` remains the check for real
SuperNodes, whose state only their hosts can read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from flwr.app import ConfigRecord, Message, RecordDict

from strategies.grid import FederationGrid
from strategies.rounds import short_reason
from tasks import messages
from tasks.config import ConfigError, RunConfig
from tasks.files import safe_name

# The clients' state-file format (clients.state_store, clients.local_dp; the server may not
# import clients: tests/test_fuzz_resume.py checks that these agree with them).
OWNER = "fedpriv.state-owner"  # the record naming the run a state file belongs to
DP_LEDGER = "dp-sgd"  # the record of a client's DP-SGD ledger
STATE_FILE = re.compile(r"partition-(\d+)\.state")


class ResumeError(RuntimeError):
    """The run cannot be resumed as asked without breaking a privacy guarantee."""


class ClientStateRefused(ConfigError, ResumeError):
    """A resume refused before anything starts because its clients' saved state is
    missing, damaged or another run's: bad input (exit code 2) and a :class:`ResumeError`."""


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


def _read_state(path: Path) -> RecordDict:
    """A client's saved state (Flower's RecordDict serialization), as the client reads it."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto

    proto = RecordDictProto()
    proto.ParseFromString(path.read_bytes())
    return recorddict_from_proto(proto)


def state_folder(run_dir: Path, cfg: RunConfig) -> Path:
    """Where a simulated run's clients keep their state files: ``<run>/checkpoint/clients/
    <run id>`` (:func:`clients.state_store.state_file`)."""
    key = cfg.results.run_id or run_dir.name
    return run_dir / "checkpoint" / "clients" / safe_name(key)


def saved_state_problems(run_dir: Path, cfg: RunConfig,
                         recorded_steps: Mapping[int, int]) -> list[str]:
    """What is wrong with a simulated run's saved client state, read from its files before
    any client starts (empty: nothing). Every state file present must be readable and this
    run's; with local DP every client the checkpoint recorded DP-SGD steps for must hold at
    least as many; with the federated CVAE every client must still hold its state."""
    folder = state_folder(run_dir, cfg)
    run_id = cfg.results.run_id or ""
    files = {int(m.group(1)): p for p in (sorted(folder.iterdir()) if folder.is_dir() else [])
             if (m := STATE_FILE.fullmatch(p.name))}
    problems, held = [], {}
    for pid, path in sorted(files.items()):
        try:
            if path.is_dir():
                raise IsADirectoryError("a folder, not a file")
            state = _read_state(path)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, OSError, ...
            problems.append(f"client {pid}'s state file {path} is unreadable "
                            f"({type(exc).__name__}: {exc})")
            continue
        owner = state.config_records.get(OWNER, {}).get("run-id")
        if run_id and owner and owner != run_id:
            problems.append(f"client {pid}'s state file {path} belongs to run {owner}, not "
                            f"this run ({run_id})")
            continue
        held[pid] = state
    cvae = cfg.anonymization.anonymizer == "cvae-federated"
    for pid in range(cfg.federation.num_clients):
        if pid in files and pid not in held:  # already said
            continue
        state, where = held.get(pid), files.get(pid, folder / f"partition-{pid}.state")
        want = int(recorded_steps.get(pid, 0))
        if cfg.privacy.dp == "local" and want > 0:
            ledger = state.config_records.get(DP_LEDGER) if state is not None else None
            try:
                have = sum(int(s) for s in (ledger or {}).get("history-steps", []))
            except (TypeError, ValueError) as exc:
                problems.append(f"client {pid}'s DP-SGD ledger ({where}) is damaged "
                                f"({type(exc).__name__}: {exc})")
                continue
            if have < want:
                problems.append(f"client {pid}'s DP-SGD ledger holds {have} steps, but the "
                                f"checkpoint recorded {want} ({where}"
                                f"{' is missing' if state is None else ''})")
        if cvae and not (state is not None and any(k != OWNER for k in state.keys())):
            problems.append(f"client {pid}'s state file {where} is missing or empty, but "
                            "it must hold the client's federated CVAE")
    return problems
