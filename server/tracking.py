"""Experiment tracking (run-config key ``tracking``): a run's numbers in TensorBoard or MLflow.

Every number in each round's ledger record (test loss/accuracy/AUROC, train loss, epsilons,
anonymization scores, round times...; :func:`numbers` names them ``test/accuracy``,
``privacy/epsilon/3``, ...) is logged with the round as its step, the initial model's test
numbers as step 0, the run config as hyperparameters, and at the end the plots as images.
The store is local: TensorBoard's event log is ``<run-dir>/tensorboard``; MLflow's is
``<results-dir>/mlflow.db`` (SQLite: MLflow 3 refuses new plain-file stores) with the
artifacts in ``<results-dir>/mlruns``, one MLflow run per fedpriv run, named after its
folder. The ledger stays the record: a tracker that fails mid-run is warned about once and
the run goes on. The libraries are imported only when tracking is on.
"""

from __future__ import annotations

import abc
import importlib.util
import logging
import math
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tasks.config import ConfigError, RunConfig, Scalar
from tasks.results.folder import read_run_info
from tasks.results.ledger import RoundRecord
from tasks.version import ROOT

from .console import say

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

    from strategies.rounds import RoundResult

TENSORBOARD_DIR = "tensorboard"  # inside the run folder
MLFLOW_DB = "mlflow.db"  # inside results-dir
MLFLOW_ARTIFACTS = "mlruns"  # inside results-dir
RUN_ID_TAG = "fedpriv.run-id"  # finds a resumed run's MLflow run
INSTALL = f"pip install -e '{ROOT}[tracking]'"  # fedpriv is not on PyPI: its checkout


def numbers(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in a (nested) ledger record, by its path (``test/accuracy``); lists
    (per-client details, sampled ids) and flags are not metrics and are left out."""
    out: dict[str, float] = {}
    for name, value in values.items():
        path = f"{prefix}{name}"
        if isinstance(value, Mapping):
            out.update(numbers(value, f"{path}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[path] = float(value)
    return out


def round_numbers(record: RoundRecord) -> dict[str, float]:
    """What one round logs: :func:`numbers` of its ledger record, less the round itself."""
    data = record.to_json()
    data.pop("round", None)
    return numbers(data)


def param_text(value: Scalar) -> str:
    """A config value as MLflow keeps it (text; booleans as TOML writes them)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


class Backend(abc.ABC):
    """One tracker's store, opened for one run (an interface: TensorBoard's and MLflow's
    classes below implement it). ``module``: what must be importable."""

    module: ClassVar[str]

    @abc.abstractmethod
    def __init__(self, cfg: RunConfig, run_dir: Path, start: int) -> None:
        """Open the store for the run in ``run_dir``; ``start`` > 1: a resume at that round."""

    @abc.abstractmethod
    def config(self, flat: Mapping[str, Scalar]) -> None:
        """Log the run config (MLflow: only keys it lacks, so a resume keeps the first)."""

    @abc.abstractmethod
    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Log ``values`` (tag -> number) at ``step`` (the round; 0: the initial model)."""

    @abc.abstractmethod
    def image(self, tag: str, path: Path, step: int) -> None:
        """Log the PNG at ``path`` as ``tag`` (its path in the run folder, no suffix)."""

    @abc.abstractmethod
    def close(self, status: str) -> None:
        """End the run: FINISHED, FAILED or KILLED (MLflow's names)."""

    @classmethod
    @abc.abstractmethod
    def store_problem(cls, cfg: RunConfig) -> str | None:
        """What would keep this tracker from writing a run of ``cfg`` (one sentence), found
        before the run starts without creating anything; None: nothing found."""


class TensorBoardLog(Backend):
    """``<run-dir>/tensorboard``: scalars in double precision, the config as hparams and
    as text, the plots as images. A resume purges the steps it runs again."""

    module = "tensorboard"

    def __init__(self, cfg: RunConfig, run_dir: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR),
                                    purge_step=start if start > 1 else None)

    def config(self, flat: Mapping[str, Scalar]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # metric_dict declares the columns TensorBoard's HParams view reads from the scalars
        for summary in hparams(dict(flat), {"test/accuracy": math.nan, "test/loss": math.nan}):
            self.writer.file_writer.add_summary(summary)
        text = "\n".join(f"    {k} = {param_text(v)!r}" for k, v in flat.items())
        self.writer.add_text("config", text)

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
        self.writer.flush()  # a live TensorBoard sees each round as it ends

    def image(self, tag: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as img:
            pixels = np.asarray(img.convert("RGB"))
        self.writer.add_image(tag, pixels, step, dataformats="HWC")

    def close(self, status: str) -> None:
        self.writer.close()

    @classmethod
    def store_problem(cls, cfg: RunConfig) -> str | None:
        r = cfg.results
        # a new run's folder is made in results-dir; a given one (or a resumed run) is named
        where = Path(r.run_dir) / TENSORBOARD_DIR if r.run_dir else Path(r.results_dir)
        return folder_problem(where.expanduser(), "the event log's folder")


class MlflowLog(Backend):
    """One MLflow run per fedpriv run in ``<results-dir>/mlflow.db``, named after the run
    folder and tagged with the run's id, so a resume continues the same MLflow run."""

    module = "mlflow"
    BATCH = 100  # MLflow's limit on params per log_batch call

    def __init__(self, cfg: RunConfig, run_dir: Path, start: int) -> None:
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its database set-up notes
        root = Path(cfg.results.results_dir or run_dir.parent).expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=tracking_uri(root))
        experiment = self._experiment(cfg.results.tracking_experiment or "fedpriv",
                                      (root / MLFLOW_ARTIFACTS).as_uri())
        run_id = cfg.results.run_id  # set by fedpriv (a uuid) for every run it starts
        found = self.client.search_runs([experiment], f"tags.`{RUN_ID_TAG}` = '{run_id}'",
                                        max_results=1) if run_id else []  # a resume, or
        # the CLI's additions after the ServerApp
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                experiment, run_name=run_dir.name,
                tags={RUN_ID_TAG: run_id or "", "fedpriv.run-dir": str(run_dir)}).info.run_id

    def _experiment(self, name: str, artifacts: str) -> str:
        from mlflow.exceptions import MlflowException

        for _ in range(2):  # another run may create it at the same moment
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                return str(found.experiment_id)
            try:
                return str(self.client.create_experiment(name, artifact_location=artifacts))
            except MlflowException:
                continue
        raise RuntimeError(f"MLflow experiment {name!r} could not be created or found")

    def config(self, flat: Mapping[str, Scalar]) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params  # a resume logs none twice
        params = [Param(k, param_text(v)) for k, v in flat.items() if k not in logged]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self.BATCH])

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit on metrics per call
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def image(self, tag: str, path: Path, step: int) -> None:
        folder = str(Path(tag).parent)
        self.client.log_artifact(self.run_id, str(path), None if folder == "." else folder)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)

    @classmethod
    def store_problem(cls, cfg: RunConfig) -> str | None:
        root = Path(cfg.results.results_dir or ".").expanduser()
        db, artifacts = root / MLFLOW_DB, root / MLFLOW_ARTIFACTS
        if db.is_dir():
            return (f"its store {str(db)!r} is a folder, where MLflow keeps a SQLite file "
                    "(MLflow would retry opening it for minutes)")
        # SQLite writes a journal beside the file: its folder must be writable too
        return (folder_problem(root, "the folder of its store")
                or (sqlite_problem(db) if db.exists() else None)
                or folder_problem(artifacts, "its artifacts folder"))


BACKENDS: dict[str, type[Backend]] = {
    "tensorboard": TensorBoardLog,
    "mlflow": MlflowLog,
}
"""The trackers by the ``tracking`` value that selects them ("none": no tracker)."""


LOCK_WAIT_S = 2.0  # how long the store may stay locked by another writer in the check


def folder_problem(folder: Path, what: str) -> str | None:
    """Why no file could be written in ``folder`` (made if missing), or None: it is a
    file, or its nearest existing folder is not writable. Nothing is created."""
    if folder.exists() and not folder.is_dir():
        return f"{what} {str(folder)!r} is a file, not a folder"
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{what} {str(folder)!r} cannot be made: {str(existing)!r} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{what} {str(folder)!r} cannot be written: {str(existing)!r} is read-only"
    return None


def sqlite_problem(db: Path) -> str | None:
    """Why an existing file cannot serve as MLflow's SQLite store (not a database, read-only,
    or held locked by another process for over :data:`LOCK_WAIT_S` s), or None. Opens it
    only to take and release the write lock."""
    if not os.access(db, os.W_OK):  # SQLite would open it read-only without a word
        return f"its store {str(db)!r} is read-only"
    try:
        con = sqlite3.connect(db.resolve().as_uri() + "?mode=rw", uri=True,
                              timeout=LOCK_WAIT_S, isolation_level=None)
    except sqlite3.Error as exc:
        return f"its store {str(db)!r} cannot be opened for writing ({exc})"
    try:
        con.execute("PRAGMA schema_version")  # reads the header: "file is not a database"
        con.execute("BEGIN IMMEDIATE")  # the write lock MLflow's every write needs
        con.execute("ROLLBACK")
    except sqlite3.Error as exc:
        text = str(exc)
        why = (f"another process holds it locked (still after {LOCK_WAIT_S:g} s: {text}), "
               "so MLflow would retry for minutes" if "locked" in text or "busy" in text
               else f"it is not a writable SQLite database ({text})")
        return f"its store {str(db)!r} cannot be written: {why}"
    finally:
        con.close()
    return None


def tracking_uri(results_dir: str | Path) -> str:
    """The local MLflow store of a results folder (``mlflow ui --backend-store-uri``)."""
    return f"sqlite:///{Path(results_dir).expanduser().resolve() / MLFLOW_DB}"


def require(cfg: RunConfig) -> None:
    """ConfigError (one paragraph) when ``tracking`` names a tracker whose library is not
    installed, or whose store cannot be written (:meth:`Backend.store_problem`: a folder
    where a file belongs, read-only, locked by another process); the CLI, the Python API
    and the ServerApp ask before any work."""
    name = cfg.results.tracking
    backend = BACKENDS.get(name)
    if backend is None:
        return
    module = backend.module
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"tracking = {name!r} needs the Python package {module!r}, which is not installed "
            f"in this environment ({sys.executable}). Install fedpriv's tracking extra "
            f"(`{INSTALL}`: fedpriv is not on PyPI, so from its checkout; it brings "
            "tensorboard and mlflow-skinny), or run with "
            f"tracking = 'none' (allowed: none | {' | '.join(BACKENDS)}); the ledger "
            "(metrics.jsonl) and the plots are written either way.")
    problem = backend.store_problem(cfg)
    if problem is not None:
        raise ConfigError(
            f"tracking = {name!r}: {problem}. Nothing was started. Free or fix it, choose "
            "another results-dir (each has its own store), or run with tracking = 'none' "
            "(metrics.jsonl and the plots are written either way).")


class Tracking:
    """A round hook (:class:`server.loop.RoundHook`) that logs to one tracker: the config
    when it opens, each round's numbers, and at the end the plots under ``plots/``. Never
    fails the run: the first error is warned about, later ones are silent, and the run and
    its ledger go on."""

    def __init__(self, cfg: RunConfig, run_dir: Path, *, start: int = 1,
                 initial: Callable[[], Mapping[str, float] | None] = lambda: None,
                 reopen: bool = False) -> None:
        """``start`` > 1: a resume at that round; ``reopen``: the run's rounds are all
        logged, this adds to them (:func:`after_run`)."""
        self.name = cfg.results.tracking
        self.run_dir = run_dir
        self.initial = initial if start == 1 else (lambda: None)
        self.last_round = start - 1
        self.warned = False
        self.backend: Backend | None = self._safe(
            "opening its store", lambda: BACKENDS[self.name](cfg, run_dir, start))
        if self.backend is not None and not reopen:
            self._safe("the run config", self.backend.config, cfg.flat())

    def _safe(self, what: str, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as exc:
            if not self.warned:
                self.warned = True
                say(f"warning: tracking ({self.name}) failed while logging {what}: "
                    f"{type(exc).__name__}: {exc}. The run goes on; metrics.jsonl and the "
                    "plots have everything (further tracking errors are not shown)")
            return None

    def after_round(self, record: RoundRecord, arrays: ArrayRecord,
                    result: RoundResult) -> None:
        if self.backend is None:
            return
        if (initial := self.initial()) is not None:
            self._safe("the initial model's test", self.backend.metrics, 0,
                       {f"test/{k}": v for k, v in numbers(initial).items()})
            self.initial = lambda: None
        self._safe(f"round {record.round}", self.backend.metrics, record.round,
                   round_numbers(record))
        self.last_round = record.round

    def finish(self, plots: Iterable[tuple[Path, str]] | None = None) -> None:
        """Log the plots as they are now (the plot hook before this one drew them last;
        ``plots``: only these) and close the run: FAILED or KILLED when the loop is
        stopping on an error."""
        if self.backend is None:
            return
        for path, tag in plot_files(self.run_dir) if plots is None else plots:
            self._safe(f"the plot {tag}", self.backend.image, tag, path, self.last_round)
        error = sys.exc_info()[0]  # set while server.loop finishes the hooks after a failure
        status = ("FINISHED" if error is None else
                  "FAILED" if issubclass(error, Exception) else "KILLED")
        self._safe("the run's end", self.backend.close, status)
        self.backend = None


def plot_files(run_dir: Path) -> Iterable[tuple[Path, str]]:
    """Every image under ``plots/`` and its tag: the path inside the run folder, no suffix."""
    for path in sorted((run_dir / "plots").rglob("*.png")):
        yield path, path.relative_to(run_dir).with_suffix("").as_posix()


def after_run(cfg: RunConfig, run_dir: Path, since: float) -> None:
    """What the CLI adds to a finished run once the ServerApp has ended, logged to the same
    tracked run: the plots drawn since ``since`` (the partitioner's label plot, the release
    plot) and the leakage attacks' summary (run.json's ``leakage``, as ``leakage/...`` at
    the last round). Warns, never raises."""
    if cfg.results.tracking not in BACKENDS:
        return
    plots = [(p, tag) for p, tag in plot_files(run_dir) if p.stat().st_mtime >= since]
    info = read_run_info(run_dir)
    leakage = numbers(info.get("leakage") or {}, "leakage/")
    if not plots and not leakage:
        return
    last = int(info.get("rounds-completed") or 0)
    # the CLI's config may predate the run's id, which the ServerApp recorded in run.json
    cfg = replace(cfg, results=replace(cfg.results,
                                       run_id=info.get("run-id") or cfg.results.run_id))
    hook = Tracking(cfg, run_dir, start=last + 1, reopen=True)
    if hook.backend is not None and leakage:
        hook._safe("the leakage summary", hook.backend.metrics, last, leakage)
    hook.finish(plots)
