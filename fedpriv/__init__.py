"""fedpriv's Python API (the `fedpriv` CLI runs the same code).

    import fedpriv
    result = fedpriv.run("mnist", num_clients=10, dp="local", target_epsilon=5)
    result.frame()                      # the ledger, one row per round (pandas)
    fedpriv.load("results/20261122-...").plots
    fedpriv.sweep("dp-epsilon-mnist", num_server_rounds=3).frame()
    fedpriv.sweep(grid={"dp": ["none", "local"]}, fixed={"target_epsilon": 5})
    fedpriv.load_sweep("results/sweeps/20261122-...").table()
    fedpriv.concat([run_a, run_b])      # several runs in one frame, settings as columns
    fedpriv.resume("results/20261122-...")  # a crashed run, from its last round
    fedpriv.runs()                      # past runs with their headline numbers (pandas)
    fedpriv.attack("results/20261122-...", "invert,mia")  # attack what a run observed
"""

from experiments.api import (
    Result,
    RunInterrupted,
    SweepResult,
    attack,
    concat,
    load,
    load_sweep,
    resume,
    run,
    run_config,
    runs,
    sweep,
)
from tasks.config import ConfigError
from tasks.version import __version__

__all__ = ["ConfigError", "Result", "RunInterrupted", "SweepResult", "__version__", "attack",
           "concat", "load", "load_sweep", "resume", "run", "run_config", "runs", "sweep"]
