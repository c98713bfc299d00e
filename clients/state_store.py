"""A client's own state on its own disk, so a resumed run goes on from it.

``Context.state`` lives in memory: one run in simulation, one process on a SuperNode.
What must outlive a crash is the client's, not the server's: its DP-SGD ledger (a
server must never be able to reset a client's epsilon) and the federated CVAE's
encoder and decoder. :func:`state_mod` writes the node's state to
``<state-dir>/partition-<id>.state`` whenever a message changed it (atomically, in
Flower's own RecordDict serialization), and a fresh ``Context`` (the resumed run's)
starts from that file. SecAgg+'s per-round protocol state is not kept: a round in
progress is redone from its start.

``state-dir`` is in the node's ``node_config``: on a SuperNode the host's own choice;
in simulation the server names a folder inside the run folder
(:class:`strategies.grid.FederationGrid`). Without it nothing is written.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto

from tasks.files import safe_name, write_atomic
from tasks.messages import HE_STATE, STATE_DIR

# per-round protocol state and the HE keys: redone after a crash, never on disk
TRANSIENT = (RECORD_KEY_STATE, HE_STATE)


def state_file(node_config: dict, run_config: dict) -> Path | None:
    """Where this node keeps its state for the partition it serves in this run (None:
    nowhere): ``<state-dir>/<run id>/partition-<id>.state``, so a SuperNode that serves
    several runs keeps their ledgers apart, and a resumed run finds its own even when its
    folder was renamed or moved (the id is written once, in run.json and config.toml; a
    run made before ids existed is keyed by its folder's name)."""
    folder = node_config.get(STATE_DIR)
    if not folder:
        return None
    run = str(run_config.get("run-id") or "") or \
        Path(str(run_config.get("run-dir") or "run")).name
    partition = int(node_config["partition-id"])
    return Path(str(folder)) / safe_name(run) / f"partition-{partition}.state"


OWNER = "fedpriv.state-owner"  # which run a state file belongs to (its run id)


def _lasting(state: RecordDict) -> bytes:
    kept = RecordDict({k: v for k, v in state.items() if k not in (*TRANSIENT, OWNER)})
    return recorddict_to_proto(kept).SerializeToString(deterministic=True) if kept else b""


def load_state(path: Path) -> RecordDict:
    proto = RecordDictProto()
    proto.ParseFromString(path.read_bytes())
    return recorddict_from_proto(proto)


def _owned(blob: bytes, run_id: str) -> bytes:
    """``blob`` (the lasting state) with the record naming the run it belongs to."""
    if not blob:
        return blob
    proto = RecordDictProto()
    proto.ParseFromString(blob)
    state = recorddict_from_proto(proto)
    state[OWNER] = ConfigRecord({"run-id": run_id})
    return recorddict_to_proto(state).SerializeToString(deterministic=True)


def _read_own(path: Path, run_id: str) -> RecordDict:
    """The state saved at ``path``, refused when it is unreadable or another run's."""
    try:
        state = load_state(path)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning-like errors
        raise StateFileError(f"this client's saved state {path} is unreadable "
                             f"({type(exc).__name__}: {exc}); restore it from a backup, or "
                             "start the run again as a new run (its DP ledger cannot be "
                             "recovered from anything else)") from None
    owner = state.config_records.get(OWNER, {}).get("run-id")
    if run_id and owner and owner != run_id:
        raise StateFileError(f"this client's saved state {path} belongs to run {owner}, "
                             f"not this run ({run_id}); put this run's own state file back")
    return state


class StateFileError(RuntimeError):
    """A client's saved state is unreadable or belongs to another run."""


def save_state(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: f.write(blob))


def state_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Start a fresh Context from the node's saved state; save it when a message changed it."""
    path = state_file(context.node_config, context.run_config)
    if path is None:
        return call_next(msg, context)
    run_id = str(context.run_config.get("run-id") or "")
    before = _lasting(context.state)
    if not before and path.exists():
        for name, record in _read_own(path, run_id).items():
            if name != OWNER:
                context.state[name] = record
        before = _lasting(context.state)
    reply = call_next(msg, context)
    after = _lasting(context.state)
    if after != before:
        save_state(path, _owned(after, run_id))
    return reply
