"""One worker thread per kind of DP work done ahead (the next step's noise, the next
round's epsilon), so that it runs on a free core while training goes on (torch and numpy
release the GIL). Work of one kind runs in submission order."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_WORKERS: dict[str, ThreadPoolExecutor] = {}


def submit(kind: str, fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn(*args)`` on ``kind``'s worker thread (started when first needed)."""
    worker = _WORKERS.get(kind)
    if worker is None:
        worker = _WORKERS[kind] = ThreadPoolExecutor(max_workers=1,
                                                     thread_name_prefix=f"dp-{kind}")
    return worker.submit(fn, *args)


def _forget_workers() -> None:
    """A forked child has none of its parent's threads: it starts its own when needed
    (reusing the parent's executors would wait forever)."""
    _WORKERS.clear()


os.register_at_fork(after_in_child=_forget_workers)
