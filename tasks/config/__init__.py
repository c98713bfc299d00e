"""The run config: every key fedpriv understands, typed, checked, and grouped in sections.

The sections in :mod:`.sections` are the single source of truth: ``--help``,
docs/CONFIG.md and pyproject.toml's ``[tool.flwr.app.config]`` are generated from them
(tests keep the last two in sync), and the ServerApp, the ClientApp and the CLI all
parse a flat run config through :func:`validate` before doing any work. Allowed names
come from the registries (datasets, partitioners, models, anonymizers, attacks, ...),
after the modules the ``plugins`` key names have been imported (:mod:`.plugins`), so a
name a plugin registers is allowed in every process. The strategy is checked above this
layer, where the strategies are (:mod:`strategies.registry`).
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from typing import Any

import tomli_w

from ..errors import ConfigError
from .checks import cross_checks
from .keys import Key, Scalar
from .plugins import load_plugins, plugin_roots
from .sections import (
    SECTIONS,
    AnonymizationConfig,
    DataConfig,
    EmbeddingsConfig,
    FederationConfig,
    LeakageConfig,
    MemorizationConfig,
    PluginsConfig,
    PrivacyConfig,
    ResourcesConfig,
    ResultsConfig,
    RunConfig,
    SecAggConfig,
    TrainingConfig,
    parse_hidden,
    unknown_key,
)

SCHEMA: tuple[Key, ...] = tuple(k for _, section in SECTIONS for k in section.keys())
KEYS: dict[str, Key] = {k.name: k for k in SCHEMA}

__all__ = ["KEYS", "SCHEMA", "AnonymizationConfig", "ConfigError", "DataConfig",
           "EmbeddingsConfig", "FederationConfig", "Key", "LeakageConfig",
           "MemorizationConfig", "PluginsConfig",
           "PrivacyConfig", "ResourcesConfig", "ResultsConfig", "RunConfig", "Scalar",
           "SecAggConfig", "TrainingConfig", "defaults", "parse_assignment", "parse_hidden",
           "plugin_roots", "to_toml", "validate", "validate_partial"]


def defaults() -> dict[str, Scalar]:
    """The default run config, flat."""
    return {k.name: k.default for k in SCHEMA}


def _parse(values: Mapping[str, Any]) -> tuple[dict[str, Scalar], list[str]]:
    out: dict[str, Scalar] = {}
    errors = []
    if "plugins" in values:  # first: the other keys may name what the plugins register
        try:
            errors += load_plugins(str(KEYS["plugins"].parse(values["plugins"])))
        except ConfigError:
            pass  # reported with the other keys below
    for name, value in values.items():
        key = KEYS.get(name)
        if key is None:
            errors.append(unknown_key(name))
            continue
        try:
            out[name] = key.parse(value)
        except ConfigError as exc:
            errors.append(str(exc))
    return out, errors


def _raise(errors: list[str]) -> None:
    if errors:
        raise ConfigError("Invalid run config:\n  - " + "\n  - ".join(errors))


def validate_partial(values: Mapping[str, Any]) -> dict[str, Scalar]:
    """Check only the given keys and return them typed (presets, sweep grids)."""
    out, errors = _parse(values)
    _raise(errors)
    return out


def validate(values: Mapping[str, Any] | RunConfig) -> RunConfig:
    """Parse a flat run config (defaults for missing keys) into a typed :class:`RunConfig`.

    Unknown keys, wrong types, out-of-range values and impossible combinations are all
    reported at once in one :class:`ConfigError`.
    """
    if isinstance(values, RunConfig):
        return values
    try:  # a client validates its run config with every message: parse each config once
        key = frozenset(values.items())
    except TypeError:  # an unhashable value (a list from TOML): not cached
        return _validate(values)
    return _validate_cached(key)


@functools.lru_cache(maxsize=64)
def _validate_cached(items: frozenset) -> RunConfig:
    return _validate(dict(items))


def _validate(values: Mapping[str, Any]) -> RunConfig:
    parsed, errors = _parse(values)
    _raise(errors)
    flat = {**defaults(), **parsed}
    cfg = RunConfig(**{name: section.from_values(flat) for name, section in SECTIONS})
    _raise(cross_checks(cfg))
    return cfg


def parse_assignment(text: str) -> tuple[str, Any]:
    """Parse one ``key=value`` from the command line; the value is read as TOML when it can be."""
    if "=" not in text:
        raise ConfigError(
            f"--set {text!r} is not of the form key=value (e.g. --set num-clients=20).")
    name, raw = text.split("=", 1)
    # spaces around either side go; a newline or tab stays, and is refused as what it is
    name, raw = name.strip(), raw.strip(" ")
    if not name:
        raise ConfigError(f"--set {text!r} has no key before '='; the form is key=value "
                          "(e.g. --set num-clients=20).")
    if name not in KEYS and name.replace("_", "-") in KEYS:
        name = name.replace("_", "-")  # num_clients=3, as the Python API spells it
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words such as dataset=cifar10 are taken as text
    key = KEYS.get(name)
    if key is not None and isinstance(key.default, str) and not isinstance(value, str):
        value = raw  # a text key given a number or list, e.g. leakage-rounds=1,5
    return name, value


def to_toml(values: Mapping[str, Scalar] | RunConfig) -> str:
    """A flat config as TOML ``key = value`` lines (tomli-w escapes what TOML needs)."""
    flat = values.flat() if isinstance(values, RunConfig) else dict(values)
    return tomli_w.dumps(flat)
