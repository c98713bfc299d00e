"""Rounds: the one round runner (runner.py), the transport protocols (protocols/: plain,
SecAgg+, HE), the server-side aggregations (aggregation.py: a Flower strategy;
central_dp.py: DP-FedAvg), the run's view of Flower's grid (grid.py), and build.py, which
assembles them from a run config."""
