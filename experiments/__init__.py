"""The command line, presets, sweeps, results tables and plots, and benchmarks."""
