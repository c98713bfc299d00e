"""Writing result files so that a crash or a full disk never leaves half a file behind."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import ConfigError


def damaged(path: Path, why: str, prefix: str = "") -> ConfigError:
    """A result file fedpriv wrote that cannot be used, as one paragraph: which, why, and
    what to do (``prefix`` names the command, e.g. ``--resume 'results/x'``)."""
    return ConfigError(f"{prefix + ': ' if prefix else ''}{path} {why}; restore the file "
                       "fedpriv wrote (from a backup or the run's copy), or start a new run.")


def read_text(path: Path, prefix: str = "") -> str:
    """The text of a result file; ConfigError naming it when it cannot be read (a folder
    in its place, bytes that are not UTF-8, no permission)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise damaged(path, f"is damaged (not UTF-8 text: {exc.reason} at byte {exc.start})",
                      prefix) from None
    except OSError as exc:
        raise damaged(path, f"cannot be read ({exc.strerror or exc})", prefix) from None


class WriteFailed(OSError):
    """A result file could not be written; the message says why and what to do."""


def explain(path: Path, exc: OSError) -> WriteFailed:
    """``exc`` as one sentence a user can act on (a full disk says so)."""
    why = exc.strerror or str(exc)
    advice = {errno.ENOSPC: "the disk is full: free some space",
              errno.EDQUOT: "the disk quota is used up: free some space",
              errno.EROFS: "the file system is read-only: choose another results-dir",
              errno.EACCES: "permission denied: choose a results-dir you can write to"}.get(
        exc.errno or 0, "check the folder")
    failed = WriteFailed(f"cannot write {path}: {why} ({advice})")
    failed.errno = exc.errno
    return failed


def temporary(path: Path) -> Path:
    """This process's temporary file for ``path``: beside it, hidden, same suffix."""
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, for writers that go by it) to write;
    renamed over ``path`` when the block ends, removed if it raises: the one way fedpriv
    replaces a file, so a reader never sees half of one."""
    tmp = temporary(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write`` a result file through :func:`replacing`, forced to disk; on failure
    :class:`WriteFailed` says why."""
    try:
        with replacing(path) as tmp:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
    except OSError as exc:
        raise explain(path, exc) from None


def safe_name(text: str) -> str:
    """``text`` as one file or folder name: anything but letters, digits, '-', '_' and '.'
    becomes '-'; never empty, hidden or a path."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-.") or "run"


def append_line(path: Path, line: str) -> None:
    """Append one line and force it to disk; on failure cut the file back to where it
    was (no half line for a reader to choke on) and raise :class:`WriteFailed`."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise explain(path, exc) from None
    finally:
        os.close(fd)
