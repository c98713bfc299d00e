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

import contextlib
import json
import os
import tempfile
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
from tasks.files import explain, write_atomic
from tasks.results.folder import OUTCOMES, RUN_INFO, json_default, read_run_info, read_saved_config
from tasks.results.info import RunInfo
from tasks.results.ledger import METRICS, RoundRecord, read_ledger

from .client_state import ClientStateRefused, saved_state_problems, state_folder
from .client_state import ResumeError as ResumeError  # raised on a resume; here by its name
from .privacy_log import AnonymizationLog, PrivacyLog

FOLDER = "checkpoint"
SERVER_FILE = "server.npz"
CLIENTS = "clients"  # each simulated client's own state (clients.state_store)


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
                _check_meta(meta)
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


def _check_meta(meta: Any) -> None:
    """TypeError naming the field unless the checkpoint's description has the types
    :meth:`Checkpoint.save` writes."""
    if not isinstance(meta, dict):
        raise TypeError(f"its description is a {type(meta).__name__}, not an object")
    kinds = {"round": int, "model-keys": list, "runner": dict, "privacy": dict,
             "anonymization": dict, "info": dict, "config": dict}
    for key, kind in kinds.items():
        value = meta.get(key, {} if key == "config" else None)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError(f"{key} is {type(value).__name__}, not {kind.__name__}")
    if not all(isinstance(k, str) for k in meta["model-keys"]):
        raise TypeError("model-keys holds a name that is not text")


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
    _check_info(path, info)
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
    why = cannot_resume(cfg, info)
    if why is not None:
        raise ConfigError(f"--resume {str(path)!r}: {why}. Start it again as a new run.")
    checkpoint = Checkpoint.load(path)
    _agree(path, cfg, info, checkpoint)
    check_model(path, cfg, checkpoint)
    _check_client_state(path, cfg, info, checkpoint)
    check_room(path, f"--resume {str(path)!r}")
    return path, cfg


def cannot_resume(cfg: RunConfig, info: dict[str, Any]) -> str | None:
    """Why a run with this config and run.json can never be resumed, whatever its files
    (None when it can): a resume would reset or break what its epsilon depends on."""
    if needs_client_state(cfg) and not info.get("client-state"):
        return ("its clients' state (DP-SGD ledgers or CVAE) was not kept (the run used "
                "real SuperNodes without a state-dir), so resuming would reset their epsilon")
    p = cfg.privacy
    correlated = p.central_mechanism in ("tree", "blt") or (
        p.central_mechanism == "banded-mf" and (p.mf_bands or p.cyclic_groups) > 1)
    if p.dp == "central" and correlated and p.secure_rng:
        return (f"its {p.central_mechanism} noise is correlated across rounds and was drawn "
                "from OS entropy (secure-rng), so the noise still owed to the rounds already "
                "released cannot be rebuilt: a resume would break the factorization's "
                "schedule and its epsilon (run without secure-rng to be able to resume)")
    return None


def _check_info(path: Path, info: dict[str, Any]) -> None:
    """ConfigError naming run.json's key unless what a resume reads of it has the types
    fedpriv writes."""
    text = ("status", "run-id", "client-state", "error")
    bad = [k for k in text if info.get(k) is not None and not isinstance(info[k], str)]
    resumed = info.get("resumed", [])
    if not isinstance(resumed, list) or not all(isinstance(r, dict) for r in resumed):
        bad.append("resumed")
    if bad:
        raise ConfigError(
            f"--resume {str(path)!r}: {path / RUN_INFO} is damaged ({', '.join(bad)}: "
            f"{', '.join(type(info[k]).__name__ for k in bad)}, where fedpriv writes "
            f"{'a list of objects' if bad == ['resumed'] else 'text'}); restore the file "
            "fedpriv wrote (from a backup), or start a new run.")


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
    try:
        have = [int(r.round) for r in read_ledger(path, where)]
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{where}: {path / METRICS} is damaged (a line of the wrong kind: "
                          f"{type(exc).__name__}: {exc}); restore the file fedpriv wrote (from "
                          "a backup), or start a new run.") from None
    want = list(range(1, checkpoint.round + 1))
    if have[:checkpoint.round] != want:
        raise ConfigError(f"{where}: the checkpoint is after round {checkpoint.round}, but "
                          f"{METRICS} holds rounds {have or 'none'}: the ledger of the "
                          "checkpointed rounds is missing or damaged, and a resume would "
                          "finish with a ledger that does not cover the run. Restore "
                          f"{METRICS}, or start a new run.")


def check_model(path: Path, cfg: RunConfig, checkpoint: Checkpoint) -> None:
    """ConfigError unless the checkpoint's model is one the run can train on: finite
    weights, of the names, shapes and kind the run's model has (what every client would
    otherwise fail on, each with its traceback, in the first resumed round)."""
    where = f"--resume {str(path)!r}: the checkpoint {path / FOLDER / SERVER_FILE}"
    arrays = {k: checkpoint.model[k].numpy() for k in checkpoint.model.keys()}
    kinds = [k for k, a in arrays.items() if not (
        np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_)
        or np.issubdtype(a.dtype, np.complexfloating)]
    if kinds:
        raise ConfigError(f"{where} holds {kinds[0]} as {arrays[kinds[0]].dtype}, not real "
                          "numbers: the file is damaged. Restore it from a backup, or start "
                          "a new run.")
    bad = [k for k, a in arrays.items()
           if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all()]
    if bad:
        raise ConfigError(
            f"{where} holds NaN or infinite weights after round {checkpoint.round} (in "
            f"{len(bad)} of its {len(arrays)} tensors, e.g. {bad[0]}): the model had diverged "
            "(or the file is damaged), so every client would refuse to train on it. Start a "
            "new run (e.g. with a lower lr or less DP noise), or restore an earlier "
            "checkpoint from a backup.")
    expected = _model_shapes(cfg)
    if expected is None:
        return
    got = {k: tuple(a.shape) for k, a in arrays.items()}
    if got != expected:
        diff = [f"{k}: {got.get(k, 'missing')} where the model has {expected.get(k, 'none')}"
                for k in sorted({*got, *expected}, key=str) if got.get(k) != expected.get(k)]
        raise ConfigError(
            f"{where} does not fit the run's model ({len(diff)} tensor(s) differ, e.g. "
            f"{'; '.join(diff[:3])}): it is another model's checkpoint or a damaged file. "
            "Restore this run's own checkpoint/server.npz, or start a new run.")


def _model_shapes(cfg: RunConfig) -> dict[str, tuple[int, ...]] | None:
    """The names and shapes of the run's model (built without memory, on torch's meta
    device), or None when it cannot be built here (the pre-flight check then says why)."""
    try:
        import torch

        from tasks.datasets import dataset_meta
        from tasks.models import build_model
        from tasks.splits import feature_shape, model_name

        shape, name = feature_shape(cfg), model_name(cfg)  # may read the data: not on meta
        with torch.device("meta"):
            model = build_model(name, shape, dataset_meta(cfg.data.dataset).num_classes,
                                cfg.training.hidden)
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}
    except Exception:  # noqa: BLE001 - the pre-flight check reports what is wrong
        return None


def _check_client_state(path: Path, cfg: RunConfig, info: dict[str, Any],
                        checkpoint: Checkpoint) -> None:
    """A simulated run's clients keep their state in the run folder: check it before any
    client starts (:func:`server.client_state.saved_state_problems`). Real SuperNodes keep
    theirs on their hosts, asked before the first round instead."""
    recorded = str(info.get("client-state") or "")
    if Path(recorded).parts[-2:] != (FOLDER, CLIENTS) and not (path / FOLDER / CLIENTS).exists():
        return
    try:
        steps = {int(p): int(n) for p, n in dict(checkpoint.privacy.get("steps", {})).items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--resume {str(path)!r}: the checkpoint "
                          f"{path / FOLDER / SERVER_FILE} is damaged (its clients' DP-SGD "
                          f"steps: {type(exc).__name__}: {exc}); restore it from a backup, or "
                          "start a new run.") from None
    problems = saved_state_problems(path, cfg, steps)
    if problems:
        loss = ("restart their DP-SGD ledgers from zero and under-report epsilon"
                if cfg.privacy.dp == "local" else
                "lose their CVAE" if needs_client_state(cfg) else
                "fail every client that reads its file")
        raise ClientStateRefused(
            f"--resume {str(path)!r}: refusing to resume: " + "; ".join(problems) + ". The "
            f"clients' saved state is missing, damaged or another run's, so resuming would "
            f"{loss}. Restore the state files (this run's own partition-<id>.state) into "
            f"{state_folder(path, cfg)} from a backup, or start the run again as a new run.")


PROBE_BYTES = 1 << 16  # what the write probe writes at least (and removes)


def probe_write(folder: Path, size: int = PROBE_BYTES) -> None:
    """Write a hidden file of ``size`` bytes into ``folder``, force it to disk and remove
    it: OSError (ENOSPC, EROFS, EACCES, ...) when the folder cannot take such a file."""
    fd, name = tempfile.mkstemp(prefix=".fedpriv-write-probe-", dir=folder)
    try:
        chunk = memoryview(bytes(min(size, 1 << 20)))
        left = size
        while left > 0:
            left -= os.write(fd, chunk[:left])
        os.fsync(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)


def check_room(folder: Path, prefix: str) -> None:
    """ConfigError (one paragraph: the disk is full, read-only, ...) unless a file the size
    of the run's checkpoint can be written into ``folder`` and forced to disk: a resume
    rewrites run.json, the ledger and the checkpoint before and after its first round, so a
    full disk is refused before any of them is touched."""
    checkpoint = folder / FOLDER / SERVER_FILE
    size = checkpoint.stat().st_size if checkpoint.is_file() else 0
    try:
        probe_write(folder, max(PROBE_BYTES, size))
    except OSError as exc:
        raise ConfigError(
            f"{prefix}: {explain(folder / '.fedpriv-write-probe', exc)}. Nothing of the run "
            "was changed (every finished round is kept): free some space or make the folder "
            "writable, then resume it again.") from None


def refuse_resume_key(cfg: RunConfig) -> None:
    """ConfigError for a new run given ``resume = true`` (``--set resume=true``, a preset,
    the API): only ``fedpriv run --resume RUN_FOLDER`` continues a run, after checking its
    files (:func:`resumable`). Call before any work on a new run (``run_config``)."""
    if not cfg.results.resume:
        return
    run_dir = cfg.results.run_dir
    if not run_dir:
        raise ConfigError(
            "resume = true continues a crashed run, but this is a new run (no run-dir names "
            "one): there is nothing to resume. Drop resume = true to start a new run, or "
            "continue a crashed one with `fedpriv run --resume RUN_FOLDER`.")
    try:
        path = resumable(run_dir)[0]
    except ConfigError as exc:
        raise ConfigError(
            f"resume = true with run-dir = {run_dir!r}: that run cannot be continued ("
            f"{str(exc).rstrip('.')}). Drop resume = true (and name a new run-dir) to start "
            "a new run.") from None
    raise ConfigError(
        f"resume = true with run-dir = {run_dir!r}: a run is continued with `fedpriv run "
        f"--resume {path}` (or `fedpriv deploy run --resume {path}`), which checks its files "
        "and goes on with the config it started with; --set cannot change it. Use that "
        "instead, or drop resume = true and name a new run-dir for a new run.")


def rewind_ledger(run_dir: Path, last_round: int) -> list[RoundRecord]:
    """Keep the ledger's rounds up to ``last_round`` (a round recorded after the last
    checkpoint is run again); returns them."""
    kept = [r for r in read_ledger(run_dir) if r.round <= last_round]
    text = "".join(json.dumps(r.to_json(), default=json_default) + "\n" for r in kept)
    write_atomic(run_dir / METRICS, lambda f: f.write(text.encode()))
    return kept
