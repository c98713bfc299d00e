"""Progress bars with an ETA for fedpriv's long steps (CVAE and backbone training, the
attacks, a sweep's cells, the pre-flight checks), drawn with ``rich.progress``.

Where a :class:`Bar` shows depends on where its process writes:

- on a terminal (stderr is one): a bar with the steps done, the time elapsed and an ETA,
  erased when the step ends; several at once share one display (nested steps);
- in a child of the fedpriv CLI whose output is a pipe (the ServerApp and ClientApp of
  the in-process runtime, the attack stage), when the CLI draws bars itself
  (:func:`relay_to_children` set ``FEDPRIV_PROGRESS=relay``): a ``MARK`` line at most
  every ``RELAY_EVERY_S`` (none for a shorter step), which the CLI's :class:`Relay`
  draws as a bar and does not print;
- anywhere else (tests, pipes, CI logs): nothing.

This module travels in the Flower app bundle (tasks/), so it imports nothing of
server/ or experiments/.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

ENV = "FEDPRIV_PROGRESS"  # "relay": write progress as MARK lines for the parent to draw
MARK = "[fedpriv-progress] "
RELAY_EVERY_S = 0.5  # at most this often a relayed update; a step shorter than this sends none

T = TypeVar("T")
_ids = itertools.count(1)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def mode() -> str:
    """How a bar shows in this process: ``bar``, ``relay`` or ``quiet``."""
    if _isatty(sys.stderr):
        return "bar"
    if os.environ.get(ENV) == "relay":
        return "relay"
    return "quiet"


def relay_to_children() -> None:
    """On a terminal, have child processes started from now on relay their progress
    (their output is a pipe this process reads and draws with :class:`Relay`)."""
    if mode() == "bar":
        os.environ[ENV] = "relay"


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def eta_text(elapsed: float | None, done: float, total: float | None) -> str:
    """The time elapsed and the time left at the mean pace so far: ``0:00:20 eta 0:01:05``
    (``eta -:--:--`` before the first step or without a total)."""
    spent = _clock(elapsed or 0)
    if not elapsed or not done or not total:
        return f"{spent} eta -:--:--"
    return f"{spent} eta {_clock(elapsed * (total - done) / done)}"


class _Board:
    """The one live display of this process: a rich Progress its bars are tasks of."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.progress: Any = None

    def add(self, description: str, total: float | None, before: float = 0.0) -> int:
        """A new bar; ``before``: seconds its step ran before it was drawn (relayed)."""
        with self.lock:
            if self.progress is None:
                self.progress = _new_progress()
                self.progress.start()
            return self.progress.add_task(description, total=total, before=before)

    def update(self, task: int, completed: float, description: str | None = None) -> None:
        with self.lock:
            if self.progress is not None:
                self.progress.update(task, completed=completed, description=description)

    def remove(self, task: int) -> None:
        with self.lock:
            if self.progress is None:
                return
            self.progress.remove_task(task)
            if not self.progress.task_ids:
                self.progress.stop()
                self.progress = None


def _new_progress() -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TextColumn,
    )
    from rich.progress import Progress as RichProgress
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        """Elapsed time and the ETA at the mean pace since the step started (rich's own
        estimate looks only at the last 30 s, too short for steps of minutes)."""

        def render(self, task: Any) -> Text:
            elapsed = (task.elapsed or 0.0) + task.fields.get("before", 0.0)
            return Text(eta_text(elapsed, task.completed, task.total),
                        style="progress.remaining")

    # stdout is redirected above the bars only when it is the terminal too (a piped
    # stdout, e.g. `fedpriv run > log`, must keep its lines)
    return RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        EtaColumn(), console=Console(stderr=True),
                        transient=True, refresh_per_second=4,
                        redirect_stdout=_isatty(sys.stdout), redirect_stderr=True)


_board = _Board()


class Bar:
    """One long step of ``total`` parts: ``with Bar("CVAE", 200) as bar: ... bar.advance()``.

    Shows as :func:`mode` says; costs nothing when quiet. Relayed, a step shows once it
    has taken ``RELAY_EVERY_S`` (short ones never), or from the start when ``eager``.
    """

    def __init__(self, description: str, total: float | None, eager: bool = False) -> None:
        self.description = description
        self.total = total
        self.done = 0.0
        self.mode = mode()
        self.id = f"{os.getpid()}-{next(_ids)}"
        self.task: int | None = None
        self.started = self.last_relay = time.monotonic()
        self.relayed = False
        self.eager = eager

    def __enter__(self) -> Bar:
        self.started = self.last_relay = time.monotonic()
        if self.mode == "bar":
            self.task = _board.add(self.description, self.total)
        elif self.mode == "relay" and self.eager:
            self._relay(self.started)
        return self

    def advance(self, steps: float = 1, description: str | None = None) -> None:
        """``steps`` more parts done (and a new description, if given)."""
        self.done += steps
        if description is not None:
            self.description = description
        if self.task is not None:
            _board.update(self.task, self.done, description)
        elif self.mode == "relay":
            now = time.monotonic()
            if now - self.last_relay >= RELAY_EVERY_S or (self.eager and self.done == self.total):
                self._relay(now)

    def _relay(self, now: float) -> None:
        self.last_relay, self.relayed = now, True
        _emit({"id": self.id, "description": self.description, "total": self.total,
               "done": self.done, "elapsed": round(now - self.started, 3)})

    def __exit__(self, *exc: object) -> None:
        if self.task is not None:
            _board.remove(self.task)
            self.task = None
        elif self.relayed:
            _emit({"id": self.id, "end": True})


def _emit(event: dict[str, Any]) -> None:
    try:
        print(MARK + json.dumps(event), file=sys.stdout, flush=True)
    except (OSError, ValueError):  # nobody reads our output any more: no bar then
        pass


def track(items: Iterable[T], description: str, total: float | None = None,
          eager: bool = False) -> Iterator[T]:
    """Yield ``items``, advancing a bar after each (``total`` defaults to their length;
    ``eager`` as for :class:`Bar`)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Bar(description, total, eager) as bar:
        for item in items:
            yield item
            bar.advance()


class Relay:
    """The parent's side: draws the bars a child relays and tells its other lines apart.

    ``feed(line)`` is True for a progress line (drawn here on a terminal, dropped
    otherwise), False for any other line, which the caller prints as before.
    """

    def __init__(self) -> None:
        self.tasks: dict[str, int] = {}
        self.draw = mode() == "bar"

    def feed(self, line: str) -> bool:
        at = line.find(MARK)
        if at < 0:
            return False
        try:
            event = json.loads(line[at + len(MARK):])
            key = str(event["id"])
        except (ValueError, KeyError, TypeError):
            return False
        if not self.draw:
            return True
        if event.get("end"):
            if key in self.tasks:
                _board.remove(self.tasks.pop(key))
        elif key not in self.tasks:
            self.tasks[key] = _board.add(str(event.get("description", "")), event.get("total"),
                                         float(event.get("elapsed") or 0.0))
            _board.update(self.tasks[key], float(event.get("done") or 0))
        else:
            _board.update(self.tasks[key], float(event.get("done") or 0),
                          str(event.get("description", "")))
        return True

    def close(self) -> None:
        """Take down the bars of a child that ended without closing them."""
        for task in self.tasks.values():
            _board.remove(task)
        self.tasks.clear()
