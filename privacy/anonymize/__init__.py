"""Anonymizers for embeddings: fit on one client's (x, y), return what it releases.

Every anonymizer returns a :class:`Release` that says honestly what was released (the
vectors and labels, which original row each released row came from, the group each
original row was merged into, the mechanism's parameters), so
:mod:`privacy.analysis.release_metrics` can score it against the originals and a
holdout. The methods: k-Same (:mod:`.ksame`), DBSCAN clusters (:mod:`.density`),
per-record noise and masks (:mod:`.noise`), the seed project's transforms
(:mod:`.transforms`) and a conditional VAE (:mod:`.cvae`); :mod:`.registry` names them.
"""

from .params import CVAEParams
from .registry import (
    ANONYMIZERS,
    anonymize,
    dp_sgd_unit,
    public_transform,
    raw_input_anonymizers,
    rowwise_anonymizers,
)
from .release import AnonymizationError, Release

__all__ = ["ANONYMIZERS", "AnonymizationError", "CVAEParams", "Release", "anonymize",
           "dp_sgd_unit", "public_transform", "raw_input_anonymizers", "rowwise_anonymizers"]
