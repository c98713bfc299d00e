"""The audit's canaries: gradients the auditor crafts, each inserted with probability 1/2.

Following the white-box audits of Nasr et al. (2023, "Tight auditing of differentially
private machine learning") and Steinke, Nasr & Jagielski (2023, section 6), each canary
is a *Dirac gradient*: a record whose gradient is ``norm`` (the clipping norm, so DP-SGD
clips it to itself) at one coordinate of the flattened parameters and zero elsewhere.
An included canary is a record of the client's data like any other — DP-SGD samples,
clips and noises it and its accountant counts it — except that its gradient is the
crafted one instead of a loss gradient. Coordinates are distinct and public (the
auditor's own records); which canaries were included is secret to the client and the
scorer.

Input-space canaries (random images with random labels) were measured too and leak far
less on fedpriv's CNNs after one epoch (canary-inclusion AUC 0.58, audited epsilon 0 on
an undefended MNIST update): a CNN's shared convolutions mix them with the data, so
they would audit the attack, not the mechanism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class GradientCanaries:
    """``index[k]``: canary k's coordinate in the parameters flattened in model order."""

    index: np.ndarray
    norm: float

    @classmethod
    def make(cls, count: int, num_params: int, norm: float, seed: int) -> GradientCanaries:
        if count > num_params:
            raise ValueError(f"{count} canaries need as many distinct coordinates; the model "
                             f"has {num_params} parameters")
        index = np.random.default_rng(seed).choice(num_params, count, replace=False)
        return cls(np.sort(index), float(norm))

    def __len__(self) -> int:
        return len(self.index)

    def scores(self, update: torch.Tensor) -> np.ndarray:
        """The attacker's score per canary: how far the update moved against its gradient
        (``update`` flattened in model order; SGD moves by minus the gradient)."""
        flat = update.detach().reshape(-1).cpu()
        return (-flat[torch.from_numpy(self.index)]).double().numpy()

    def inject(self, params: Sequence[torch.nn.Parameter], ids: torch.Tensor) -> None:
        """After ``backward``: give the batch rows holding canaries (``ids`` >= 0) their
        crafted gradient. With Opacus' per-sample gradients it is written into the row's
        ``grad_sample`` (DP-SGD then clips and noises it like any record's); otherwise it
        is added to the batch's mean gradient."""
        rows = torch.nonzero(ids >= 0).flatten()
        if not len(rows):
            return
        sizes = [p.numel() for p in params]
        starts = np.cumsum([0, *sizes[:-1]])
        coords = self.index[ids[rows].cpu().numpy()]
        which = np.searchsorted(starts, coords, side="right") - 1
        for i in np.unique(which):  # one indexed write per parameter tensor
            p, mine = params[int(i)], which == i
            # the coordinate's index in the parameter's shape: right whatever its memory
            # layout (a plain client's convolutions are channels-last)
            local = torch.unravel_index(torch.from_numpy(coords[mine] - starts[i]).to(p.device),
                                        p.shape)
            sample = getattr(p, "grad_sample", None)
            if sample is not None:
                at = rows[torch.from_numpy(mine)].to(p.device)
                sample.index_put_(
                    (at, *local), torch.full((len(at),), self.norm, dtype=sample.dtype,
                                             device=p.device), accumulate=True)
            else:
                p.grad.index_put_(
                    local, torch.full((len(local[0]),), self.norm / len(ids),
                                      dtype=p.grad.dtype, device=p.device), accumulate=True)


def canary_inclusion(count: int, seed: int) -> np.ndarray:
    """Which canaries go into the training data, each with probability 1/2 (secret)."""
    return np.random.default_rng(seed).random(count) < 0.5


@dataclass(frozen=True)
class DirectionCanaries:
    """Random-direction canaries (Andrew et al., ICLR 2024, "One-shot Empirical Privacy
    Estimation for Federated Learning"): canary k is a unit vector drawn uniformly on the
    sphere of the flattened parameters, regenerated from ``(seed, k)`` when needed (a
    thousand of them for a 26,010-parameter model would otherwise hold 200 MB). A canary
    client sends ``norm`` times its direction as its update; the auditor's statistic is
    the cosine between the released model's change and each direction. In high dimension
    the directions are nearly orthogonal (their cosines are about N(0, 1 / dim)), so a
    held-out direction's cosine is what an inserted one's would be without the canary."""

    count: int
    dim: int
    norm: float
    seed: int
    cache_entries: int = 2 ** 25  # float32 entries kept between calls (128 MB)
    _cache: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return self.count

    def direction(self, k: int) -> np.ndarray:
        """Canary k's unit vector (float64, length ``dim``), drawn in float32 from
        ``(seed, k)``; kept while the cache has room (a canary client sends it every round)."""
        if not 0 <= k < self.count:
            raise IndexError(f"canary {k} of {self.count}")
        v = self._cache.get(int(k))
        if v is None:
            v = np.random.default_rng([self.seed, int(k)]).standard_normal(
                self.dim, dtype=np.float32)
            v = (v / np.linalg.norm(v.astype(np.float64))).astype(np.float32)
            if (len(self._cache) + 1) * self.dim <= self.cache_entries:
                self._cache[int(k)] = v
        return v.astype(np.float64)

    def update(self, k: int) -> np.ndarray:
        """What canary client k sends: ``norm`` times its direction."""
        return self.norm * self.direction(k)

    def cosines(self, vector: np.ndarray) -> np.ndarray:
        """The cosine between ``vector`` (flattened, length ``dim``) and every canary."""
        v = np.asarray(vector, dtype=np.float64).reshape(-1)
        if v.shape != (self.dim,):
            raise ValueError(f"a vector of {self.dim} entries is needed, got {v.shape}")
        length = float(np.linalg.norm(v))
        if length == 0:
            return np.zeros(self.count)
        return np.array([float(self.direction(k) @ v) for k in range(self.count)]) / length
