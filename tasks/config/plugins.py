"""The ``plugins`` key: modules of the user's that register components, imported first.

A registration made in the user's Python process is not seen by the ServerApp and the
ClientApps, which Flower runs in other processes (a subprocess and Ray actors). Every
one of those processes parses the run config with :func:`tasks.config.validate`, which
imports the modules ``plugins`` names before it checks any registry-named key, so they
all see the same registrations. :func:`plugin_roots` tells the CLI which folders to put
on the Flower processes' ``PYTHONPATH`` so that a plugin found from the current folder is
found there too, and :func:`registered_by` which plugin registered a name (so that the
pre-flight check can name it when what it registered fails).
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from privacy.registry import Registry

MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_ROOTS: dict[str, str] = {}  # plugin module -> the sys.path folder it was imported from
_ADDED: dict[tuple[str, str], str] = {}  # (registry kind, name) -> the plugin that added it


def _registries() -> list[Registry]:
    """The registries below the schema whose entries the pre-flight check calls (the
    strategies' registry lies above this layer: only the ServerApp builds strategies)."""
    from privacy.anonymize.registry import ANONYMIZERS
    from privacy.attacks.registry import ATTACKS

    from ..registry import BACKBONES, DATASETS, MODELS, PARTITIONERS

    return [DATASETS, PARTITIONERS, MODELS, BACKBONES, ANONYMIZERS, ATTACKS]


def registered_by(registry: Registry, name: str) -> str | None:
    """The plugin module whose import registered ``name`` in ``registry`` (None: fedpriv's
    own, or registered otherwise), so that an error in it can name the plugin."""
    return _ADDED.get((registry.kind, name))


def plugin_names(text: str) -> list[str]:
    """The module names in a ``plugins`` value ("a.b, c")."""
    return [t.strip() for t in text.split(",") if t.strip()]


def load_plugins(text: str) -> list[str]:
    """Import every module ``text`` names (each once per process); one error per module
    that cannot be imported, saying which, why (the exception's first line) and how to fix
    it."""
    errors = []
    for name in plugin_names(text):
        if not MODULE.fullmatch(name):
            hint = name.removesuffix(".py").replace("/", ".").replace("\\", ".").strip(".")
            errors.append(f"plugins: {name!r} is not a module name. Name the module as "
                          f"Python imports it (e.g. {hint!r} for the file {name}), "
                          "comma-separated.")
            continue
        before = {r.kind: set(r.names) for r in _registries()}
        try:
            module = importlib.import_module(name)
        except SystemExit as exc:  # sys.exit() in the module: fedpriv would end silently
            errors.append(f"plugins: importing {name!r} called sys.exit({exc.code!r}), which "
                          "would end every fedpriv process that imports it (the CLI, the "
                          "ServerApp, each ClientApp) without a word. Remove the exit from "
                          "the module's top level (run scripts under `if __name__ == "
                          "'__main__':`), or remove it from plugins.")
            continue
        except Exception as exc:  # anything the user's module raises while it imports
            first = (str(exc).splitlines() or [""])[0]
            why = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
            missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and (
                name == exc.name or name.startswith(exc.name + "."))
            if missing:
                errors.append(
                    f"plugins: the module {name!r} was not found ({why}{_shadowed(name)}). "
                    "Every fedpriv "
                    "process imports it (the CLI, the ServerApp, each ClientApp), so it must "
                    "be importable in all of them: run fedpriv from the folder that holds "
                    "it, add that folder to PYTHONPATH, or install it (pip install -e).")
            else:
                errors.append(f"plugins: importing {name!r} failed ({why}); fix the module "
                              "(it runs with every fedpriv process) or remove it from "
                              "plugins.")
            continue
        _ROOTS.setdefault(name, _root(name, module))
        for registry in _registries():
            for added in set(registry.names) - before[registry.kind]:
                _ADDED[(registry.kind, added)] = name
    return errors


def _shadowed(name: str) -> str:
    """Where the plugin's top-level package was found instead, when one was (another
    installed package of the same name, e.g. Opacus' ``examples``)."""
    top = name.split(".")[0]
    if top == name or top not in sys.modules:
        return ""
    where = getattr(sys.modules[top], "__file__", None) or list(
        getattr(sys.modules[top], "__path__", []))
    return f"; {top!r} was imported from {where}, which comes first on sys.path" if where else ""


def _root(name: str, module: object) -> str:
    """The folder on sys.path that ``module`` (named ``name``) was imported from."""
    file = getattr(module, "__file__", None)
    if not file:
        return ""
    path = Path(file).resolve()
    depth = name.count(".") + (1 if path.stem == "__init__" else 0)
    return str(path.parents[depth])


def plugin_roots() -> list[str]:
    """The folders the plugins imported in this process came from (for child processes'
    ``PYTHONPATH``), site-packages excluded (every process of this environment has it)."""
    site = {str(Path(p).resolve()) for p in sys.path if p.endswith("-packages")}
    return [r for r in dict.fromkeys(_ROOTS.values()) if r and r not in site]
