"""How the in-process runtime's nodes answer messages: here, or in worker processes.

:func:`answer` runs a node's ClientApp on a message and its Context as Flower's
simulation worker does (an exception becomes an error reply and the Context is not
kept). :class:`WorkerPool` runs it for a round's clients in forked worker processes,
``workers`` at once, as Ray's actors would but without Ray: threads of one process
share its GIL, and on the small CNN's 3 ms steps two client threads trained ten clients
only 1.3-1.4x faster than one thread, two processes 1.9x
(docs/BENCHMARKS.md, "Large cohorts"). The processes are forked when the runtime starts,
from its main thread, before any torch kernel ran (no OpenMP pool is copied into them;
the kernel's parent-death signal is tied to the thread that forked); each dies with the
runtime, even when the runtime is SIGKILLed. Messages and Contexts travel pickled, so
each worker gets a copy, as a runtime's transport gives; the client's result does not
depend on the process it runs in (its batches, noise and model come from its own
generators), so the bits are the threads' and Ray's.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from logging import ERROR

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from strategies.rounds import WorkerLost

from .procs import die_with_parent

Answer = tuple[Message, Context | None]

_APP: ClientApp | None = None  # the ClientApp a worker answers with (set before forking)
_PARENT = 0  # the runtime's pid, which a worker checks it still has


def answer(client_app: ClientApp, msg: Message, context: Context) -> Answer:
    """``client_app``'s reply to ``msg`` on the node whose Context is ``context``, and the
    Context it leaves (None when the ClientApp raised: the reply is then Flower's error
    reply, code 2 ``CLIENT_APP_RAISED_EXCEPTION``, and the node keeps its Context)."""
    try:
        return client_app(msg, context), context
    except Exception as exc:  # reported to the server as an error reply, as Flower does
        log(ERROR, exc)
        log(ERROR, traceback.format_exc())
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                             reason=f"{type(exc)}:<'{exc}'>"), reply_to=msg), None


def _started() -> None:
    """In a worker, first: die with the runtime (SIGKILL from the kernel, even when the
    runtime itself was SIGKILLed), leave Ctrl-C and the runtime's own signal handlers
    (which record its runs) to the runtime."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != _PARENT:  # the runtime died before the signal was asked for
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


def _ready(_: int) -> int:
    return os.getpid()


def _answer_in_worker(item: tuple[Message, Context]) -> Answer:
    msg, context = item
    if _APP is None:
        raise RuntimeError("a client worker process was started without its ClientApp")
    return answer(_APP, msg, context)


class WorkerPool:
    """``workers`` forked processes answering messages with ``client_app``."""

    def __init__(self, client_app: ClientApp, workers: int) -> None:
        global _APP, _PARENT
        _APP, _PARENT = client_app, os.getpid()
        self.workers = workers
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                         initializer=_started)
        # with fork, the first task forks every worker, from this thread
        list(self._pool.map(_ready, range(workers)))
        self.pids = sorted(p.pid for p in self._pool._processes.values())

    def answer(self, items: Sequence[tuple[Message, Context]]) -> list[Answer]:
        """Each (message, Context)'s answer, in order; :class:`WorkerLost` when a worker
        died (the runtime restarts from the last checkpoint, as for a lost Ray worker)."""
        chunk = max(1, len(items) // (4 * self.workers))  # a few hand-overs per worker
        try:
            return list(self._pool.map(_answer_in_worker, items, chunksize=chunk))
        except BrokenProcessPool as exc:
            raise WorkerLost(f"a client worker process of the in-process runtime died "
                             f"({exc}); its clients' replies are lost") from exc

    def close(self) -> None:
        """Stop the workers (they finish nothing more) and wait for them."""
        self._pool.shutdown(wait=True, cancel_futures=True)
