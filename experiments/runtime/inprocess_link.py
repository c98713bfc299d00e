"""The CLI's side of the in-process runtime (:mod:`experiments.runtime.inprocess`).

:class:`InProcessLink` is driven by :func:`experiments.runtime.runner.execute` as a
SuperLink is: ``submit`` runs one ServerApp (a run, or a sweep's cells) in a child process
of its own session, streams its lines, and stops it by PID if we are interrupted; the
kernel stops it if we are killed (and it then records its runs as crashed). No flwr or
torch import here: the CLI stays light.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from privacy.dp.shared_memo import MEMO_ENV
from tasks.config import RunConfig
from tasks.progress import Relay

from ..preflight.isolated import ANSWER
from . import preload, procs
from .owned_folders import owned_folder


class InProcessLink:
    """The in-process runtime as :func:`experiments.runtime.runner.execute` drives a
    SuperLink: ``submit`` runs one ServerApp (a run, or a sweep's cells) in a child.

    :meth:`start` starts the child ahead of its run: it imports torch, Flower and the apps
    while the CLI runs the pre-flight check (two cores at work instead of one), then
    waits on its stdin for the run. A child never given a run exits when its stdin closes.
    """

    port: int | None = None

    def __init__(self) -> None:
        self.started_s = 0.0
        self.home: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def __enter__(self) -> InProcessLink:
        # whose folder it is: removed by a later run if we are killed
        self.home = owned_folder("inprocess", remove_at_exit=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)

    def memo_env(self) -> dict[str, str]:
        """The environment naming this runtime's folder of shared privacy values
        (:mod:`privacy.dp.shared_memo`): given to the pre-flight check too, whose noise
        calibrations the runtime then reads back instead of computing them again."""
        return {MEMO_ENV: str(self.home / "epsilon")} if self.home is not None else {}

    def start(self, configs: Iterable[RunConfig] = ()) -> InProcessLink:
        """Start the child (if it is not waiting already); it waits for :meth:`submit`,
        meanwhile importing what ``configs`` (the runs it will likely get) need beyond every
        run's apps (:mod:`experiments.runtime.preload`)."""
        if self.proc is None:
            t0 = time.perf_counter()
            # the run's epsilons, shared by its client workers, in our private folder
            memo = self.memo_env()
            self.proc = procs.start_child(
                [sys.executable, "-m", "experiments.runtime.inprocess", str(os.getpid()),
                 *preload.needed(configs)],
                env={**os.environ, "PYTHONUNBUFFERED": "1", **memo}, stdin=subprocess.PIPE,
                death_signal=signal.SIGUSR1)  # inprocess.PARENT_DIED (no torch import here)
            self.started_s = time.perf_counter() - t0
        return self

    def check(self, given: object) -> tuple[dict, int]:
        """The pre-flight check of ``given`` (one config's values, or a list) in the waiting
        child, which has torch, the apps and Opacus imported already (a child of its own
        would import them again): its answer, or ({}, its exit code) if it ended first.
        Its other lines (progress, notes) are shown as they come."""
        proc = self.start().proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps({"preflight": given}) + "\n")
            proc.stdin.flush()
        except OSError:  # it is gone already: its exit code says so below
            pass
        relay = Relay()
        try:
            for line in proc.stdout:
                if line.startswith(ANSWER):
                    return json.loads(line[len(ANSWER):]), 0
                if not relay.feed(line):
                    sys.stderr.write(line)
        finally:
            relay.close()
        self.proc, self.returncode = None, proc.wait()
        return {}, self.returncode

    def checker(self) -> InProcessLink | None:
        """This link, if its child is started (pre-flight checks then run in it), else
        None (they run in a child of their own)."""
        return self if self.proc is not None else None

    def _stop(self) -> None:
        """Stop a child that is still there, by PID (one never given a run, or ours on
        Ctrl-C)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if proc.poll() is None:
            procs.stop_group(proc.pid, grace=2.0)
            procs.stop_tree(proc, grace=2.0)

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
        proc = self.start().proc
        assert proc is not None and proc.stdin is not None
        spec = self.home / f"run-{proc.pid}.json"
        spec.write_text(json.dumps(dict(run_config)))
        try:
            proc.stdin.write(json.dumps({"run-config": str(spec),
                                         "nodes": int(federation["num-supernodes"])}) + "\n")
            proc.stdin.close()
        except OSError:  # it is gone already: its exit code (and output) say why
            pass
        try:
            self.returncode = procs.stream(proc, on_line)
        finally:
            self.proc = None if proc.poll() is not None else proc
        return self.returncode
