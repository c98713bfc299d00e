"""Where the Flower app lives: the source tree, or a staged copy for a non-editable install."""

from __future__ import annotations

import atexit
import importlib
import shutil
import tempfile
import tomllib
from pathlib import Path

from tasks.config import defaults, to_toml

APP_PACKAGES = ("tasks", "server", "clients", "strategies", "privacy")


def _is_app_dir(path: Path) -> bool:
    pyproject = path / "pyproject.toml"
    if not pyproject.is_file():
        return False
    with open(pyproject, "rb") as f:
        return "app" in tomllib.load(f).get("tool", {}).get("flwr", {})


def app_dir() -> Path:
    """The folder `flwr run` builds the Flower App Bundle from.

    In a source checkout (``pip install -e .``) that is the repository root. For a
    regular install the app packages are copied next to a generated pyproject.toml
    in a temporary folder.
    """
    root = Path(__file__).resolve().parents[1]
    if _is_app_dir(root):
        return root
    return stage_app()


def stage_app() -> Path:
    """The app packages and a pyproject.toml in a temporary folder, removed at exit."""
    stage = Path(tempfile.mkdtemp(prefix="fedpriv-app-"))
    atexit.register(shutil.rmtree, stage, ignore_errors=True)
    for name in APP_PACKAGES:
        src = Path(importlib.import_module(name).__file__).parent  # type: ignore[arg-type]
        shutil.copytree(src, stage / name, ignore=shutil.ignore_patterns("__pycache__"))
    (stage / "pyproject.toml").write_text(
        '[project]\nname = "fedpriv"\nversion = "0.1.0"\n\n'
        '[tool.flwr.app]\npublisher = "fedpriv"\n\n'
        '[tool.flwr.app.components]\nserverapp = "server.app:app"\n'
        'clientapp = "clients.app:app"\n\n[tool.flwr.app.config]\n' + to_toml(defaults()))
    return stage
