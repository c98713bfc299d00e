"""What an anonymizer returns: the released rows, and how they relate to the originals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class AnonymizationError(ValueError):
    """The anonymizer cannot produce a usable release with these parameters."""


@dataclass
class Release:
    """What a client releases, and how it relates to the originals.

    ``source`` says which original row each released row came from (``None`` for
    synthetic data), ``groups`` which group each original row was merged into (-1:
    dropped), so the release metrics can be computed honestly.
    """

    x: np.ndarray  # released vectors, float32 (M, D)
    y: np.ndarray  # released labels (M,)
    source: np.ndarray | None = None  # original row of each released row (-1: none)
    groups: np.ndarray | None = None  # group id of each ORIGINAL row (-1: dropped)
    info: dict[str, Any] = field(default_factory=dict)
    transform: Callable[[np.ndarray], np.ndarray] | None = None  # public map for new data

    def __post_init__(self) -> None:
        if len(self.x) == 0:
            raise AnonymizationError("the anonymizer released nothing")
        if not np.isfinite(self.x).all():
            raise AnonymizationError("the anonymizer released non-finite values")
        self.x = np.ascontiguousarray(self.x, dtype=np.float32)
