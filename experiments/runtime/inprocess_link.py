"""The CLI's side of the in-process runtime (:mod:`experiments.runtime.inprocess`).

:class:`InProcessLink` is driven by :func:`experiments.runtime.runner.execute` as a
SuperLink is: ``submit`` runs one ServerApp (a run, or a sweep's cells) in a child process
of its own session, streams its lines, and stops it by PID if we are interrupted; the
kernel stops it if we are killed (and it then records its runs as crashed). No flwr or
torch import here: the CLI stays light.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from . import procs
from .superlink import HOME_PREFIX, OWNER_FILE, remove_stale_homes


class InProcessLink:
    """The in-process runtime as :func:`experiments.runtime.runner.execute` drives a
    SuperLink: ``submit`` runs one ServerApp (a run, or a sweep's cells) in a child."""

    port: int | None = None

    def __init__(self) -> None:
        self.started_s = 0.0
        self.home: Path | None = None
        self.returncode: int | None = None

    def __enter__(self) -> InProcessLink:
        remove_stale_homes()
        self.home = Path(tempfile.mkdtemp(prefix=f"{HOME_PREFIX}inprocess-"))
        me = psutil.Process()  # whose folder it is: removed by a later run if we are killed
        (self.home / OWNER_FILE).write_text(json.dumps({"pid": me.pid,
                                                        "started": me.create_time()}))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)

    def watch_run(self, run_dir: Path) -> None:
        """Nothing to do: the child records its own runs as crashed if we die."""

    def died(self) -> str | None:
        if self.returncode is not None and self.returncode < 0:
            return (f"the in-process runtime's process was killed by signal "
                    f"{-self.returncode} during the run")
        return None

    def submit(self, app_dir: Path, run_config: Mapping[str, Any],
               federation: Mapping[str, Any], on_line: Callable[[str], None]) -> int:
        """Run the ServerApp on ``federation["num-supernodes"]`` in-process nodes."""
        assert self.home is not None
        t0 = time.perf_counter()
        spec = self.home / f"run-{int(t0 * 1e6)}.json"
        spec.write_text(json.dumps(dict(run_config)))
        cmd = [sys.executable, "-m", "experiments.runtime.inprocess", str(spec),
               str(int(federation["num-supernodes"])), str(os.getpid())]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.returncode = procs.stream_child(cmd, on_line, env=env)
        return self.returncode
