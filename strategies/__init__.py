"""Aggregation strategies by name (Flower's implementations) and the round-observing wrapper."""

from .observed import Observed, RoundFailed, RoundLog
from .registry import build_strategy

__all__ = ["Observed", "RoundFailed", "RoundLog", "build_strategy"]
