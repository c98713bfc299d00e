"""``run.json``: what a run is and how it went, as one typed record.

:class:`RunInfo` is the one definition the ServerApp writes as the run goes (status,
set-up, progress, outcome) and everything else reads. The file stays a JSON object with
dashed keys; keys this version does not know are kept (``extra``), so an older or newer
run.json round-trips unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class RunInfo:
    """run.json, typed. Every field is optional in the file; None is left out of it."""

    status: str = "running"  # running, then finished, failed, crashed or interrupted
    started: str | None = None
    finished: str | None = None
    run_dir: str | None = None
    run_id: str | None = None  # what the clients key their state by (resume)
    versions: dict[str, str] | None = None
    # what ran
    dataset: str | None = None
    dataset_source: str | None = None
    model: str | None = None
    parameters: int | None = None
    backbone: dict[str, Any] | None = None
    num_clients: int | None = None
    runtime: str | None = None  # inprocess, ray or deployment (the last to carry the run)
    client_state: str | None = None  # where clients keep their state for a resume
    aggregation: dict[str, Any] | None = None  # the protocol, what the server can see
    cvae_phase: dict[str, Any] | None = None
    setup_s: float | None = None
    # as the run goes
    initial: dict[str, float] | None = None  # the initial model's test metrics
    anonymization: dict[str, Any] | None = None
    rounds_completed: int | None = None
    elapsed_s: float | None = None
    # at the end
    stopped_early: str | None = None
    diverged: dict[str, Any] | None = None  # the round whose model diverged, and the cause
    model_selection: dict[str, Any] | None = None
    robustness: list[dict[str, Any]] | None = None
    privacy: dict[str, Any] | None = None
    target_reached_round: int | None = None
    wall_s: float | None = None
    final: dict[str, Any] | None = None
    best: dict[str, Any] | None = None
    mean_round_s: float | None = None
    steady_round_s: float | None = None
    resumed: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or value is None or (f.name == "resumed" and not value):
                continue
            out[f.name.replace("_", "-")] = value
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunInfo:
        known = {f.name.replace("_", "-"): f.name for f in fields(cls) if f.name != "extra"}
        info = cls(**{known[k]: v for k, v in data.items() if k in known})
        info.extra = {k: v for k, v in data.items() if k not in known}
        return info

    def get(self, key: str, default: Any = None) -> Any:
        """A value by its run.json key (dashed), as readers of the file name it."""
        value = self.to_json().get(key)
        return default if value is None else value

    def update(self, values: Mapping[str, Any]) -> None:
        """Set values by their run.json keys (an outcome's ``final``, ``best``...)."""
        merged = RunInfo.from_json({**self.to_json(), **values})
        for f in fields(self):
            setattr(self, f.name, getattr(merged, f.name))
