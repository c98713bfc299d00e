"""What an honest-but-curious server holds after a round: the attacks' only input.

For each observed client: the weights it sent, the weights that came back, the round's
training configuration, and whatever the client disclosed (its number of examples when
it sends it). Under secure aggregation the server holds no client's weights, only the
aggregate; an observation then says so (``client = None``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

AGGREGATE = "aggregate"


@dataclass(frozen=True)
class LocalTraining:
    """How the client trains, as the server configured it (public to the server)."""

    lr: float
    momentum: float
    weight_decay: float
    local_epochs: int
    batch_size: int
    proximal_mu: float = 0.0


@dataclass
class Observation:
    """One round's view of one client (or of the aggregate, ``client`` None)."""

    round: int
    client: int | None  # partition id; None for the secure aggregate
    sent: dict[str, np.ndarray]  # the global weights the server sent
    received: dict[str, np.ndarray]  # the weights that came back (or the new aggregate)
    training: LocalTraining
    num_examples: int | None  # as the client disclosed it (None: not disclosed)
    input_shape: tuple[int, ...]
    num_classes: int
    mean: tuple[float, ...] = (0.0,)  # input normalization, public like the architecture
    std: tuple[float, ...] = (1.0,)
    kind: str = "image"  # image | vector
    disclosed: dict[str, Any] = field(default_factory=dict)  # other values the client sent
    released: dict[str, np.ndarray] | None = None  # the round's new global model
    tampered: str | None = None  # the trap a malicious server sent this round, if any

    @property
    def name(self) -> str:
        who = AGGREGATE if self.client is None else f"client-{self.client}"
        return f"round-{self.round}-{who}"

    def update(self) -> dict[str, torch.Tensor]:
        """received - sent, per parameter (float32)."""
        return {k: torch.from_numpy(np.asarray(self.received[k], dtype=np.float32)
                                    - np.asarray(self.sent[k], dtype=np.float32))
                for k in self.sent}

    def save(self, folder: Path) -> Path:
        """``<folder>/<name>.npz`` (weights) and ``.json`` (everything else)."""
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {f"sent/{k}": v for k, v in self.sent.items()}
        arrays.update({f"received/{k}": v for k, v in self.received.items()})
        arrays.update({f"released/{k}": v for k, v in (self.released or {}).items()})
        np.savez(folder / f"{self.name}.npz", **arrays)
        meta = {k: v for k, v in asdict(self).items()
                if k not in ("sent", "received", "released")}
        meta["keys"] = list(self.sent)
        (folder / f"{self.name}.json").write_text(json.dumps(meta, indent=2, default=float))
        return folder / f"{self.name}.json"

    @classmethod
    def load(cls, meta_path: Path) -> Observation:
        meta = json.loads(meta_path.read_text())
        keys = meta.pop("keys")
        with np.load(meta_path.with_suffix(".npz")) as f:
            sent = {k: f[f"sent/{k}"] for k in keys}
            received = {k: f[f"received/{k}"] for k in keys}
            released = ({k: f[f"released/{k}"] for k in keys}
                        if f"released/{keys[0]}" in f.files else None)
        meta["training"] = LocalTraining(**meta["training"])
        meta["input_shape"] = tuple(meta["input_shape"])
        meta["mean"], meta["std"] = tuple(meta["mean"]), tuple(meta["std"])
        return cls(sent=sent, received=received, released=released, **meta)


def load_all(folder: Path) -> list[Observation]:
    """Every observation saved in ``folder``, by round then client."""
    obs = [Observation.load(p) for p in sorted(folder.glob("round-*.json"))]
    return sorted(obs, key=lambda o: (o.round, -1 if o.client is None else o.client))


def state_dict(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}
