"""Strategies by name: Flower's, configured from the run config, and users' own.

The run-config schema lives below this layer (``tasks.config``) and cannot see this
registry, so it accepts any name for ``strategy``; the name is checked against this
registry where the strategies are visible: by the CLI and the Python API before anything
starts (``experiments.configs.check_registered``, in ``resolve`` and the pre-flight
check) and by :func:`strategies.build.build_strategy` in the ServerApp. Importing this
module loads no Flower: the entries are imported on first use.
"""

from __future__ import annotations

from privacy.registry import Registry
from tasks.config import ConfigError

STRATEGIES: Registry = Registry(
    "strategy", where="strategies.registry.STRATEGIES", error=ConfigError,
    signature="strategy(fed: tasks.config.FederationConfig, common: dict[str, Any], lr: float) "
              "-> a flwr.serverapp.strategy.Strategy (Message API); common holds the arguments "
              "every Flower strategy takes (strategies.build.common_args)")
"""Flower strategies by name: ``(federation section, common arguments, client lr) ->
Strategy``; see :func:`strategies.build.fedavg` for the simplest."""
STRATEGIES.register("fedavg", "strategies.build:fedavg")
STRATEGIES.register("fedprox", "strategies.build:fedprox")
STRATEGIES.register("fedadam", "strategies.build:fedadam")
STRATEGIES.register("fedavgm", "strategies.build:fedavgm")
STRATEGIES.register("fedmedian", "strategies.build:fedmedian")
STRATEGIES.register("fedtrimmedavg", "strategies.build:fedtrimmedavg")
