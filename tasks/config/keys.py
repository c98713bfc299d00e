"""How a run-config key is declared, checked and typed.

A key is a field of a frozen section dataclass, declared with :func:`key`; its name is
the field's name with dashes (``dirichlet_alpha`` is ``dirichlet-alpha``) unless given,
its type is its default's type, and its checks and help text travel in the field's
metadata. The schema, ``--help``, docs/CONFIG.md and pyproject.toml's
``[tool.flwr.app.config]`` are all read off these fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from privacy.registry import EXTENDING, Registry, a_kind

from ..errors import ConfigError

Scalar = bool | int | float | str
INT_MAX = 2**63 - 1  # Flower's run config travels as protobuf int64/double/string
META = "fedpriv-key"


@dataclass(frozen=True)
class Key:
    """One run-config key: default (which also fixes its type), help text and checks.

    A key whose values are registered names (``model``, ``anonymizer``...) holds the
    registry, not a copy of its names: the allowed values are read when a value is
    checked, so names a plugin registers are allowed too. ``listing``: the value is a
    comma-separated list of such names (``attacks``).
    """

    name: str
    default: Scalar
    help: str
    group: str
    options: tuple[str, ...] = ()  # fixed choices (before the registry's names, if any)
    registry: Registry | None = None
    listing: bool = False
    check: Callable[[Any], str | None] | None = None
    allowed: str = ""
    aliases: tuple[tuple[Scalar, str], ...] = ()  # (an older value, the choice it means)

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The allowed values (None: any value of the key's type within its range)."""
        if self.listing:
            return None
        names = (*self.options, *(self.registry.names if self.registry else ()))
        return names or None

    def describe_allowed(self) -> str:
        if self.listing and self.registry is not None:
            return "comma-separated: " + ", ".join(self.registry.names)
        if self.choices:
            old = "".join(f", {str(a).lower()} = {b}" for a, b in self.aliases)
            return " | ".join(self.choices) + (f" ({old[2:]})" if old else "")
        if self.allowed:
            return self.allowed
        return {bool: "true | false", int: "integer", float: "number", str: "text"}[self.type]

    def _own(self) -> str:
        """How to allow a name of one's own (for keys whose values are registered names)."""
        assert self.registry is not None
        return (f"; {a_kind(self.registry.kind)} of your own must be registered first "
                f"({self.registry.where}.register in a module the plugins key names, "
                f"{EXTENDING})")

    def parse(self, value: Any) -> Scalar:
        """The value typed and checked, or :class:`ConfigError` with one sentence."""
        for old, new in self.aliases:
            if (type(value) is type(old) and value == old) or (
                    isinstance(value, str) and value.lower() == str(old).lower()):
                value = new
        coerced, err = _coerce(self.type, value)
        choices = self.choices
        if err is None and choices and coerced not in choices:
            close = difflib.get_close_matches(str(coerced), choices, n=1)
            err = (f"is not allowed; did you mean {close[0]!r}? It must be one of "
                   if close else "must be one of ") + ", ".join(choices)
            if self.registry is not None:
                err += self._own()
        if err is None and self.listing and self.registry is not None:
            bad = [n for n in _items(str(coerced)) if n not in self.registry]
            if bad:
                err = (f"has unknown {bad}: each must be one of "
                       f"{', '.join(self.registry.names)}{self._own()}")
        if err is None and self.check is not None:
            err = self.check(coerced)
        if err is not None:
            raise ConfigError(f"{self.name} = {value!r} {err} (allowed: "
                              f"{self.describe_allowed()}).")
        return coerced  # type: ignore[return-value]


def _items(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _range(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool
           ) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, float) and not math.isfinite(v):
            return "must be a finite number"
        if lo is not None and (v <= lo if lo_open else v < lo):
            return f"must be {'>' if lo_open else '>='} {lo}"
        if hi is not None and (v >= hi if hi_open else v > hi):
            return f"must be {'<' if hi_open else '<='} {hi}"
        return None

    return check


def _interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    return (f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, "
            f"{'inf)' if hi is None else str(hi) + (')' if hi_open else ']')}")


def key(default: Scalar, help: str, *, choices: tuple[str, ...] = (),
        registry: Registry | None = None, listing: bool = False,
        lo: float | None = None, hi: float | None = None, lo_open: bool = False,
        hi_open: bool = False, allowed: str = "", name: str = "",
        aliases: tuple[tuple[Scalar, str], ...] = ()) -> Any:
    """Declare a run-config key as a dataclass field (see the module docstring).

    ``choices``: fixed allowed values; ``registry``: the registered names are allowed too
    (after ``choices``), read at check time; ``listing``: a comma-separated list of them.
    """
    numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
    check = _range(lo, hi, lo_open, hi_open) if numeric and (lo is not None or hi is not None) \
        else None
    spec = {"name": name, "default": default, "help": help, "options": choices,
            "registry": registry, "listing": listing, "check": check,
            "allowed": allowed or (_interval(lo, hi, lo_open, hi_open) if check else ""),
            "aliases": aliases}
    return dataclasses.field(default=default, metadata={META: spec})


def _coerce(want: type, value: Any) -> tuple[Scalar | None, str | None]:
    """(value of type ``want``, None) or (None, error text)."""
    if want is bool:
        if isinstance(value, bool):
            return value, None
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true", None
        return None, "must be true or false"
    if want is int:
        if isinstance(value, bool):
            return None, "must be an integer"
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            return None, "must be an integer"
        if abs(value) > INT_MAX:
            return None, "must be at most 2^63 - 1 in size"
        return value, None
    if want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None, "must be a number"
        return float(value), None
    if not isinstance(value, str):
        return None, "must be text (in TOML and --set, quote it: key='text')"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return None, ("must not contain control characters (a newline, tab or escape); "
                      "they cannot be written into the config Flower reads")
    return value, None


class Section:
    """A frozen group of keys; subclasses are dataclasses declared with :func:`key`."""

    GROUP: ClassVar[str]

    @classmethod
    def keys(cls) -> list[Key]:
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec = dict(f.metadata[META])
            spec["name"] = spec["name"] or f.name.replace("_", "-")
            out.append(Key(group=cls.GROUP, **spec))
        return out

    @classmethod
    def from_values(cls, values: Mapping[str, Scalar]) -> Section:
        """The section from typed flat values (every one of its keys present)."""
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        return cls(**{n: values[k.name] for n, k in zip(names, cls.keys(), strict=True)})

    def flat(self) -> dict[str, Scalar]:
        return {k.name: getattr(self, f.name) for f, k in
                zip(dataclasses.fields(self), self.keys(), strict=True)}  # type: ignore[arg-type]
