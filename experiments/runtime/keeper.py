"""The keeper: stops every process a LocalSuperLink started when its owner dies, however.

``python -m experiments.runtime.keeper RECORD OWNER_PID`` runs beside fedpriv in a session of
its own. Every 0.5 s it records each root the owner listed in ``RECORD.roots`` (one PID
per line: the SuperLink, the SuperNodes, each ``flwr run``) and every descendant it can
see, with their start times, in ``RECORD`` (JSON). Flower
starts SuperExec in a new session and Ray re-parents some of its processes, so a walk
from the SuperLink at the end would miss them once the SuperLink is gone; the record
does not. When the owner is gone (even SIGKILLed, which no cleanup code in it
survives), the keeper terminates every recorded process still alive — by PID, each
checked against its recorded start time so a reused PID is never touched — kills what
is left after a grace period, marks the owner's runs that were still ``running`` as
``crashed`` (``RECORD.runs`` lists their folders; read as they are listed, so a folder
removed early loses none), removes the owner's private folder and any other it
owned (:mod:`~experiments.runtime.owned_folders`), and exits. It names
itself in ``keeper.json`` there, so another fedpriv cleaning up the folders of dead
owners leaves this one until the keeper is done. The owner stops the keeper itself (by
PID) after its own cleanup, which reads the same record. Processes are told apart by
:func:`~experiments.runtime.procs.started`, never the wall clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import psutil

from experiments.runtime.owned_folders import KEEPER_FILE, remove_stale_homes
from experiments.runtime.procs import same_process, started, terminate_then_kill

INTERVAL = 0.5
GRACE = 5.0


def read_record(path: Path) -> dict[int, float]:
    """The processes recorded so far: PID -> :func:`started`."""
    try:
        return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def live(record: dict[int, float]) -> list[psutil.Process]:
    """The recorded processes still running (same PID *and* start)."""
    out = []
    for pid, when in record.items():
        try:
            if same_process(pid, when):  # alive, not a zombie
                out.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return out


def stop_recorded(record: dict[int, float], grace: float = GRACE) -> None:
    """SIGTERM every recorded live process, then SIGKILL what is left after ``grace``."""
    terminate_then_kill(lambda: live(record), grace)


def _snapshot(roots: list[psutil.Process], record: dict[int, float]) -> bool:
    """Add ``roots`` and their descendants to ``record``; True when anything was added."""
    added = False
    for root in roots:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                if p.pid not in record:
                    record[p.pid] = started(p.pid)
                    added = True
            except psutil.Error:
                continue
    return added


def _roots(path: Path) -> dict[int, float]:
    """The roots the owner listed, with their starts (PIDs that are gone: left out)."""
    out = {}
    try:
        pids = [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return out
    for pid in pids:
        try:
            out[pid] = started(pid)
        except (psutil.Error, OSError, ValueError, IndexError):
            continue
    return out


def _listed(path: Path) -> list[str]:
    """The run folders the owner listed so far (none while the file is missing)."""
    try:
        return [line for line in path.read_text().splitlines() if line]
    except OSError:
        return []


def main(argv: list[str]) -> int:
    path, owner = Path(argv[0]), int(argv[1])
    home = path.parent
    try:
        owner_started = started(owner)
    except (psutil.Error, OSError, ValueError, IndexError):
        owner_started = -1.0
    me = os.getpid()
    (home / KEEPER_FILE).write_text(json.dumps({"pid": me, "started": started(me)}))
    record: dict[int, float] = {}
    runs: dict[str, None] = {}  # in order, each once
    roots_file, runs_file = path.with_suffix(".roots"), path.with_suffix(".runs")
    while same_process(owner, owner_started):
        runs.update(dict.fromkeys(_listed(runs_file)))
        before = len(record)
        for pid, when in _roots(roots_file).items():
            record.setdefault(pid, when)
        # every recorded process still running is walked: a child outlives its parent
        _snapshot(live(record), record)
        if len(record) != before:
            tmp = path.with_suffix(".tmp")
            with contextlib.suppress(OSError):  # the folder removed: it is kept in memory
                tmp.write_text(json.dumps(record))
                os.replace(tmp, path)
        time.sleep(INTERVAL)
    runs.update(dict.fromkeys(_listed(runs_file)))
    folders = [Path(r) for r in runs]
    # the outcome first: a ServerApp stopped below must not record its own ending; and
    # again after: one that finished a round meanwhile wrote run.json as still running
    mark_orphaned(folders, owner)
    stop_recorded(record)
    mark_orphaned(folders, owner)
    shutil.rmtree(home, ignore_errors=True)
    remove_stale_homes()  # the owner's other private folders (its staged app, its plots)
    return 0


def mark_orphaned(folders: list[Path], owner: int) -> None:
    """Record the outcome the dead owner could not: each of its runs still ``running``
    becomes ``crashed``, with the cause (its finished rounds stay in metrics.jsonl)."""
    for folder in folders:
        info_path = folder / "run.json"
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            continue
        if info.get("status") != "running":
            continue
        info.update({"status": "crashed", "error": f"fedpriv (pid {owner}) was killed "
                     "before the run ended; the processes it started are stopped. The "
                     "rounds that finished are in metrics.jsonl; continue with `fedpriv run "
                     f"--resume {folder}`."})
        tmp = folder / ".run.json.keeper"
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, info_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
