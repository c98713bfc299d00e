"""What both sides of the federation share.

Datasets, partitioning, models, the local train/eval loops, and the run-config schema.
"""
