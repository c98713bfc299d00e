"""A sweep's cells side by side in one simulation: which may share it, and their schedule.

Two cells in threads of the ServerApp's process overlap one cell's serial work (its
evaluation, aggregation, plots, set-up) with the other's training on the shared client
workers. Each cell then has nodes of its own (``InProcessGrid.cell_view``: fresh
Contexts), so its clients' states stay apart; what the server draws from the process'
global generators (the seeding at a run's start and the model it initialises, Flower's
client sampling with ``random``) is drawn under :data:`tasks.seeding.GLOBAL_RNG`, so a
cell's ledger is the one it gets alone. A cell whose server or clients do more than
plain, local-DP or central-DP FedAvg runs alone (:data:`RUNS_ALONE`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from tasks.config import RunConfig

Cell = TypeVar("Cell")

# why a cell runs alone: (what it does, whether this config does it). Each draws from
# process-wide state (generators, plotting, trackers' sessions) beyond what the lock
# guards, or exchanges messages outside a plain round.
RUNS_ALONE: tuple[tuple[str, Callable[[RunConfig], bool]], ...] = (
    ("secure aggregation", lambda c: c.secagg.enabled),
    ("embeddings", lambda c: c.embeddings.enabled),
    ("anonymization", lambda c: c.anonymization.enabled),
    ("the leakage study", lambda c: c.leakage.enabled or c.leakage.server != "honest"),
    ("audit canaries", lambda c: c.leakage.canaries > 0 or c.leakage.canary_clients > 0),
    ("memorization", lambda c: c.memorization.enabled),
    ("train-together", lambda c: c.resources.train_together),
    ("tracking", lambda c: c.results.tracking != "none"),
    ("a resumed run", lambda c: c.results.resume),
    ("distributed DP", lambda c: c.privacy.dp not in ("none", "local", "central")),
)


def alone_reason(cfg: RunConfig) -> str | None:
    """Why ``cfg``'s cell must run alone, or None when it may run beside others."""
    return next((what for what, does in RUNS_ALONE if does(cfg)), None)


def schedule(cells: Sequence[Cell], at_once: int, alone: Callable[[Cell], bool],
             run: Callable[[Cell], None]) -> None:
    """``run(cell)`` for every cell in order, up to ``at_once`` at a time; a cell that must
    run ``alone`` waits for the running ones and runs by itself. An error that ``run``
    raises lets the running cells end, starts no other, and is raised (the first one)."""
    if at_once <= 1:
        for cell in cells:
            run(cell)
        return
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(cell: Cell) -> None:
        if stop.is_set():
            return
        try:
            run(cell)
        except BaseException as exc:
            stop.set()
            errors.append(exc)

    with ThreadPoolExecutor(at_once, thread_name_prefix="cell") as pool:
        running: list[Future[Any]] = []
        for cell in cells:
            if stop.is_set():
                break
            if alone(cell):
                wait(running)
                running = []
                guarded(cell)
            else:
                running.append(pool.submit(guarded, cell))
    if errors:
        raise errors[0]
