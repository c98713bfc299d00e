"""A run's effective settings, as every table and frame shows them: the value the run
used, or nothing for a key the run's mode never reads (``target-epsilon`` without local
DP), whatever its value. Which keys a mode reads is :func:`tasks.config.effect.unread_keys`'s
answer, from the same rules that refuse a key set without effect."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tasks.config import RunConfig
from tasks.config.effect import unread_keys


def inert(keys: Iterable[str], cfg: RunConfig) -> set[str]:
    """Of ``keys`` (dashed), those ``cfg``'s mode never reads, whatever their value."""
    return set(unread_keys(keys, cfg))


def effective(cfg: RunConfig, keys: Iterable[str]) -> dict[str, Any]:
    """``keys`` (dashed) -> the value ``cfg`` ran with; None for a key it never reads (or
    one that is no run-config key)."""
    keys = list(keys)
    flat, idle = cfg.flat(), inert(keys, cfg)
    return {k: None if k in idle else flat.get(k) for k in keys}
