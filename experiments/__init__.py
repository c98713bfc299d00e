"""Everything around the Flower apps: the CLI, the Python API, runs, sweeps, attacks, deployment."""
