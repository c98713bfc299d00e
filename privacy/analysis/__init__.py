"""Measuring what a release reveals: (originals, release, holdout) in, plain numbers out."""
