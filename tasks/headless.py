"""fedpriv draws its plots to files only, so no ``MPLBACKEND`` may stop it from importing
matplotlib.

Jupyter exports ``MPLBACKEND=module://matplotlib_inline.backend_inline`` to its kernels, and
every process started from one (fedpriv's children included) inherits it. When the kernel
runs in another environment than fedpriv, that module is not importable there, and
matplotlib refuses to import at all ("Key backend: ... is not a valid value"): every run
would crash in its first plot or in flwr-datasets' import. :func:`keep_matplotlib_importable`
replaces such a backend by Agg in this process (and so in its children) before anything
imports matplotlib. A backend that can load is left alone: a notebook keeps its inline
plots, and fedpriv itself never draws through pyplot's backend (a
:class:`matplotlib.figure.Figure` with an Agg canvas).
"""

from __future__ import annotations

import importlib.util
import os

FILE_BACKEND = "agg"
# matplotlib's built-in backend names (matplotlib.backends.registry.BackendRegistry, 3.9+;
# older releases accept the same names), lower case as matplotlib compares them
BUILTIN = frozenset({
    "gtk3agg", "gtk3cairo", "gtk4agg", "gtk4cairo", "macosx", "nbagg", "notebook", "qtagg",
    "qtcairo", "qt5agg", "qt5cairo", "tkagg", "tkcairo", "webagg", "wx", "wxagg", "wxcairo",
    "agg", "cairo", "pdf", "pgf", "ps", "svg", "template"})


def loadable(backend: str) -> bool:
    """Whether matplotlib would accept ``backend`` (as ``MPLBACKEND``) in this environment."""
    name = backend.strip()
    if name.startswith("module://"):
        module = name[len("module://"):]
        try:
            return bool(module) and importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is missing, or ".x"
            return False
    if name.lower() in BUILTIN:
        return True
    from importlib.metadata import entry_points  # backends other packages register

    return any(ep.name.lower() == name.lower()
               for ep in entry_points(group="matplotlib.backend"))


def keep_matplotlib_importable() -> str | None:
    """Replace an ``MPLBACKEND`` this environment cannot load by Agg; the replaced value,
    or ``None`` when there was nothing to replace."""
    backend = os.environ.get("MPLBACKEND")
    if not backend or loadable(backend):
        return None
    os.environ["MPLBACKEND"] = FILE_BACKEND
    return backend
