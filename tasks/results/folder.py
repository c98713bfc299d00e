"""A run's results folder: created once, never overwritten, written as the run goes."""

from __future__ import annotations

import datetime as dt
import json
import time
import tomllib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import ConfigError, ResultsConfig, RunConfig, to_toml
from ..files import append_line, damaged, read_text, safe_name, write_atomic
from .info import RunInfo
from .ledger import METRICS, RoundRecord

RUN_INFO = "run.json"
OUTCOMES = ("finished", "failed", "crashed", "interrupted")  # run.json's final statuses


def now() -> str:
    """The local time, as run.json records it."""
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


class OutcomeAlreadyRecorded(RuntimeError):
    """run.json already holds the run's outcome (e.g. its owner recorded a crash)."""


def new_run_dir(results_dir: str | Path, name: str) -> Path:
    """Create and return a fresh folder ``<results_dir>/<timestamp>-<name>[-k]``."""
    root = Path(results_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = safe_name(name)
    for k in range(1, 1000):
        path = root / (f"{stamp}-{safe}" if k == 1 else f"{stamp}-{safe}-{k}")
        try:
            path.mkdir()
            return path.resolve()
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run folder under {root}")


def given_run_dir(results: ResultsConfig) -> Path | None:
    """``run-dir`` as an absolute path (None when not given); ConfigError when it already
    holds a run, which fedpriv never overwrites."""
    if not results.run_dir:
        return None
    path = Path(results.run_dir).expanduser().resolve()
    if results.resume:  # checked by server.checkpoint.resumable
        return path
    if (path / METRICS).exists() or (path / RUN_INFO).exists():
        raise ConfigError(
            f"run-dir {str(path)!r} already holds a run; fedpriv never overwrites results. "
            "Leave run-dir empty to get a new folder under results-dir, or name a new one.")
    if path.is_dir() and any((child / RUN_INFO).is_file() for child in path.iterdir()
                             if child.is_dir()):
        raise ConfigError(
            f"run-dir {str(path)!r} is a folder of runs (results-dir), not a run's own "
            "folder: this run's files would lie among theirs. Give results-dir = "
            f"{str(path)!r} instead, or name a new folder for run-dir.")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run-dir {str(path)!r} is a file, not a folder; name a new folder.")
    return path


def run_settings(cfg: RunConfig) -> list[tuple[str, str]]:
    """The settings that tell runs apart, each as (folder-name piece, title piece): the
    split (with Dirichlet's alpha), DP mode with its epsilon (or noise), secure
    aggregation and the anonymizer with its parameter; defaults add nothing."""
    d, p, a = cfg.data, cfg.privacy, cfg.anonymization
    split = {"dirichlet": (f"dirichlet{d.dirichlet_alpha:g}",
                           f"Dirichlet \u03b1={d.dirichlet_alpha:g}"),
             "shard": (f"shard{d.shards_per_client}", f"{d.shards_per_client} shards/client"),
             "pathological": (f"pathological{d.classes_per_client}",
                              f"{d.classes_per_client} classes/client")}
    out = [split.get(d.partitioner, (d.partitioner, d.partitioner))]
    if p.dp == "local":
        out.append((f"dp-local-eps{p.target_epsilon:g}", f"local DP \u03b5={p.target_epsilon:g}")
                   if p.target_epsilon else
                   (f"dp-local-z{p.noise_multiplier:g}", f"local DP z={p.noise_multiplier:g}"))
    elif p.dp == "central":
        budget = (f"-eps{p.max_epsilon:g}", f", \u03b5\u2264{p.max_epsilon:g}") \
            if p.max_epsilon else ("", "")
        out.append((f"dp-central-z{p.noise_multiplier:g}{budget[0]}",
                    f"central DP z={p.noise_multiplier:g}{budget[1]}"))
    elif p.dp == "distributed":
        out.append((f"dp-distributed-z{p.noise_multiplier:g}",
                    f"distributed DP z={p.noise_multiplier:g}"))
    if cfg.secagg.protocol != "off":
        name = "secagg" if cfg.secagg.protocol == "secagg+" else cfg.secagg.protocol
        out.append((name, "SecAgg+" if name == "secagg" else name.upper()))
    if a.anonymizer != "none":
        eps = ("eps", "\u03b5", a.noise_epsilon)
        param = {"ksame": ("k", "k", a.k), "gaussian": eps, "laplace": eps,
                 "density": ("eps", "eps", a.dbscan_eps)}.get(a.anonymizer)
        classwise = (a.anonymizer == "ksame" and a.ksame_classwise) or \
            (a.anonymizer == "density" and a.density_classwise)
        out.append((a.anonymizer + (f"-{param[0]}{param[2]:g}" if param else "")
                    + ("-classwise" if classwise else ""),
                    a.anonymizer + (f" {param[1]}={param[2]:g}" if param else "")
                    + (" classwise" if classwise else "")))
    return out


def default_run_name(cfg: RunConfig) -> str:
    """``<dataset>-<strategy>-<split>[-<settings>]``, e.g. mnist-fedavg-iid or
    mnist-fedavg-dirichlet0.3-dp-local-eps5-secagg (see :func:`run_settings`)."""
    return "-".join([cfg.data.dataset, cfg.federation.strategy,
                     *(name for name, _ in run_settings(cfg))])


def settings_title(cfg: RunConfig) -> str:
    """The settings of :func:`run_settings` for a plot's title, joined by ' · '."""
    return " \u00b7 ".join(title for _, title in run_settings(cfg))


class RunFolder:
    """The files of one run. Metrics are appended and flushed as each round ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "plots").mkdir(parents=True, exist_ok=True)

    @classmethod
    def open(cls, results: ResultsConfig, name: str) -> RunFolder:
        """Use ``run-dir`` if given (it must not hold a finished run) or make a new folder."""
        path = given_run_dir(results)
        if path is not None:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path = new_run_dir(results.results_dir, name)
        return cls(path)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_text(self, name: str, text: str) -> None:
        write_atomic(self.path / name, lambda f: f.write(text.encode()))

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, json.dumps(obj, indent=2, default=json_default) + "\n")

    def write_info(self, info: RunInfo) -> None:
        """Write run.json for a run in progress or ending; refused once an outcome is
        recorded, so a ServerApp that lost its owner cannot overwrite the owner's
        "crashed" or "interrupted" with its own ending."""
        current = read_run_info(self.path).get("status")
        if current in OUTCOMES:
            raise OutcomeAlreadyRecorded(
                f"{self.path / RUN_INFO} already records the outcome {current!r}; this "
                "process no longer owns the run and stops without writing.")
        self.write_json(RUN_INFO, info.to_json())

    def reopen(self, note: dict[str, Any]) -> None:
        """Mark a crashed, interrupted or failed run as running again (its owner resumes
        it): the one deliberate exception to recording an outcome once."""
        info = read_run_info(self.path)
        earlier = {"status": info.get("status"), "error": info.get("error"), **note}
        self.write_json(RUN_INFO, {**{k: v for k, v in info.items() if k != "error"},
                                   "status": "running",
                                   "resumed": [*info.get("resumed", []), earlier]})

    def write_config(self, cfg: RunConfig) -> None:
        self.write_text("config.toml", "# Fully resolved run config of this run.\n"
                        + to_toml(cfg))

    def append_round(self, record: RoundRecord) -> None:
        """Append one round to the ledger and force it to disk."""
        self.append_jsonl(METRICS, record.to_json())

    def append_jsonl(self, name: str, record: Mapping[str, Any]) -> None:
        """Append one JSON line to ``name`` and force it to disk."""
        append_line(self.path / name, json.dumps(record, default=json_default))


def json_default(obj: Any) -> Any:
    """What the result files' JSON does with numpy values and paths."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def read_run_info(run_dir: str | Path, prefix: str = "") -> dict[str, Any]:
    """A run's run.json ({} while there is none); ConfigError naming the file when it is
    damaged."""
    path = Path(run_dir) / RUN_INFO
    if not path.exists() and not path.is_symlink():
        return {}
    text = read_text(path, prefix)
    try:
        info = json.loads(text)
    except ValueError as exc:
        raise damaged(path, f"is not JSON ({exc})", prefix) from None
    if not isinstance(info, dict):
        raise damaged(path, f"holds a {type(info).__name__}, not the object fedpriv writes",
                      prefix)
    return info


def run_identity(run_dir: str | Path, results: ResultsConfig) -> str:
    """The id a run's clients key their state by: the one run.json recorded (a resume),
    else the config's, else a new random one (a new run)."""
    recorded = read_run_info(run_dir).get("run-id") if (Path(run_dir) / RUN_INFO).is_file() \
        else None
    return str(recorded or results.run_id or uuid.uuid4().hex)


def read_saved_config(run_dir: str | Path, prefix: str) -> dict[str, Any]:
    """The config.toml a run wrote, as its key-value table; ConfigError (starting with
    ``prefix``) when it is missing, not TOML or empty."""
    path = Path(run_dir) / "config.toml"
    if not path.exists() and not path.is_symlink():
        raise damaged(path, "is missing (every run folder has the config it ran with)", prefix)
    try:
        saved = tomllib.loads(read_text(path, prefix))
    except tomllib.TOMLDecodeError as exc:
        raise damaged(path, f"is not TOML ({exc})", prefix) from None
    if not saved:
        raise damaged(path, "holds no keys (fedpriv writes every key of the run's config)",
                      prefix)
    return saved
