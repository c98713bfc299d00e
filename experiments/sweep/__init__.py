"""`fedpriv sweep`: grids of runs, their table and plots (the sweep files: experiments/sweeps/)."""
