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
from dataclasses import dataclass

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
            local = torch.from_numpy(coords[mine] - starts[i]).to(p.device)
            sample = getattr(p, "grad_sample", None)
            if sample is not None:
                at = rows[torch.from_numpy(mine)].to(p.device)
                sample.view(len(sample), -1).index_put_(
                    (at, local), torch.full((len(at),), self.norm, dtype=sample.dtype,
                                            device=p.device), accumulate=True)
            else:
                p.grad.view(-1).index_put_(
                    (local,), torch.full((len(local),), self.norm / len(ids),
                                         dtype=p.grad.dtype, device=p.device), accumulate=True)


def canary_inclusion(count: int, seed: int) -> np.ndarray:
    """Which canaries go into the training data, each with probability 1/2 (secret)."""
    return np.random.default_rng(seed).random(count) < 0.5
