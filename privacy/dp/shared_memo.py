"""A run's epsilons and noise calibrations computed once for all its processes.

Each client's epsilon is a function of public values only (the noise multiplier, the
public sampling rate, the steps, delta, the accountant and the relation), so every
simulated client with the same schedule reports the same one, and one process caches it
for its clients; so is the noise multiplier calibrated for a target epsilon, which the
pre-flight check computes first and the runtime reads back. The in-process runtime's
clients train in several worker processes; without this each of them would compute
every round's epsilon again (dp-accounting's PLD: 0.1-0.2 s of CPU a round, on the cores
the clients train on). The runtime names a
folder of its own in ``FEDPRIV_EPSILON_MEMO`` (created private to its user, so no other
local user can plant a value), and :func:`shared` computes a value once under a lock
in it, the other processes waiting for it and reading it back to the bit (a float's
``repr``). A SuperNode, or a process without the variable, computes its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Hashable
from pathlib import Path

MEMO_ENV = "FEDPRIV_EPSILON_MEMO"


def shared(key: Hashable, compute: Callable[[], float]) -> float:
    """``compute()``, or the value another process of this run computed for ``key`` (a
    tuple of public values whose ``repr`` identifies it)."""
    folder = os.environ.get(MEMO_ENV)
    if not folder:
        return compute()
    import fcntl

    path = _path(folder, key)
    path.parent.mkdir(mode=0o700, exist_ok=True)  # (the pre-flight check comes first)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one computes; the others wait, then read it
        if path.exists():
            return float(json.loads(path.read_text())["value"])
        value = compute()
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": repr(key), "value": value}))
        partial.replace(path)
        return value


def _path(folder: str, key: Hashable) -> Path:
    """Where ``key``'s value is kept in ``folder``."""
    return Path(folder) / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:40]}.json"
