"""Runs as tidy tables: one row per round (round 0 = the initial model), snake_case columns
for every number the ledger holds, and the run's settings as columns, so that frames of
different runs concatenate into one table to compare (pandas, as a notebook expects)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tasks.config import RunConfig, defaults
from tasks.config.effect import idle_keys
from tasks.results.ledger import RoundRecord, headline_epsilon

if TYPE_CHECKING:
    import pandas

# the ledger's dict fields, flattened into columns under these prefixes
_SECTIONS = ("test", "train", "time", "privacy", "anonymization", "client_eval")


def snake(name: str) -> str:
    return name.replace("-", "_")


def _numbers(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Every number (and short text) in ``value`` as ``prefix_key`` columns, nested dicts
    joined with ``_``; lists (per-client detail) are left to the ledger."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _numbers(f"{prefix}_{snake(str(k))}", v, out)
    elif isinstance(value, bool) or value is None:
        out[prefix] = value
    elif isinstance(value, (int, float, str)):
        out[prefix] = value


def round_row(r: RoundRecord) -> dict[str, Any]:
    """One ledger record as a flat row."""
    row: dict[str, Any] = {"round": r.round}
    for section in _SECTIONS:
        value = getattr(r, section)
        if value:
            _numbers(section, value, row)
    row["epsilon"] = headline_epsilon(r.privacy)
    row.update(sampled=len(r.sampled), trained=len(r.clients), failures=len(r.failures),
               skipped=len(r.skipped), refused=r.refused, tampered=r.tampered)
    return row


def initial_row(info: Mapping[str, Any], config: RunConfig) -> dict[str, Any] | None:
    """Round 0: the initial model's evaluation (run.json's ``initial``), nothing spent."""
    initial = info.get("initial")
    if not initial:
        return None
    row: dict[str, Any] = {"round": 0}
    _numbers("test", initial, row)
    row["epsilon"] = 0.0 if config.privacy.dp != "none" else None
    return row


# where a run's files go: not settings that tell runs apart
_NOT_SETTINGS = ("results-dir", "run-dir", "run-id", "resume", "sweep-cells")


def changed(configs: Iterable[RunConfig]) -> list[str]:
    """The keys whose value differs from the default in any of ``configs`` (schema order):
    the settings that tell runs apart."""
    base = defaults()
    flats = [c.flat() for c in configs]
    return [k for k in base if k not in _NOT_SETTINGS and any(f[k] != base[k] for f in flats)]


def settings(config: RunConfig, keys: Sequence[str]) -> dict[str, Any]:
    """``keys`` of the run's config as snake_case columns; a key the run's mode ignores
    (``target-epsilon`` without local DP) is None, as it is in no label."""
    flat = config.flat()
    idle = idle_keys({k: flat[k] for k in keys}, config)
    return {snake(k): None if k in idle else flat[k] for k in keys}


def ledger_frame(ledger: Sequence[RoundRecord], info: Mapping[str, Any], config: RunConfig,
                 run: str, keys: Sequence[str]) -> pandas.DataFrame:
    """The run's rounds (0 first), its folder name and the config ``keys`` as columns."""
    try:
        import pandas as pd
    except ImportError as exc:  # pandas comes with mlxtend; the ledger is there without it
        raise ImportError("frame() needs pandas (pip install pandas); the same numbers "
                          "are in Result.ledger.") from exc
    rows = [r for r in [initial_row(info, config)] if r] + [round_row(r) for r in ledger]
    columns = ["run"] + list(dict.fromkeys(k for row in rows for k in row))
    given = settings(config, keys)
    frame = pd.DataFrame([{"run": run, **row} for row in rows], columns=columns)
    frame = frame.dropna(axis="columns", how="all")
    for k, v in given.items():  # settings last, kept even when None (concat lines up)
        frame[k] = v
    return frame.reset_index(drop=True)


def combine(frames: Sequence[pandas.DataFrame], keys: Sequence[str]) -> pandas.DataFrame:
    """Runs' frames in one, their settings (``keys``) as the last columns."""
    import pandas as pd

    out = pd.concat(frames, ignore_index=True)
    last = [snake(k) for k in keys]
    return out[[c for c in out.columns if c not in last] + last]
