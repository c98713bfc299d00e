"""Aggregation: Flower's strategies by name, the round-observing wrapper, DP-FedAvg and
SecAgg+ rounds. Import the submodules; this package imports nothing itself, so reading
the strategy names (``strategies.registry``) does not load Flower."""
