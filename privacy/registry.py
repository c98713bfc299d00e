"""Registries: every kind of component fedpriv looks up by name, in one style.

A :class:`Registry` maps a name to an implementation — a model factory, a dataset, a
partitioner, a strategy factory, an anonymizer, an attack — plus, for some kinds,
metadata that must be readable without importing the implementation (an attack's
description, whether an anonymizer is row-wise). fedpriv's own entries name their
implementation as ``"module:attribute"`` and import it on first use, so the run-config
schema (``--help``, every input check) knows every name without importing torch,
Flower or scikit-learn. Users add their own with :meth:`Registry.register`, in a module
the run config's ``plugins`` key names (docs/EXTENDING.md)::

    from tasks.registry import MODELS

    @MODELS.register("tiny-mlp")
    def tiny_mlp(input_shape, num_classes, hidden=()): ...

The class lives in the lowest layer so that every layer's registries can use it: the
datasets, partitioners, models and backbones in :mod:`tasks.registry`, the strategies in
:mod:`strategies.registry`, the anonymizers and attacks under :mod:`privacy`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # no commas or spaces: names go in lists
EXTENDING = "docs/EXTENDING.md"


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered name: its implementation (or ``"module:attribute"``) and metadata."""

    name: str
    target: T | str
    info: Any = None


class Registry(Generic[T]):
    """Named implementations of one kind, fedpriv's own imported lazily, extensible by users.

    ``kind`` names the kind in messages ("model"); ``where`` is how a user imports the
    registry ("tasks.registry.MODELS"); ``signature`` says what an entry must be; ``info``
    is the dataclass of the metadata each entry gives as keyword arguments to
    :meth:`register` (None: no metadata); ``error`` is the exception an unknown name
    raises (the run-config error where the name comes from the run config).
    """

    def __init__(self, kind: str, *, where: str, signature: str, info: type | None = None,
                 error: type[Exception] = ValueError) -> None:
        self.kind, self.where, self.signature = kind, where, signature
        self.info_type, self.error = info, error
        self._entries: dict[str, Entry[T]] = {}
        self._loaded: dict[str, T] = {}

    # ------------------------------------------------------------------ adding entries

    def register(self, name: str, target: T | str | None = None, /, *, replace: bool = False,
                 **info: Any) -> Any:
        """Register ``target`` as ``name`` and return it; without ``target``, a decorator.

        ``target`` is the implementation itself or ``"module:attribute"`` (imported on
        first use). ``info`` is the kind's metadata (see the registry's ``info_type``).
        A name already taken is refused unless ``replace`` (a module re-imported under the
        same name and qualified name may register again).
        """
        if target is None:
            def decorate(obj: T) -> T:
                self._add(name, obj, replace, info)
                return obj

            return decorate
        self._add(name, target, replace, info)
        return target

    def _add(self, name: str, target: T | str, replace: bool, info: dict[str, Any]) -> None:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{self.kind} name {name!r} cannot be registered: a name is "
                             "letters, digits and . _ + - (no spaces or commas, which separate "
                             f"names in lists), e.g. 'my-{self.kind}'.")
        if isinstance(target, str) and target.count(":") != 1:
            raise ValueError(f"{self.kind} {name!r}: a text target must be 'module:attribute' "
                             f"(got {target!r}); or register the {self.kind} itself.")
        meta = self._info(name, info)
        old = self._entries.get(name)
        if old is not None and not replace and not _same(old.target, target):
            raise ValueError(f"{self.kind} {name!r} is already registered (by "
                             f"{_origin(old.target)}); choose another name, or pass "
                             f"replace=True to {self.where}.register to override it.")
        self._entries[name] = Entry(name, target, meta)
        self._loaded.pop(name, None)

    def _info(self, name: str, info: dict[str, Any]) -> Any:
        if self.info_type is None:
            if info:
                raise TypeError(f"{self.kind} {name!r}: {self.where}.register takes no "
                                f"metadata (got {', '.join(info)}).")
            return None
        try:
            return self.info_type(**info)
        except TypeError as exc:
            fields = ", ".join(f.name for f in dataclasses.fields(self.info_type))
            raise TypeError(f"{self.kind} {name!r}: {exc}; {self.where}.register takes "
                            f"{fields}.") from None

    # ------------------------------------------------------------------ looking names up

    @property
    def names(self) -> tuple[str, ...]:
        """Every registered name, fedpriv's own first, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self._entries)

    def unknown(self, name: object, key: str | None = None) -> str:
        """The one-paragraph error for a name that is not registered."""
        names = ", ".join(self._entries)
        close = difflib.get_close_matches(str(name), list(self._entries), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        what = (f"{key} = {name!r} must be one of {names}" if key
                else f"unknown {self.kind} {name!r}; choose from {names}")
        return (f"{what}.{hint} {a_kind(self.kind, True)} of your own must be registered first: "
                f"with {self.where}.register({name!r}) in a module the run-config key plugins "
                f"names ({EXTENDING}).")

    def check(self, name: str, key: str | None = None) -> None:
        """Raise the registry's error (see :meth:`unknown`) unless ``name`` is registered."""
        if name not in self._entries:
            raise self.error(self.unknown(name, key))

    def load(self, name: str) -> T:
        """The implementation registered as ``name`` (a ``"module:attribute"`` imported now)."""
        self.check(name)
        if name not in self._loaded:
            target = self._entries[name].target
            if isinstance(target, str):
                module, attr = target.split(":")
                target = getattr(importlib.import_module(module), attr)
            self._loaded[name] = target  # type: ignore[assignment]
        return self._loaded[name]

    def info(self, name: str) -> Any:
        """The metadata ``name`` was registered with (nothing is imported)."""
        self.check(name)
        return self._entries[name].info

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, metadata) for every entry (nothing is imported)."""
        return ((e.name, e.info) for e in self._entries.values())

    def module(self, name: str) -> str:
        """The module that implements ``name`` (for cache digests of what it computes)."""
        self.check(name)
        target = self._entries[name].target
        return target.split(":")[0] if isinstance(target, str) else _origin(target, True)


def a_kind(kind: str, capital: bool = False) -> str:
    """"a model", "an attack"."""
    article = "an" if kind[:1] in "aeiou" else "a"
    return f"{article.capitalize() if capital else article} {kind}"


def _origin(target: Any, module_only: bool = False) -> str:
    if isinstance(target, str):
        return target.split(":")[0] if module_only else target
    module = getattr(target, "__module__", None) or type(target).__module__
    if module_only:
        return module
    return f"{module}:{getattr(target, '__qualname__', type(target).__qualname__)}"


def _same(old: Any, new: Any) -> bool:
    """The same implementation, or the same definition run again (its module re-imported:
    same module, qualified name and source line)."""
    if old is new:
        return True
    if isinstance(old, str) or isinstance(new, str) or not hasattr(new, "__qualname__"):
        return False

    def where(obj: Any) -> tuple[str, int]:
        code = getattr(obj, "__code__", None)
        return _origin(obj), code.co_firstlineno if code is not None else -1

    return where(old) == where(new)
