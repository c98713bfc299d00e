"""A sweep file, read and checked: its cells (grid x variants, then [[cells]]) and seeds.

A sweep file names an optional base ``preset``, ``[fixed]`` keys for every cell and
a ``[grid]`` of lists. Every cell is checked against the schema before anything
starts; a cell whose data check or run fails is recorded and the sweep goes on.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import ConfigError, RunConfig, parse_assignment, validate, validate_partial
from tasks.files import safe_name

from ..configs import SWEEPS, find_file, read_preset, read_toml

PYTHON = Path("fedpriv.sweep(...)")  # where a sweep given from Python says it came from
MAX_CELLS = 10_000  # a sweep is run cell by cell: beyond this it is a typo, not a plan
SECTIONS = {"fixed": dict, "grid": dict, "cells": list, "variants": list}
EXAMPLES = {"fixed": "[fixed] with num-server-rounds = 5",
            "grid": "[grid] with num-clients = [5, 10]",
            "cells": "[[cells]] tables, each with keys",
            "variants": "[[variants]] tables, each crossed with the grid"}


@dataclass
class SweepSpec:
    name: str
    path: Path
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    extra: list[dict[str, Any]] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # empty: each cell once, its own seed
    variants: list[dict[str, Any]] = field(default_factory=list)  # crossed with the grid

    def cells(self) -> list[dict[str, Any]]:
        """Every combination of the grid (each once per [[variants]] table, when there are
        any), then the explicitly listed [[cells]]."""
        keys = list(self.grid)
        combos = itertools.product(*self.grid.values()) if keys else iter(((),))
        crossed = [{**dict(zip(keys, combo, strict=True)), **variant}
                   for combo in combos for variant in (self.variants or [{}])]
        crossed = [c for c in crossed if c] if (keys or self.variants) else []
        return crossed + [dict(c) for c in self.extra]

    @property
    def keys(self) -> list[str]:
        """The keys that vary between cells, for table columns."""
        out = list(self.grid)
        for cell in [*self.variants, *self.extra]:
            out += [k for k in cell if k not in out]
        return out


@dataclass
class Cell:
    index: int
    params: dict[str, Any]
    config: RunConfig | None
    status: str = "pending"
    error: str | None = None
    run_dir: Path | None = None
    result: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None  # set when the sweep repeats every cell over seeds

    @property
    def group(self) -> str:
        """The cell without its seed: the runs a table row's mean and interval are over."""
        return ", ".join(f"{k}={v}" for k, v in self.params.items()) or "base"

    @property
    def label(self) -> str:
        return self.group if self.seed is None else f"{self.group}, seed={self.seed}"

    @property
    def folder(self) -> str:
        """The cell's run folder under ``cells/``: its index (order, uniqueness) and the
        keys it sets, e.g. ``01-dp-local-eps5`` (:func:`cell_folder`)."""
        return cell_folder(self.index, {**self.params, **({} if self.seed is None
                                                          else {"seed": self.seed})})


SHORT_KEYS = {"target-epsilon": "eps", "max-epsilon": "eps", "noise-multiplier": "z",
              "dirichlet-alpha": "alpha", "num-clients": "clients", "num-server-rounds": "rounds",
              "noise-epsilon": "eps", "local-epochs": "epochs", "batch-size": "batch",
              "dbscan-eps": "eps", "dbscan-min-samples": "minpts", "mask-fraction": "mask",
              "pca-components": "pc", "cvae-latent": "latent", "cvae-beta": "beta",
              "noise-scale": "scale", "ksame-classwise": "classwise",
              "density-classwise": "classwise"}
BARE_VALUES = {"partitioner", "anonymizer", "strategy", "model", "dataset", "features"}
MAX_FOLDER = 48  # characters: the index keeps names unique, the rest is for people


def cell_folder(index: int, params: Mapping[str, Any]) -> str:
    """``<index>-<setting>-...``: the index (two digits at least) then each key the cell
    sets, short and in file-safe characters: ``dp=local, target-epsilon=5`` ->
    ``01-dp-local-eps5``; ``secure-aggregation='secagg+'`` -> ``secagg``."""
    pieces = []
    for key, value in params.items():
        if key == "secure-aggregation" and isinstance(value, bool):
            pieces.append("secagg" if value else "no-secagg")
        elif isinstance(value, bool):
            name = SHORT_KEYS.get(key, key)
            pieces.append(name if value else f"no-{name}")
        elif isinstance(value, (int, float)):
            pieces.append(f"{SHORT_KEYS.get(key, key)}{value:g}")
        elif key == "secure-aggregation":
            pieces.append({"off": "no-secagg", "secagg+": "secagg"}.get(value, str(value)))
        elif key == "dp":
            pieces.append(f"dp-{value}")
        elif key in BARE_VALUES:
            pieces.append(str(value))
        else:
            pieces.append(f"{key}-{value}")
    slug = safe_name("-".join(pieces)) if pieces else ""
    if len(slug) > MAX_FOLDER:  # cut at a word: the table and sweep.csv give every key
        slug = slug[:MAX_FOLDER + 1].rsplit("-", 1)[0]
    slug = slug.strip("-.")
    return f"{index:02d}-{slug}" if slug and slug != "run" else f"{index:02d}"


def _seeds(path: Path, raw: Mapping[str, Any], base: Mapping[str, Any],
           repeat: int | None) -> list[int]:
    """The sweep's seeds: its ``seeds = [...]``, or ``repeat`` seeds from the run seed on."""
    seeds = raw.get("seeds")
    if seeds is not None and repeat:
        raise ConfigError(f"sweep {path} lists seeds = {seeds} and --repeat {repeat} was given; "
                          "use one of them.")
    if repeat is not None:
        if not isinstance(repeat, int) or not 1 <= repeat <= 1000:
            raise ConfigError(f"--repeat {repeat!r}: give a whole number of seeds from 1 to "
                              "1000, e.g. --repeat 3.")
        first = int(validate_partial({"seed": base.get("seed", 42)})["seed"])
        return [first + k for k in range(repeat)] if repeat > 1 else []
    if seeds is None:
        return []
    if (not isinstance(seeds, list) or not seeds or len(set(map(str, seeds))) != len(seeds)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)):
        raise ConfigError(f"sweep {path}: seeds must be a list of distinct whole numbers, e.g. "
                          f"seeds = [1, 2, 3]; got {seeds!r}.")
    validate_partial({"seed": max(seeds)})
    validate_partial({"seed": min(seeds)})
    return list(seeds)


def load_sweep(name: str | Mapping[str, Any], overrides: Sequence[str] = (),
               values: Mapping[str, Any] | None = None, repeat: int | None = None
               ) -> SweepSpec:
    """Read and check a sweep file, or a sweep given as the file's tables (``{"grid":
    {...}, "fixed": {...}}``, from Python); schema errors in any cell stop the sweep before
    it starts; ``repeat`` runs every cell with that many seeds."""
    if isinstance(name, Mapping):
        raw, path = dict(name), PYTHON
    else:
        path = find_file(name, SWEEPS, "sweep")
        raw = read_toml(path)
    _check_layout(path, raw)
    base = _base(path, raw, overrides, values)
    spec = SweepSpec(str(raw.get("name", path.stem)), path, base, raw.get("grid", {}),
                     raw.get("cells", []), _seeds(path, raw, base, repeat),
                     raw.get("variants", []))
    if spec.seeds and any("seed" in c for c in spec.cells()):
        raise ConfigError(f"sweep {path}: seed varies in [grid] or [[cells]] and the sweep "
                          "also repeats over seeds; use one of them.")
    _check_cells(path, spec)
    return spec


def _check_layout(path: Path, raw: Mapping[str, Any]) -> None:
    """The file's top-level entries and sections: known, of the right kind, not empty, and
    not more than :data:`MAX_CELLS` cells."""
    unknown = set(raw) - {"name", "preset", "fixed", "grid", "cells", "variants", "seeds"}
    if unknown:
        raise ConfigError(f"sweep {path}: unknown top-level entries {sorted(unknown)}; allowed: "
                          "name, preset, seeds, [fixed], [grid], [[variants]], [[cells]].")
    for section, kind in SECTIONS.items():
        if section in raw and not isinstance(raw[section], kind):
            raise ConfigError(f"sweep {path}: {section} must be a "
                              f"{'table' if kind is dict else 'list of tables'}, got "
                              f"{type(raw[section]).__name__} {raw[section]!r}; e.g. "
                              f"{EXAMPLES[section]}.")
    grid = raw.get("grid", {})
    extra = raw.get("cells", [])
    if not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError(f"sweep {path}: [grid] must map keys to non-empty lists, e.g. "
                          "num-clients = [5, 10].")
    variants = raw.get("variants", [])
    for name, tables in (("cells", extra), ("variants", variants)):
        if not all(isinstance(c, dict) and c for c in tables):
            raise ConfigError(f"sweep {path}: [[{name}]] entries must be tables of keys.")
    if not grid and not extra and not variants:
        raise ConfigError(f"sweep {path}: give a [grid] of lists and/or [[cells]] tables.")
    size = (math.prod(len(v) for v in grid.values()) if grid else 1 if variants else 0) \
        * max(len(variants), 1)
    if size + len(extra) > MAX_CELLS:
        raise ConfigError(f"sweep {path} has {size + len(extra):,} cells (the [grid] alone "
                          f"{' x '.join(str(len(v)) for v in grid.values())}); at most "
                          f"{MAX_CELLS:,} are allowed. Split it into several sweeps.")


def _base(path: Path, raw: Mapping[str, Any], overrides: Sequence[str],
          values: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keys every cell starts from: preset <- [fixed] <- --set <- typed ``values``."""
    base: dict[str, Any] = {}
    if "preset" in raw:
        base.update(read_preset(str(raw["preset"])))
    try:  # every fixed value must be valid, even one the grid overrides in every cell
        base.update(validate_partial(raw.get("fixed", {})))
    except ConfigError as exc:
        raise ConfigError(f"sweep {path}, [fixed]: {exc}") from None
    for text in overrides:
        key, value = parse_assignment(text)
        base[key] = value
    base.update(values or {})  # typed overrides (the Python API's)
    return base


def _check_cells(path: Path, spec: SweepSpec) -> None:
    """Every cell validated as a whole; the first five errors in one ConfigError."""
    errors = []
    for params in spec.cells():
        try:
            validate({**spec.base, **params})
        except ConfigError as exc:
            errors.append(f"cell {params}: {exc}")
    if errors:
        raise ConfigError(f"sweep {path} has invalid cells:\n" + "\n".join(errors[:5]))
