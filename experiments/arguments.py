"""The Python API's arguments, checked before any work (no pre-flight child, no folder):
a wrong one is one :class:`ConfigError` paragraph naming it, what it takes and how to fix it."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tasks.config import ConfigError

Echo = Callable[[str], None]


def silent(line: str) -> None:
    """``echo=None``: no progress lines (the run's files are written as always)."""


def shown(value: Any) -> str:
    """``value`` as an error message shows it: its repr (cut short) and its type."""
    if value is None:
        return "None"
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} (type {type(value).__name__})"


def refused(call: str, arg: str, value: Any, accepts: str, fix: str) -> ConfigError:
    """One paragraph: which argument, what was given, what it takes, how to fix it."""
    return ConfigError(f"fedpriv.{call}: {arg} = {shown(value)} is not accepted; {arg} "
                       f"takes {accepts}. {fix}")


def flag(call: str, arg: str, value: Any) -> bool:
    """A yes/no argument: a bool only (``'yes'`` or 1 would read as True)."""
    if not isinstance(value, bool):
        raise refused(call, arg, value, "True or False",
                       f"Give a bool, e.g. {arg}=True (a text or a number is not read as one).")
    return value


def echo(call: str, value: Any) -> Echo:
    """``echo``: a function taking each progress line, or None for none."""
    if value is None:
        return silent
    if not callable(value):
        raise refused(call, "echo", value, "a function called with each progress line "
                       "(print, the default), or None for no progress lines",
                       "E.g. echo=None, or echo=lines.append to keep them in a list.")
    return value


def text(call: str, arg: str, value: Any, accepts: str, fix: str) -> str:
    if not isinstance(value, str):
        raise refused(call, arg, value, accepts, fix)
    return value


def folder(call: str, arg: str, value: Any, what: str, example: str) -> Path:
    """A folder argument: text or an ``os.PathLike`` (a ``pathlib.Path``), not empty."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str) or not text.strip():
        raise refused(call, arg, value, f"the path of {what}, as text or a pathlib.Path",
                       f"E.g. fedpriv.{call}({example!r}).")
    return Path(text).expanduser().resolve()


def preset(call: str, value: Any) -> str | None:
    """A preset: None (the defaults), a bundled name or a TOML file (text or a Path)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if text is not None and not isinstance(text, str):
        raise refused(call, "preset", value, "a bundled preset's name such as 'mnist', the "
                       "path of a TOML file (text or a pathlib.Path), or None for the defaults",
                       f"E.g. fedpriv.{call}('mnist', num_clients=10); `fedpriv presets` "
                       "lists the bundled ones.")
    return text


def name(call: str, value: Any, default: str | None) -> str | None:
    if value is None and default is None:
        return None
    return text(call, "name", value, "text" + (", or None for a name from the run's "
                 "settings" if default is None else ""),
                 f"E.g. fedpriv.{call}(..., name='baseline').")


def repeat(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise refused("sweep", "repeat", value, "a whole number of seeds from 1 to 1000, or "
                       "None to run every cell once (or as the sweep file's seeds say)",
                       "E.g. fedpriv.sweep('dp-epsilon-mnist', repeat=3).")
    return value


def cells_at_once(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise refused("sweep", "cells_at_once", value, "a whole number of cells from 1 to "
                       "64, or None for the default (2 in-process on 2 cores or more)",
                       "E.g. fedpriv.sweep('dp-epsilon-mnist', cells_at_once=1) to run the "
                       "cells one after another.")
    return value


def run_keys(call: str, values: Any, arg: str = "keyword arguments") -> dict[str, Any]:
    """Run-config keys with ``-`` for ``_``; ConfigError when one key is given twice in two
    spellings (``num_clients`` and ``num-clients``: which would win is not what the user
    meant). A path given as a ``pathlib.Path`` is taken as its text."""
    if not isinstance(values, Mapping):
        raise refused(call, arg, values, "a mapping of run-config keys to values",
                       f"E.g. fedpriv.{call}(..., {arg}={{'num_clients': 10}}).")
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise refused(call, f"a key of {arg}", key, "a run-config key as text "
                           "(num_clients or num-clients)", "E.g. {'num_clients': 10}.")
        dashed = key.replace("_", "-")
        if dashed in out:
            raise ConfigError(f"fedpriv.{call}: {dashed} is given twice in {arg}, as "
                              f"{spelled[dashed]!r} = {out[dashed]!r} and {key!r} = {value!r}; "
                              f"a key takes one value. Give it once, e.g. "
                              f"{dashed.replace('-', '_')}={value!r}.")
        spelled[dashed] = key
        out[dashed] = os.fspath(value) if isinstance(value, os.PathLike) else value
    return out


def grid(value: Any) -> dict[str, list[Any]]:
    """``grid``: keys -> non-empty lists (or tuples) of values."""
    example = "E.g. fedpriv.sweep(grid={'dp': ['none', 'local'], 'num_clients': [5, 10]})."
    if not isinstance(value, Mapping):
        raise refused("sweep", "grid", value, "a mapping of run-config keys to lists of "
                       "values (every combination is a cell)", example)
    keys = run_keys("sweep", value, "grid")
    for key, values in keys.items():
        if not isinstance(values, (list, tuple)) or not values:
            raise refused("sweep", f"grid[{key!r}]", values, "a non-empty list of the values "
                           "the key takes in the sweep's cells (one value: put it in fixed=)",
                           example)
    return {k: list(v) for k, v in keys.items()}


def cells(value: Any) -> list[dict[str, Any]]:
    """``cells``: a list (or tuple) of non-empty mappings, each one extra cell."""
    example = ("E.g. fedpriv.sweep(grid={'target_epsilon': [1, 5]}, fixed={'dp': 'local'}, "
               "cells=[{'dp': 'none'}]).")
    if not isinstance(value, (list, tuple)):
        raise refused("sweep", "cells", value, "a list of mappings, each an extra cell's "
                       "run-config keys", example)
    out = []
    for i, cell in enumerate(value):
        if not isinstance(cell, Mapping) or not cell:
            raise refused("sweep", f"cells[{i}]", cell, "a non-empty mapping of run-config "
                           "keys to values", example)
        out.append(run_keys("sweep", cell, f"cells[{i}]"))
    return out
