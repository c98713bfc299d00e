"""Per-round checkpoints, and what `fedpriv run --resume` checks before it continues a run.

After every recorded round the server writes ``<run>/checkpoint/server.npz``
atomically (a temporary file, fsync, rename): the round number, the global model, the
round runner's state (FedAdam's moments, FedAvgM's momentum, DP-FedAvg's accountant
and clipping norm: the aggregation's ``state()``), the privacy and anonymization logs and
run.json's running fields. Each client keeps its own state (its DP-SGD ledger, its
CVAE) on its own side (:mod:`clients.state_store`; in simulation under
``<run>/checkpoint/clients``). Sampling, DP noise and every client's training are
seeded from the run seed and the round number, so nothing else needs saving: a run
resumed from round R goes on exactly as an uninterrupted one would.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from strategies.aggregation import State as RunnerState
from strategies.rounds import RoundResult
from strategies.runner import RoundRunner
from tasks.config import ConfigError, RunConfig, validate
from tasks.files import write_atomic
from tasks.results.folder import OUTCOMES, RUN_INFO, json_default, read_run_info, read_saved_config
from tasks.results.info import RunInfo
from tasks.results.ledger import METRICS, RoundRecord, read_ledger

from .privacy_log import AnonymizationLog, PrivacyLog

FOLDER = "checkpoint"
SERVER_FILE = "server.npz"
CLIENTS = "clients"  # each simulated client's own state (clients.state_store)


class ResumeError(RuntimeError):
    """The run cannot be resumed as asked without breaking a privacy guarantee."""


@dataclass
class Checkpoint:
    """The server's state after round ``round``."""

    round: int
    model: ArrayRecord
    runner: RunnerState
    privacy: dict[str, Any] = field(default_factory=dict)
    anonymization: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # run.json as it was then
    config: dict[str, Any] = field(default_factory=dict)  # resume_config() of the run

    def save(self, run_dir: Path) -> None:
        folder = run_dir / FOLDER
        folder.mkdir(exist_ok=True)
        keys = list(self.model.keys())
        meta = {"round": self.round, "model-keys": keys, "runner": self.runner[0],
                "privacy": self.privacy, "anonymization": self.anonymization,
                "info": self.info, "config": self.config}
        arrays = {f"model.{i}": self.model[k].numpy() for i, k in enumerate(keys)}
        arrays.update({f"runner.{k}": v for k, v in self.runner[1].items()})
        blob = np.frombuffer(json.dumps(meta, default=json_default).encode(), dtype=np.uint8)
        write_atomic(folder / SERVER_FILE, lambda f: np.savez(f, meta=blob, **arrays))

    @classmethod
    def load(cls, run_dir: Path) -> Checkpoint:
        """The checkpoint of ``run_dir``; ConfigError naming the file when it is damaged."""
        path = run_dir / FOLDER / SERVER_FILE
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(z["meta"].tobytes().decode())
                model = ArrayRecord({k: Array(z[f"model.{i}"])
                                     for i, k in enumerate(meta["model-keys"])})
                runner = {k[len("runner."):]: z[k] for k in z.files
                          if k.startswith("runner.")}
            return cls(int(meta["round"]), model, (meta["runner"], runner), meta["privacy"],
                       meta["anonymization"], meta["info"], meta.get("config", {}))
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            raise ConfigError(
                f"--resume: the checkpoint {path} is damaged ({type(exc).__name__}: {exc}); "
                "it cannot be resumed from. Restore the file from a backup, or start the run "
                "again as a new run.") from None


class CheckpointHook:
    """Writes the checkpoint after each recorded round (:class:`server.loop.RoundHook`)."""

    def __init__(self, run_dir: Path, runner: RoundRunner, privacy: PrivacyLog,
                 anonymization: AnonymizationLog, info: RunInfo,
                 config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.runner = runner
        self.privacy = privacy
        self.anonymization = anonymization
        self.info = info
        self.config = config

    def after_round(self, record: RoundRecord, arrays: ArrayRecord,
                    result: RoundResult) -> None:
        Checkpoint(record.round, arrays, self.runner.state(), self.privacy.state(),
                   self.anonymization.state(), self.info.to_json(), self.config
                   ).save(self.run_dir)

    def finish(self) -> None:
        return None


def resume_config(cfg: RunConfig) -> dict[str, Any]:
    """The config a resume must find unchanged: every key but where the run lives and
    whether it is a resume."""
    return {k: v for k, v in cfg.flat().items() if k not in ("run-dir", "resume")}


def needs_client_state(cfg: RunConfig) -> bool:
    """Whether the clients hold state a resume must not lose (a DP ledger, a CVAE)."""
    return cfg.privacy.dp == "local" or cfg.anonymization.anonymizer == "cvae-federated"


def resumable(run_dir: str | Path) -> tuple[Path, RunConfig]:
    """The run folder and its config, checked to be resumable: ConfigError (what is
    wrong, what to do) before any work when it is not a run, finished, still running,
    has no checkpoint, a damaged file, files that disagree (checkpoint, ledger, config,
    run id), or its clients kept no state that its privacy depends on."""
    path = Path(run_dir).expanduser().resolve()
    if not (path / RUN_INFO).is_file() or not (path / "config.toml").is_file():
        raise ConfigError(
            f"--resume {str(run_dir)!r}: not a fedpriv run folder (it has no run.json and "
            "config.toml). Give the folder `fedpriv run` printed, e.g. "
            "results/20261122-101500-mnist-fedavg-iid.")
    info = read_run_info(path, f"--resume {str(path)!r}")
    status = info.get("status", "running")
    if status == "finished":
        raise ConfigError(f"--resume {str(path)!r}: this run already finished; there is "
                          "nothing to resume. Start a new run with more rounds instead.")
    if status not in OUTCOMES:
        raise ConfigError(
            f"--resume {str(path)!r}: run.json says the run is still {status!r}. If its "
            "fedpriv process is still running, wait for it or stop it (Ctrl-C); a killed "
            "one is marked 'crashed' by fedpriv's keeper within seconds.")
    if not (path / FOLDER / SERVER_FILE).is_file():
        raise ConfigError(
            f"--resume {str(path)!r}: the run {status} before its first round was "
            "checkpointed (or ran with checkpoint = false), so there is nothing to continue "
            "from. Start it again as a new run.")
    saved = read_saved_config(path, f"--resume {str(path)!r}")
    cfg = validate({**saved, "run-dir": str(path), "resume": True})
    if needs_client_state(cfg) and not info.get("client-state"):
        raise ConfigError(
            f"--resume {str(path)!r}: its clients' state (DP-SGD ledgers or CVAE) was not "
            "kept (the run used real SuperNodes without a state-dir), so resuming would "
            "reset their epsilon. Start it again as a new run.")
    _agree(path, cfg, info, Checkpoint.load(path))
    return path, cfg


def _agree(path: Path, cfg: RunConfig, info: dict[str, Any], checkpoint: Checkpoint) -> None:
    """The checkpoint, the ledger, the config and the run id must tell one story."""
    where = f"--resume {str(path)!r}"
    if checkpoint.config:
        now_cfg = resume_config(cfg)
        changed = sorted(k for k in {*checkpoint.config, *now_cfg}
                         if checkpoint.config.get(k) != now_cfg.get(k))
        if changed:
            what = ", ".join(f"{k}: {checkpoint.config.get(k)!r} -> {now_cfg.get(k)!r}"
                             for k in changed[:5])
            raise ConfigError(f"{where}: config.toml was changed since round "
                              f"{checkpoint.round} was checkpointed ({what}). A resume goes "
                              "on with the config it started with: put the old values back, "
                              "or start a new run with the new ones.")
    rounds = cfg.federation.num_server_rounds
    if not 1 <= checkpoint.round <= rounds:
        raise ConfigError(f"{where}: the checkpoint says round {checkpoint.round}, but the "
                          f"run has {rounds} rounds (config.toml): the files do not belong "
                          "together. Restore them, or start a new run.")
    ids = {name: value for name, value in (("run.json", info.get("run-id")),
                                           ("config.toml", cfg.results.run_id),
                                           ("the checkpoint", checkpoint.info.get("run-id")))
           if value}
    if len(set(ids.values())) > 1:
        raise ConfigError(f"{where}: the run's files name different runs ("
                          + ", ".join(f"{k}: {v}" for k, v in ids.items()) + "): they were "
                          "mixed from several run folders. Restore this run's own files.")
    have = [r.round for r in read_ledger(path, where)]
    want = list(range(1, checkpoint.round + 1))
    if have[:checkpoint.round] != want:
        raise ConfigError(f"{where}: the checkpoint is after round {checkpoint.round}, but "
                          f"{METRICS} holds rounds {have or 'none'}: the ledger of the "
                          "checkpointed rounds is missing or damaged, and a resume would "
                          "finish with a ledger that does not cover the run. Restore "
                          f"{METRICS}, or start a new run.")


def rewind_ledger(run_dir: Path, last_round: int) -> list[RoundRecord]:
    """Keep the ledger's rounds up to ``last_round`` (a round recorded after the last
    checkpoint is run again); returns them."""
    kept = [r for r in read_ledger(run_dir) if r.round <= last_round]
    text = "".join(json.dumps(r.to_json(), default=json_default) + "\n" for r in kept)
    write_atomic(run_dir / METRICS, lambda f: f.write(text.encode()))
    return kept
