"""What a round runner carries from one round to the next, for checkpoints.

Flower's strategies keep their optimizer state as attributes: FedAdam (FedOpt) its
moments ``m_t`` and ``v_t``, FedAvgM its ``momentum_vector``. DP-FedAvg keeps its
accountant and adaptive clipping norm (:meth:`strategies.central_dp.CentralPrivacy.state`).
Everything else a round needs (the sample, the noise) is derived from the seed and the
round number, so it needs no saving.
"""

from __future__ import annotations

from typing import Any

import numpy as np

RunnerState = tuple[dict[str, Any], dict[str, np.ndarray]]  # (JSON-able, arrays)
MOMENTS = ("m_t", "v_t", "momentum_vector")


def strategy_state(strategy: Any) -> RunnerState:
    """The optimizer state of a Flower strategy, and DP-FedAvg's privacy state."""
    from .central_dp import CentralDP

    meta: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    if isinstance(strategy, CentralDP):
        meta["central"] = strategy.privacy.state()
    for name in MOMENTS:
        value = getattr(strategy, name, None)
        if value is None:
            continue
        keys = list(value) if isinstance(value, dict) else list(range(len(value)))
        meta[name] = {"dict": isinstance(value, dict), "keys": [str(k) for k in keys]}
        for i, k in enumerate(keys):
            arrays[f"{name}.{i}"] = np.asarray(value[k])
    return meta, arrays


def restore_strategy(strategy: Any, state: RunnerState) -> None:
    """Put back what :func:`strategy_state` saved."""
    meta, arrays = state
    if "central" in meta:
        strategy.privacy.restore(meta["central"])
    for name in MOMENTS:
        if name not in meta:
            continue
        keys = meta[name]["keys"]
        values = [arrays[f"{name}.{i}"] for i in range(len(keys))]
        setattr(strategy, name, dict(zip(keys, values, strict=True)) if meta[name]["dict"]
                else values)
