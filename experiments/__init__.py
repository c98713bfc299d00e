"""Everything around the Flower apps: the CLI, the Python API, runs, sweeps, attacks, deployment."""

from tasks.headless import keep_matplotlib_importable

keep_matplotlib_importable()  # before anything imports matplotlib (a notebook's MPLBACKEND)
