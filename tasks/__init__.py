"""What both sides of the federation share.

Datasets, partitioning, models, the local train/eval loops, and the run-config schema.
"""

from .headless import keep_matplotlib_importable

keep_matplotlib_importable()  # before anything imports matplotlib (a notebook's MPLBACKEND)
