"""The ServerApp: validate the run config, open the results folder, run the federation.

Per round (:mod:`server.loop`): sample clients, send the global model, aggregate their
updates, evaluate the new global model on the held-out test set, append one record to
``metrics.jsonl`` (flushed, so a crash keeps finished rounds) and print a table row.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.serverapp import Grid, ServerApp

from strategies.rounds import WorkerLost
from tasks.allocator import keep_freed_memory
from tasks.config import RunConfig, validate
from tasks.progress import Bar
from tasks.results.folder import (
    OutcomeAlreadyRecorded,
    RunFolder,
    default_run_name,
    now,
    read_run_info,
)
from tasks.results.info import RunInfo

from .cells import alone_reason, schedule
from .console import CELL_TAG, say
from .federation import run_federation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, open the results folder, run the rounds, record everything.

    With ``sweep-cells`` (written by ``fedpriv sweep``), run every cell of a sweep in
    turn in this one simulation instead: one start-up for the whole sweep.
    """
    cfg = validate(context.run_config)
    keep_freed_memory()  # the evaluation's batches without page faults (Ray's server too)
    if hasattr(grid, "pull_interval"):
        # The simulation's InMemoryGrid checks for client replies every 0.1 s by default;
        # polling every 10 ms takes about 0.05 s of idle waiting off each round.
        grid.pull_interval = 0.01
    if cfg.results.sweep_cells:
        run_cells(grid, context, Path(cfg.results.sweep_cells))
    else:
        run_one(grid, context, cfg)


def run_one(grid: Grid, context: Context, cfg: RunConfig,
            cell: dict[str, Any] | None = None) -> RunInfo:
    """One run into its own results folder; a failure is recorded in run.json and raised."""
    run = RunFolder.open(cfg.results, default_run_name(cfg))
    if not cfg.results.resume:  # a resumed run keeps the config it started with
        run.write_config(cfg)
    say(f"results: {run.path}")  # the one line that names the folder (open it while it runs)
    try:
        info = run_federation(grid, context, cfg, run, cell)
    except OutcomeAlreadyRecorded as exc:
        say(f"error: {exc}")
        raise
    except BaseException as exc:
        info = RunInfo.from_json({**read_run_info(run.path), "status": "failed",
                                  "finished": now(), "error": f"{type(exc).__name__}: {exc}"})
        say(f"error: {type(exc).__name__}: {exc}")
        try:
            run.write_info(info)
        except OutcomeAlreadyRecorded:
            pass
        except OSError as also:  # e.g. the disk is still full: the terminal has the cause
            say(f"error: run.json could not record it either: {also}")
        raise
    final = info.final or {}
    say(f"done: test accuracy {final.get('accuracy', float('nan')):.4f} after "
        f"{info.rounds_completed or 0} rounds in {info.wall_s or 0.0:.1f} s")
    return info


def run_cells(grid: Grid, context: Context, cells_file: Path) -> None:
    """Every cell of a sweep on this simulation's warm clients: one after another, or
    with the file's ``at-once`` > 1 that many side by side where the runtime gives each
    its own nodes and trains clients in worker processes (:mod:`.cells`: the in-process
    runtime's default).

    Each cell has its own config, results folder, model, strategy and privacy state;
    the clients learn the cell from each message (:mod:`strategies.grid`) and keep its
    state apart (:func:`clients.app.assignment_mod`). A failed cell is recorded in its
    run.json and the next one starts.
    """
    plan = json.loads(cells_file.read_text())
    cells = plan["cells"]
    # side by side only where every cell's clients train in worker processes of their own
    at_once = int(plan.get("at-once", 1)) if getattr(grid, "pool", None) is not None else 1
    host = dict(context.run_config)
    started: set[int] = set()
    lost_in: list[int] = []  # the cell whose clients' worker died
    advancing = threading.Lock()
    with Bar("sweep: cells done", len(cells), eager=True) as bar:
        def one(cell: dict[str, Any]) -> None:
            values = cell["config"]
            started.add(int(cell["index"]))
            beside = at_once > 1 and not alone(cell)
            CELL_TAG.set("")
            say(f"cell {cell['index']} ({len(started)}/{len(cells)}): {cell['label']}")
            CELL_TAG.set(f"cell {cell['index']}: " if beside else "")  # its lines from here
            differs = {k: v for k, v in values.items() if host.get(k) != v}
            own = Context(run_id=context.run_id, node_id=context.node_id,
                          node_config=dict(context.node_config), state=RecordDict(),
                          run_config=dict(values))
            try:
                run_one(grid.cell_view() if beside else grid, own, validate(values),
                        {"cell": int(cell["index"]), **differs})
            except WorkerLost:
                lost_in.append(int(cell["index"]))
                raise
            except Exception:  # recorded in the cell's run.json; the sweep goes on
                pass
            with advancing:
                bar.advance()

        def alone(cell: dict[str, Any]) -> bool:
            return alone_reason(validate(cell["config"])) is not None

        try:
            with _server_threads(1 if at_once > 1 else None):
                schedule(cells, at_once, alone, one)
        except WorkerLost as exc:  # the warm clients are broken: the later cells
            for rest in cells:  # cannot run
                if int(rest["index"]) in started:
                    continue
                folder = Path(rest["config"]["run-dir"])
                folder.mkdir(parents=True, exist_ok=True)
                RunFolder(folder).write_info(RunInfo(
                    status="failed", finished=now(),
                    error=f"not run: in cell {lost_in[0]}, {exc}. Run this cell again."))
            raise


@contextlib.contextmanager
def _server_threads(n: int | None) -> Iterator[None]:
    """The server's torch threads set to ``n`` for the block (None: as they are). Cells
    side by side evaluate while the other cells' clients train on every core: a team of
    threads per evaluation then spins against them (the 8-cell sweep 3% slower)."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
