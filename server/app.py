"""The ServerApp: validate the run config, open the results folder, run the federation.

Per round (:mod:`server.loop`): sample clients, send the global model, aggregate their
updates, evaluate the new global model on the held-out test set, append one record to
``metrics.jsonl`` (flushed, so a crash keeps finished rounds) and print a table row.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from tasks.config import validate

from .console import say
from .federation import now, run_federation
from .results import RunFolder, default_run_name, read_run_info

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Validate the run config, open the results folder, run the rounds, record everything."""
    cfg = validate(context.run_config)
    if hasattr(grid, "pull_interval"):
        # The simulation's InMemoryGrid checks for client replies every 0.1 s by default;
        # polling every 10 ms takes about 0.05 s of idle waiting off each round.
        grid.pull_interval = 0.01
    run = RunFolder.open(cfg.results, default_run_name(cfg))
    run.write_config(cfg)
    say(f"results: {run.path}")
    try:
        info = run_federation(grid, context, cfg, run)
    except BaseException as exc:
        info = {**read_run_info(run.path), "status": "failed", "finished": now(),
                "error": f"{type(exc).__name__}: {exc}"}
        run.write_json("run.json", info)
        say(f"error: {type(exc).__name__}: {exc}")
        raise
    final = info.get("final", {})
    say(f"done: test accuracy {final.get('accuracy', float('nan')):.4f} after "
        f"{info.get('rounds-completed', 0)} rounds in {info['wall-s']:.1f} s · {run.path}")
