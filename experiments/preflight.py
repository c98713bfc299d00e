"""Checks that need the data, run by the CLI before any SuperLink or Ray process starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.config import ConfigError
from tasks.models import build_model, count_parameters, resolve_model_name
from tasks.splits import dataset_for, partitions_for


@dataclass
class Preflight:
    dataset: str
    model: str
    parameters: int
    sizes: list[int]


def absolutize(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Make folder keys absolute: the ServerApp runs in another process."""
    out = dict(cfg)
    for key in ("data-dir", "results-dir", "run-dir"):
        if out.get(key):
            out[key] = str(Path(str(out[key])).expanduser().resolve())
    return out


def preflight(cfg: Mapping[str, Any]) -> Preflight:
    """Load the dataset, build the model and partition the data exactly as the run will.

    Raises :class:`ConfigError` for anything that would make the run fail: missing
    data, a model that does not fit the data, an infeasible partitioning, an
    unwritable results folder.
    """
    results = Path(str(cfg["results-dir"]))
    try:
        results.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"results-dir {str(results)!r} cannot be created: {exc}.") from exc
    data = dataset_for(cfg)
    name = resolve_model_name(str(cfg["model"]), data.input_shape)
    model = build_model(name, data.input_shape, data.num_classes, str(cfg["mlp-hidden"]))
    parts = partitions_for(cfg, int(cfg["num-clients"]))
    return Preflight(data.summary(), name, count_parameters(model), [len(p) for p in parts])
