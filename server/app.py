"""The ServerApp: validate the run config, open the results folder, run the federation.

Per round (:mod:`server.loop`): sample clients, send the global model, aggregate their
updates, evaluate the new global model on the held-out test set, append one record to
``metrics.jsonl`` (flushed, so a crash keeps finished rounds) and print a table row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.serverapp import Grid, ServerApp

from strategies.rounds import WorkerLost
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

from .console import say
from .federation import run_federation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, open the results folder, run the rounds, record everything.

    With ``sweep-cells`` (written by ``fedpriv sweep``), run every cell of a sweep in
    turn in this one simulation instead: one start-up for the whole sweep.
    """
    cfg = validate(context.run_config)
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
    """Every cell of a sweep, one after another, on this simulation's warm clients.

    Each cell has its own config, results folder, model, strategy and privacy state;
    the clients learn the cell from each message (:mod:`strategies.grid`) and keep its
    state apart (:func:`clients.app.assignment_mod`). A failed cell is recorded in its
    run.json and the next one starts.
    """
    cells = json.loads(cells_file.read_text())["cells"]
    host = dict(context.run_config)
    with Bar("sweep: cells done", len(cells), eager=True) as bar:
        for n, cell in enumerate(cells, 1):
            values = cell["config"]
            say(f"cell {cell['index']} ({n}/{len(cells)}): {cell['label']}")
            differs = {k: v for k, v in values.items() if host.get(k) != v}
            own = Context(run_id=context.run_id, node_id=context.node_id,
                          node_config=dict(context.node_config), state=RecordDict(),
                          run_config=dict(values))
            try:
                run_one(grid, own, validate(values), {"cell": int(cell["index"]), **differs})
            except WorkerLost as exc:  # the warm clients are broken: the later cells
                for rest in cells[n:]:  # cannot run
                    folder = Path(rest["config"]["run-dir"])
                    folder.mkdir(parents=True, exist_ok=True)
                    RunFolder(folder).write_info(RunInfo(
                        status="failed", finished=now(),
                        error=f"not run: in cell {cell['index']}, {exc}. Run this cell again."))
                raise
            except Exception:  # recorded in the cell's run.json; the sweep goes on
                pass
            bar.advance()
