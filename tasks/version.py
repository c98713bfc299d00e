"""fedpriv's version and, in a git checkout, the commit it runs from: recorded in each
run.json so a result names the code that made it."""

from __future__ import annotations

import functools
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's), or "unknown" when fedpriv
    runs from a folder that was never installed."""
    try:
        return version("fedpriv")
    except PackageNotFoundError:
        return "unknown"


def installed_version(name: str) -> str:
    """A distribution's version for run.json, or "not installed" (Ray, say, is only needed
    by the Ray runtime: a run without it still records what it ran with)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=1)
def source_commit() -> str | None:
    """The checkout's commit, with "+dirty" when tracked files differ from it; None when
    fedpriv's own folder is not the top of a git checkout (e.g. installed inside another
    project's repository, whose commit is not fedpriv's), or without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != ROOT:
            return None
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def describe() -> str:
    """'fedpriv 0.1.0 (commit abc1234)' for --version."""
    commit = source_commit()
    return f"fedpriv {package_version()}" + (f" (commit {commit[:12]}"
                                             f"{'+dirty' if commit.endswith('+dirty') else ''})"
                                             if commit else "")


__version__ = package_version()
