"""A run's results folder as files and typed records: written by the ServerApp, read by the
CLI, the Python API, sweeps and the attack stage."""
