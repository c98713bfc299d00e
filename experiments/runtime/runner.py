"""Run one configuration on a LocalSuperLink and report how it ended."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from server.console import PREFIX
from tasks.config import RunConfig
from tasks.files import explain, write_atomic
from tasks.progress import Relay
from tasks.results.folder import RunFolder, read_run_info, run_identity, settings_title

from ..leakage.release_plot import plot_in_child
from .owned_folders import owned_folder
from .procs import interruption, stream_child
from .superlink import LocalSuperLink

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
ERROR_LINE = re.compile(r"(\bERROR\b|^Traceback|^\w*(Error|Exception)\b.*:)")
MAX_ERROR_LINES = 8


@dataclass
class RunOutcome:
    run_dir: Path
    status: str  # finished | failed | interrupted | crashed
    error: str | None
    info: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "finished"


def federation_config(cfg: RunConfig, cuda: bool) -> dict[str, Any]:
    """The simulation federation for a run config: clients and their resources."""
    r = cfg.resources
    gpus = r.client_gpus if r.device != "cpu" and cuda else 0.0
    return {"num-supernodes": cfg.federation.num_clients,
            "client-resources-num-cpus": r.client_cpus, "client-resources-num-gpus": gpus}


class LogFilter:
    """Write every line to the log file; show fedpriv's own lines (and errors) on the terminal."""

    def __init__(self, log_path: Path, verbose: bool, echo: Callable[[str], None]) -> None:
        self.path = log_path
        self.log: TextIO | None = open(log_path, "a")
        self.verbose = verbose
        self.echo = echo
        self.errors_shown = 0
        self.last_error: str | None = None  # the ServerApp's last "error: ..." line
        self.t0 = time.perf_counter()
        self.progress = Relay()  # the apps' progress bars (tasks.progress), drawn here

    def __call__(self, raw: str) -> None:
        line = ANSI.sub("", raw)
        if self.progress.feed(line):
            return
        self._write(f"[{time.perf_counter() - self.t0:7.2f}s] {line}\n")
        if PREFIX in line:
            own = line.split(PREFIX, 1)[1]
            if own.startswith("error: ") and not own.startswith("error: run.json"):
                self.last_error = own.removeprefix("error: ")
            self.echo(own)
        elif self.verbose:
            self.echo(line)
        elif ERROR_LINE.search(line.strip()) and self.last_error is None:
            # once the ServerApp has said what went wrong, Flower's report of the same
            # exception (its traceback's first line, the exit code) stays in flwr.log
            self.errors_shown += 1
            if self.errors_shown <= MAX_ERROR_LINES:
                self.echo("  | " + line.strip()[:400])
            elif self.errors_shown == MAX_ERROR_LINES + 1:
                self.echo("  | (more errors in flwr.log)")

    def _write(self, text: str) -> None:
        """Keep the log; if the disk will not take it, say so once and go on without it."""
        if self.log is None:
            return
        try:
            self.log.write(text)
            self.log.flush()
        except OSError as exc:
            self.echo(f"warning: {explain(self.path, exc)}; the rest of Flower's log is "
                      "not kept")
            with contextlib.suppress(OSError):
                self.log.close()
            self.log = None

    def close(self) -> None:
        self.progress.close()
        if self.log is not None:
            with contextlib.suppress(OSError):
                self.log.close()


def attack_run(run_dir: Path, echo: Callable[[str], None] = print) -> bool:
    """Run the configured attacks on a finished run's observations, in a child process
    (torch stays out of the CLI); True when they completed."""
    echo("attacking what the server observed (privacy.attacks; `fedpriv attack` re-runs "
         "them)...")
    progress = Relay()
    try:
        code = stream_child([sys.executable, "-m", "experiments.leakage.attack", str(run_dir)],
                            lambda line: progress.feed(line) or echo(f"  {line}"))
    finally:
        progress.close()
    if code != 0:
        echo(f"  the attacks did not complete (exit code {code}); the run's results are "
             f"intact. Re-run them with: fedpriv attack {run_dir}")
    return code == 0


class _Drawing:
    """One label plot being drawn, shared by the runs whose plot is the same (a sweep's
    cells on one partition: the title names the split, not lr or seed)."""

    def __init__(self, draw: Callable[[Path], None]) -> None:
        self.folder = owned_folder("labels")  # a SIGKILLed CLI's is removed by the next start
        self.users = 0
        self.future = GroundTruthPlot.drawer().submit(draw, self.path)

    @property
    def path(self) -> Path:
        return self.folder / "label_distribution.png"


class GroundTruthPlot:
    """The partitioner's label plot (ground truth the server never sees), drawn by the CLI
    in a thread while the run goes, so matplotlib's import and the drawing (0.4 s) add
    nothing to the run's end; :meth:`place` puts a copy among the run's plots. One thread
    draws every such plot in turn (matplotlib's state is not made for two at once), each
    distinct plot once however many runs show it."""

    _drawer: ThreadPoolExecutor | None = None
    _drawings: dict[tuple[Any, ...], _Drawing] = {}

    @classmethod
    def drawer(cls) -> ThreadPoolExecutor:
        if cls._drawer is None:
            cls._drawer = ThreadPoolExecutor(1, thread_name_prefix="label-plot")
        return cls._drawer

    def __init__(self, cfg: RunConfig, label_counts: list[list[int]]) -> None:
        title = (f"label distribution · {cfg.data.dataset} · {cfg.federation.num_clients} "
                 f"clients · {settings_title(cfg)} · ground truth from the partitioner, "
                 "not sent to the server")
        counts = [{"partition-id": i, "label-counts": c} for i, c in enumerate(label_counts)]
        self.key = (title, tuple(map(tuple, label_counts)))
        drawing = GroundTruthPlot._drawings.get(self.key)
        if drawing is None:
            drawing = _Drawing(lambda path: _plot_labels(path, counts, title))
            GroundTruthPlot._drawings[self.key] = drawing
        drawing.users += 1
        self.drawing: _Drawing | None = drawing

    def place(self, plot: Path) -> None:
        """Copy the drawn plot to ``plot`` (dated now: it is part of what the run adds);
        the drawing's error, if it failed, is raised here."""
        assert self.drawing is not None, "placed after close()"
        self.drawing.future.result()
        plot.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()  # as given: the file system's own clock may lag time.time()
        drawn = self.drawing.path
        for source, placed in ((drawn, plot),  # the PNG and the PDF beside it
                               (drawn.with_suffix(".pdf"), plot.with_suffix(".pdf"))):
            if source.exists():  # whole or not at all, as every plot
                data = source.read_bytes()
                write_atomic(placed, lambda f, data=data: f.write(data))
                os.utime(placed, (now, now))

    def close(self) -> None:
        """Drop it: the drawing, when no other run shows it, is not drawn if it has not
        started, and its folder is removed."""
        drawing, self.drawing = self.drawing, None
        if drawing is None:
            return
        drawing.users -= 1
        if drawing.users > 0:
            return
        del GroundTruthPlot._drawings[self.key]
        if not drawing.future.cancel():
            with contextlib.suppress(Exception):
                drawing.future.result()
        shutil.rmtree(drawing.folder, ignore_errors=True)


def _plot_labels(path: Path, partitions: list[dict[str, Any]], title: str) -> None:
    from tasks.results.plots import plot_label_distribution

    plot_label_distribution(path, partitions, title)


def execute(link: LocalSuperLink, app: Path, cfg: RunConfig, run_dir: Path, *,
            cuda: bool = False, verbose: bool = False,
            echo: Callable[[str], None] = print,
            label_counts: list[list[int]] | None = None) -> RunOutcome:
    """Submit one run and wait for it; the ServerApp writes everything into ``run_dir``.

    ``label_counts`` (the partitioner's ground truth, from the pre-flight check) draws
    the label-distribution plot when the clients did not disclose their histograms.
    """
    t0 = time.perf_counter()
    log = LogFilter(run_dir / "flwr.log", verbose, echo)
    status, error = "crashed", None
    labels = GroundTruthPlot(cfg, label_counts) if label_counts else None
    try:
        link.submit(app, {**cfg.flat(), "run-dir": str(run_dir),
                          "run-id": run_identity(run_dir, cfg.results)},
                    federation_config(cfg, cuda),
                    log)
        status, error = recorded_outcome(run_dir, run_dir / "flwr.log", link.died(),
                                         log.last_error)
    except KeyboardInterrupt as exc:
        status, error = "interrupted", interruption(exc)
        exc.run_dir = run_dir  # type: ignore[attr-defined]  # the CLI says how to resume
        raise
    finally:
        log.close()
        mark_unfinished(run_dir, status, error)
        summarise_unfinished(cfg, run_dir, status)
        if labels is not None and status != "finished":
            labels.close()
    try:
        return after_run(cfg, run_dir, status, error, time.perf_counter() - t0, echo,
                         labels)
    finally:
        if labels is not None:
            labels.close()


def recorded_outcome(run_dir: Path, log_path: Path, died: str | None = None,
                     said: str | None = None) -> tuple[str, str | None]:
    """(status, error) as the ServerApp recorded them in run.json; "crashed" when it
    recorded nothing (``died``: a process fedpriv started that is gone, the likely cause;
    ``said``: the error the ServerApp printed, e.g. when run.json could not be written)."""
    info = read_run_info(run_dir)
    status = info.get("status", "running")
    if status == "running":
        status = "failed" if said else "crashed"
    error = info.get("error")
    if status == "failed" and not error and said:
        error = said
    if status == "crashed":
        error = f"the ServerApp stopped without recording an outcome; see {log_path}"
        if died:
            error = f"{died}; the ServerApp could not finish (see {log_path})"
        elif log_path.exists() and "Invalid run configuration" in log_path.read_text():
            error = ("Flower refused the run config: a key is missing from pyproject.toml's "
                     "[tool.flwr.app.config] (regenerate it with `fedpriv keys --toml`)")
    return status, error


def summarise_unfinished(cfg: RunConfig, run_dir: Path, status: str) -> None:
    """summary.md of the rounds an unfinished run did, with how to resume it; never raised
    in place of what stopped the run."""
    if status == "finished":
        return
    from server.summary import write_unfinished_summary

    try:
        write_unfinished_summary(run_dir, cfg)
    except Exception as exc:  # a full disk, a damaged ledger: the outcome is said anyway
        print(f"fedpriv: warning: no summary.md for the unfinished run: {exc}",
              file=sys.stderr)


def mark_unfinished(run_dir: Path, status: str, error: str | None) -> None:
    """Record an interrupted, crashed or failed run in its run.json (the ServerApp could
    not); a disk that will not take it is reported, not raised."""
    info = read_run_info(run_dir)
    if status in ("interrupted", "crashed", "failed") and \
            info.get("status", "running") == "running":
        try:
            RunFolder(run_dir).write_json("run.json", {**info, "status": status,
                                                       "error": error})
        except OSError as exc:
            print(f"fedpriv: warning: the run's outcome ({status}) is not in run.json: {exc}",
                  file=sys.stderr)


def after_run(cfg: RunConfig, run_dir: Path, status: str, error: str | None, wall_s: float,
              echo: Callable[[str], None] = print,
              label_counts: list[list[int]] | GroundTruthPlot | None = None) -> RunOutcome:
    """What follows a finished run in the CLI: the ground-truth label plot when the clients
    did not send their histograms (``label_counts``, or already drawn), the release plot,
    and the leakage study's attacks (all logged to the run's tracker, with ``tracking``)."""
    # imported where needed, not before the run: matplotlib and Flower would add a
    # second to the CLI's start (before its run's child starts) and half one to its end
    from server.tracking import after_run as track_after_run

    since = time.time()
    plot = run_dir / "plots" / "label_distribution.png"
    if label_counts and status == "finished" and not plot.exists():
        drawn = (label_counts if isinstance(label_counts, GroundTruthPlot)
                 else GroundTruthPlot(cfg, label_counts))
        try:
            drawn.place(plot)
        finally:
            drawn.close()
    if status == "finished" and cfg.anonymization.enabled:
        from server.summary import embed_release_scatter

        if plot_in_child(run_dir):
            embed_release_scatter(run_dir)
            echo("  plots/release_scatter.png: client 0's original vs released embeddings")
    if status == "finished" and cfg.leakage.enabled:
        attack_run(run_dir, echo)
    if status == "finished":
        track_after_run(cfg, run_dir, since)
    return RunOutcome(run_dir, status, error, read_run_info(run_dir), wall_s)
