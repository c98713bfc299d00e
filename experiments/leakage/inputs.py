"""What `fedpriv attack` is given: a run folder's config and observations, the ones asked
for, and the refusals (before any work) of what cannot be attacked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from privacy.attacks.observation import Observation
from privacy.attacks.registry import (
    ATTACKS,
    aggregate_attacks,
    attacks_scored_as,
    reference_attacks,
)
from server.observe import FOLDER
from tasks.config import KEYS, ConfigError, LeakageConfig, RunConfig, parse_assignment, validate
from tasks.results.folder import read_run_info, read_saved_config
from tasks.splits import model_for


def load(run_dir: Path, sets: Sequence[str] = ()) -> tuple[RunConfig, list[Observation]]:
    """The run's config (with attack settings overridden) and its observations."""
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"{run_dir} is not a fedpriv run folder (no config.toml).")
    status = _status(run_dir)
    if status == "running":
        raise ConfigError(f"{run_dir} is still running (run.json says so): attack it once it "
                          "has ended. If its fedpriv process was killed, fedpriv marks it "
                          "crashed within seconds.")
    values = read_saved_config(run_dir, "fedpriv attack")
    for text in sets:
        key, value = parse_assignment(text)
        if key not in LeakageConfig.ATTACK_SETTINGS:
            what = "a fact of the run" if key in KEYS else "not a run-config key"
            raise ConfigError(f"--set {key}: {what}. Only the attack settings can change "
                              f"after the run: {', '.join(LeakageConfig.ATTACK_SETTINGS)}.")
        values[key] = value
    cfg = validate(values)
    observations = _observations(run_dir / FOLDER) if (run_dir / FOLDER).is_dir() else []
    if not observations:
        raise ConfigError(f"{run_dir} has no observations: the run observed nothing "
                          "(leakage-rounds was empty). Run it again with e.g. --set "
                          "leakage-rounds=1.")
    return cfg, observations


def _status(run_dir: Path) -> str | None:
    """run.json's status (None without one); a damaged run.json is refused now, not after
    the attacks, when their results are recorded in it."""
    return read_run_info(run_dir, "fedpriv attack").get("status")


def _observations(folder: Path) -> list[Observation]:
    """Every observation in ``folder``; a damaged one is named, not a traceback."""
    out = []
    for meta in sorted(folder.glob("round-*.json")):
        try:
            out.append(Observation.load(meta))
        except Exception as exc:  # JSON, missing keys, a missing or truncated .npz
            raise ConfigError(f"the observation {meta} (with {meta.with_suffix('.npz').name}) "
                              f"is damaged ({type(exc).__name__}: {exc}); restore it, or "
                              "remove both files to attack the others.") from None
    return sorted(out, key=lambda o: (o.round, -1 if o.client is None else o.client))


def select(observations: list[Observation], rounds: Sequence[int] | None,
           clients: Sequence[int] | None) -> list[Observation]:
    """The observations asked for; asking for one that was not made is an error."""
    have = sorted({(o.round, o.client) for o in observations},
                  key=lambda rc: (rc[0], -1 if rc[1] is None else rc[1]))
    listed = ", ".join(f"round {r} {'aggregate' if c is None else f'client {c}'}"
                       for r, c in have)
    picked = [o for o in observations if (rounds is None or o.round in rounds)
              and (clients is None or o.client in clients)]
    for r in rounds or []:
        if not any(o.round == r for o in observations):
            raise ConfigError(f"round {r} was not observed; the run observed: {listed}.")
    for c in clients or []:
        if not any(o.client == c for o in observations):
            raise ConfigError(f"client {c} was not observed; the run observed: {listed}.")
    return picked


def check(cfg: RunConfig, observations: list[Observation], attacks: Sequence[str]) -> None:
    """Refuse, before any work, what cannot be attacked."""
    for name in attacks:
        if name not in ATTACKS:
            raise ConfigError(ATTACKS.unknown(name))
    needs_data = [a for a in attacks if a in reference_attacks()]
    if needs_data and cfg.leakage.reference_fraction <= 0:
        raise ConfigError(f"{', '.join(needs_data)} train reference updates on the server's "
                          "own auxiliary data, and this run kept none (reference-fraction = "
                          "0, a fact of the run: it decides the clients' partitions). Run "
                          "again with e.g. --set reference-fraction=0.2.")
    audits = [a for a in attacks if a in attacks_scored_as("audit")]
    if audits and not cfg.leakage.canaries:
        what = "the audit needs" if audits == ["audit"] else f"{audits} need"
        raise ConfigError(f"{what} canaries inserted during the run, and this run had "
                          "canaries = 0. Run again with canaries = 100 (and 'audit' in "
                          "attacks).")
    # attacks scored against the client's records, which then include its canaries
    mixed = [a for a in attacks if a in attacks_scored_as("labels", "reconstruction")]
    if cfg.leakage.canaries and mixed:
        raise ConfigError(f"{', '.join(mixed)} on a run with canaries: the audited client's "
                          "update also holds its canary rows, so what they recover would be "
                          "scored against records that are not all its data. Run them on a "
                          "run without canaries.")
    model, _ = model_for(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for o in observations:
        seen = {k: tuple(np.shape(v)) for k, v in o.sent.items()}
        if seen != shapes:
            raise ConfigError(f"{o.name}: the observed weights do not fit the run's model "
                              f"({cfg.training.model}); the observation comes from another "
                              "model or was damaged.")
        if o.client is None:
            whole = aggregate_attacks()
            bad = [a for a in attacks if a not in whole]
            if bad:
                raise ConfigError(f"{o.name}: the server saw only the aggregate (secure "
                                  f"aggregation, or leakage-clients = 'aggregate'); {bad} need "
                                  f"one client's update. Only {', '.join(whole)} can run on "
                                  "the aggregate.")


