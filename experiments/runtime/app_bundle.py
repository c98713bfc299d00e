"""The Flower app `flwr run` is given: a staged copy of the app packages and a pyproject.toml."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import tomli_w

from tasks.config import defaults

from .owned_folders import owned_folder

APP_PACKAGES = ("tasks", "server", "clients", "strategies", "privacy")


def app_dir() -> Path:
    """The folder `flwr run` builds the Flower App Bundle from: the app packages' sources
    copied next to a generated pyproject.toml in a temporary folder.

    Flower lists every file under the folder it is given before applying
    ``fab-include``; given a source checkout with its virtualenv that took 4.5 s of every
    run's start-up (20 ms to stage). The repository root stays a valid Flower app for
    ``flwr run .`` by hand.
    """
    return stage_app()


def stage_app() -> Path:
    """The app packages and a pyproject.toml in a temporary folder, removed at exit; the
    folder above it names this process its owner, so that the next start removes it if
    this process dies with no exit code run (SIGKILL), as it removes the runtime's own."""
    stage = owned_folder("app") / "app"  # Flower builds the FAB from all that is in it
    for name in APP_PACKAGES:
        src = Path(importlib.import_module(name).__file__).parent  # type: ignore[arg-type]
        shutil.copytree(src, stage / name, ignore=shutil.ignore_patterns("__pycache__",
                                                                         "*.pyc"))
    (stage / "pyproject.toml").write_text(tomli_w.dumps({
        "project": {"name": "fedpriv", "version": "0.1.0"},
        "tool": {"flwr": {"app": {
            "publisher": "fedpriv",
            "components": {"serverapp": "server.app:app", "clientapp": "clients.app:app"},
            "config": dict(defaults())}}}}))
    return stage
