"""Presets and --set overrides: reading them and turning them into a validated run config."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from server.tracking import require as require_tracking
from strategies.registry import STRATEGIES
from tasks.config import ConfigError, Key, RunConfig, parse_assignment, validate, validate_partial
from tasks.config.effect import describe_idle, idle_keys

from .dp_defaults import dp_sgd_settings

PRESETS = Path(__file__).resolve().parent / "presets"
SWEEPS = Path(__file__).resolve().parent / "sweeps"
# Keys whose names are registered above the schema's layer: the schema accepts any name;
# resolve() and the pre-flight check refuse an unregistered one, and --help lists them.
REGISTERED_ABOVE = {"strategy": STRATEGIES}


def check_registered(cfg: RunConfig) -> None:
    """ConfigError (one paragraph) for a name the schema cannot check (see REGISTERED_ABOVE)."""
    flat = cfg.flat()
    for name, registry in REGISTERED_ABOVE.items():
        registry.check(str(flat[name]), key=name)
    require_tracking(cfg)  # the tracker's library (the schema only knows its name)


def allowed(key: Key) -> str:
    """A key's allowed values as --help and docs/CONFIG.md show them."""
    registry = REGISTERED_ABOVE.get(key.name)
    return " | ".join(registry.names) if registry else key.describe_allowed()


def find_file(name: str, folder: Path, kind: str) -> Path:
    """A path as given, or ``<folder>/<name>.toml`` for a bare name."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    bundled = folder / (name if name.endswith(".toml") else f"{name}.toml")
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in folder.glob("*.toml"))
    close = difflib.get_close_matches(Path(name).stem, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    if "=" in name and not close:  # `fedpriv run num-clients=5`: a forgotten --set
        hint = f" A key=value is an override: did you mean --set {name}?"
    raise ConfigError(f"{kind} {name!r} not found: no such file, and no bundled {kind} of that "
                      f"name (bundled: {', '.join(names) or 'none'}).{hint}")


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}.") from exc
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start:exc.start + 1]
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start} is {bad!r}); TOML "
                          "files must be UTF-8. Save it as UTF-8, e.g. with `iconv -f latin1 "
                          f"-t utf-8 {path.name}`.") from None
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}); check that it is a "
                          "readable file.") from None


def read_preset(name: str) -> dict[str, Any]:
    """A preset: a flat TOML file of run-config keys (checked, not yet completed)."""
    path = find_file(name, PRESETS, "preset")
    values = read_toml(path)
    tables = [k for k, v in values.items() if isinstance(v, dict)]
    if tables:
        raise ConfigError(f"preset {path} has tables {tables}; a preset is a flat list of "
                          "run-config keys (key = value).")
    try:
        return validate_partial(values)
    except ConfigError as exc:
        raise ConfigError(f"in preset {path}: {exc}") from None


def resolve(preset: str | None, assignments: Iterable[str] = (),
            overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Defaults <- preset <- --set key=value <- typed ``overrides`` (the Python API's),
    validated as a whole; folders made absolute (the ServerApp runs in another process
    and another working directory)."""
    if preset is not None and not preset.strip():
        raise ConfigError("--config '' names no preset. Give a bundled preset's name (see "
                          "`fedpriv presets`) or a TOML file, or leave --config out to run "
                          "the defaults.")
    from_preset: dict[str, Any] = read_preset(preset) if preset else {}
    given: dict[str, Any] = {}
    for text in assignments:
        key, value = parse_assignment(text)
        given[key] = value
    given.update(overrides or {})
    tuned, note = dp_sgd_settings({**from_preset, **given})
    cfg = validate({**from_preset, **tuned, **given})
    check_registered(cfg)
    refuse_idle(given, cfg)
    for name, why in idle_keys(from_preset, cfg).items():
        if name not in given:
            print(f"note: preset {preset!r} sets {name} = {from_preset[name]!r}, which has "
                  f"no effect with {why}")
    if note:
        print(note)
    return absolutize(cfg)


def refuse_idle(given: Mapping[str, Any], cfg: RunConfig) -> None:
    """ConfigError when a key the user set does nothing in ``cfg``'s mode (a run that
    looks private and is not): every such key in one paragraph each."""
    lines = describe_idle(idle_keys(given, cfg), given)
    if lines:
        raise ConfigError("Invalid run config:\n  - " + "\n  - ".join(lines))


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else path


def absolutize(cfg: RunConfig) -> RunConfig:
    """The config with data-dir, results-dir and run-dir as absolute paths."""
    return replace(cfg, data=replace(cfg.data, data_dir=_absolute(cfg.data.data_dir)),
                   results=replace(cfg.results, results_dir=_absolute(cfg.results.results_dir),
                                   run_dir=_absolute(cfg.results.run_dir)))
