"""fedpriv's disk cache: derived data that is slow to recompute and the same every time.

Five kinds live here — the embedded MNIST parsed from CSV, partition indices, trained
backbones, embeddings and anonymized releases. A file's name is a digest of everything
its content depends on: the parameters that produce it (a typed config section, or the
dataclass of an anonymizer's parameters), the input data, and the **code version** — a
digest of the source of the modules that compute it, so editing that code invalidates
what the old code computed. Writes are atomic (a temporary file renamed into place); a
folder that cannot be written costs time, never a run.

Location: ``$FEDPRIV_CACHE``, else ``$XDG_CACHE_HOME/fedpriv``, else ``~/.cache/fedpriv``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .files import replacing


def cache_dir() -> Path:
    """The cache folder (see the module docstring)."""
    if os.environ.get("FEDPRIV_CACHE"):
        return Path(os.environ["FEDPRIV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fedpriv"


@functools.cache
def code_version(modules: tuple[str, ...]) -> str:
    """Digest of the source files of ``modules`` (dotted names)."""
    h = hashlib.sha256()
    for name in sorted(set(modules)):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ValueError(f"no source for module {name!r}")
        h.update(name.encode())
        h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()[:16]


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"__class__": type(obj).__name__, **_plain(dataclasses.asdict(obj))}
    if isinstance(obj, np.ndarray):
        return {"__array__": array_digest(obj)}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in sorted(obj.items())}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    return obj


def array_digest(array: np.ndarray) -> str:
    """Digest of an array's dtype, shape and bytes."""
    a = np.ascontiguousarray(array)
    h = hashlib.sha256(f"{a.dtype}|{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()[:24]


def cache_path(kind: str, suffix: str, parts: Any, code: Sequence[str]) -> Path:
    """Where content of ``kind`` computed from ``parts`` by the ``code`` modules lives."""
    text = json.dumps([_plain(parts), code_version(tuple(code))], sort_keys=True)
    return cache_dir() / kind / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}{suffix}"


def save_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``; an unwritable cache is ignored."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp:
            write(tmp)
