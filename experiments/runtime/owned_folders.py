"""Private temporary folders that name the process owning them.

A fedpriv process removes its folders when it ends; one SIGKILLed (or dead of anything
that runs no exit code) cannot, so each folder holds ``owner.json`` (the owner's PID and
start time) and every new folder's creation first removes the ``fp-*`` folders whose
owner is gone (told apart by start time, so a reused PID keeps its folder). Folders
without an owner file are never touched, and neither is one whose keeper
(:mod:`experiments.runtime.keeper`) is still at work in it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

from . import procs

HOME_PREFIX = "fp-"
OWNER_FILE = "owner.json"
KEEPER_FILE = "keeper.json"  # {"pid", "started"} of the keeper at work in a folder


def owned_folder(kind: str = "", *, remove_at_exit: bool = True) -> Path:
    """A new private folder (mode 0700) ``fp-<kind>-*`` in the temporary directory, named
    this process's; with ``remove_at_exit`` removed when this process exits normally
    (not when a forked child of it does)."""
    remove_stale_homes()
    home = Path(tempfile.mkdtemp(prefix=f"{HOME_PREFIX}{kind}-" if kind else HOME_PREFIX))
    write_owner(home)
    if remove_at_exit:
        atexit.register(_remove_if_mine, home, os.getpid())
    return home


def _remove_if_mine(home: Path, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(home, ignore_errors=True)


def write_owner(home: Path) -> None:
    """Name this process as ``home``'s owner (:func:`remove_stale_homes` reads it)."""
    (home / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(),
                                               "started": procs.started(os.getpid())}))


def remove_stale_homes(root: Path | None = None) -> list[Path]:
    """Remove private folders whose owning fedpriv process is gone (a crash that even the
    keeper did not survive); folders without an owner file are left alone, and so is one
    whose keeper is still at work (it reads the folder to record the owner's runs as
    crashed, then removes it itself)."""
    removed = []
    for home in Path(root or tempfile.gettempdir()).glob(f"{HOME_PREFIX}*"):
        try:
            owner = json.loads((home / OWNER_FILE).read_text())
            alive = procs.same_process(int(owner["pid"]), float(owner["started"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if alive or _keeper_at_work(home):
            continue
        shutil.rmtree(home, ignore_errors=True)
        removed.append(home)
    return removed


def _keeper_at_work(home: Path) -> bool:
    try:
        me = json.loads((home / KEEPER_FILE).read_text())
        return procs.same_process(int(me["pid"]), float(me["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False
