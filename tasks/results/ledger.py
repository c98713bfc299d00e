"""The per-round ledger (``metrics.jsonl``): one typed record per finished round.

:class:`RoundRecord` is the one definition the ServerApp writes and the summary, the
plots, sweeps and tests read. The file stays JSON lines (one object per round, keys as
below with dashes), flushed as each round ends, so a crash keeps the finished rounds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..files import damaged, read_text

METRICS = "metrics.jsonl"


@dataclass
class RoundRecord:
    """What happened in one round, as the server saw it."""

    round: int
    test: dict[str, float]  # the server's evaluation on its held-out test set: loss, accuracy
    train: dict[str, Any]  # example-weighted train loss/accuracy (when disclosed), clients
    sampled: list[int]  # partition ids sampled to train
    clients: list[dict[str, Any]]  # what each client that trained sent (besides its update)
    failures: list[dict[str, Any]]  # error replies: partition id, error, phase
    time: dict[str, float]  # round-s, train-s, central-eval-s, elapsed-s
    privacy: dict[str, Any] | None = None  # epsilon spent so far (strategies/clients)
    anonymization: dict[str, Any] | None = None  # release scores so far
    skipped: list[dict[str, Any]] = field(default_factory=list)  # declined: DP budget, screen
    client_eval: dict[str, Any] | None = None  # federated evaluation on clients' own data
    refused: str | None = None  # why the round made no aggregate (HE: below the minimum cohort)
    tampered: str | None = None  # the server sent trap weights (server = malicious)

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or (f.name == "skipped" and not value):
                continue
            out[f.name.replace("_", "-")] = value
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RoundRecord:
        return cls(**{f.name: d[f.name.replace("_", "-")] for f in fields(cls)
                      if f.name.replace("_", "-") in d})

    @property
    def accuracy(self) -> float:
        return float(self.test["accuracy"])


def read_ledger(run_dir: str | Path, prefix: str = "") -> list[RoundRecord]:
    """The ledger of a run, one record per finished round (none without the file);
    ConfigError naming the file and line when it is damaged."""
    path = Path(run_dir) / METRICS
    if not path.exists() and not path.is_symlink():
        return []
    records = []
    for n, line in enumerate(read_text(path, prefix).splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(RoundRecord.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise damaged(path, f"has a damaged line {n} ({type(exc).__name__}: {exc})",
                          prefix) from None
    return records


def outcome(records: Sequence[RoundRecord]) -> dict[str, Any]:
    """Final and best test accuracy of a ledger, plus steady-state round time."""
    if not records:
        return {}
    best = max(records, key=lambda r: r.accuracy)
    times = [r.time["round-s"] for r in records]
    steady = times[1:] if len(times) > 1 else times
    return {
        "final": {"round": records[-1].round, **records[-1].test},
        "best": {"round": best.round, **best.test},
        "mean-round-s": sum(times) / len(times),
        "steady-round-s": sum(steady) / len(steady),
    }


def headline_epsilon(entry: Mapping[str, Any] | None) -> float | None:
    """The one epsilon that sums up a ledger privacy entry or a run's privacy summary:
    local DP-SGD -> the largest over clients; central DP -> the client-level epsilon."""
    if not entry:
        return None
    if entry.get("mode") in ("central", "distributed"):
        return entry.get("epsilon")
    if entry.get("mode") == "local":
        return entry.get("epsilon-max")
    return None
