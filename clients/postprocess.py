"""What a client does to its new weights after training, in order, before they leave it.

Like pfl-research's post-processors of an update, each step is one object, and the run
config decides the list (:func:`update_steps`): first pruning (the gradient-pruning
defence of Zhu et al. 2019), then clipping to the norm the server sent (central DP's
client-side clipping, McMahan et al. 2018). Two client-side privacy mechanisms are not
steps here because they act during training: audit canaries are added to gradients
(:mod:`privacy.attacks.canaries`) and DP-SGD's noise to every step (Opacus).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from privacy.dp.dpfedavg import CLIP_KEY, UNCLIPPED_KEY, clip
from tasks.config import RunConfig

State = dict[str, torch.Tensor]


class UpdateStep(Protocol):
    def apply(self, old: Mapping[str, torch.Tensor], new: State,
              metrics: dict[str, Any]) -> State:
        """The new weights after this step (``metrics``: what the client will report)."""
        ...


@dataclass(frozen=True)
class Prune:
    """Zero the ``fraction`` of the update's entries smallest in magnitude, over the whole
    model."""

    fraction: float

    def apply(self, old: Mapping[str, torch.Tensor], new: State,
              metrics: dict[str, Any]) -> State:
        update = {k: new[k] - old[k].to(new[k].dtype) for k in new}
        flat = torch.cat([u.abs().reshape(-1) for u in update.values()])
        k = int(self.fraction * len(flat))
        if k == 0:
            return dict(new)
        threshold = flat.kthvalue(k).values
        return {key: old[key].to(u.dtype) + torch.where(u.abs() > threshold, u,
                                                        torch.zeros_like(u))
                for key, u in update.items()}


@dataclass(frozen=True)
class ClipToNorm:
    """Scale the update to L2 norm at most ``norm``; report its norm before clipping and
    whether it was within the bound (adaptive clipping counts those)."""

    norm: float

    def apply(self, old: Mapping[str, torch.Tensor], new: State,
              metrics: dict[str, Any]) -> State:
        names = list(new)
        before = [old[k].cpu().numpy() for k in names]
        update, length = clip([new[k].numpy() - o for k, o in zip(names, before, strict=True)],
                              self.norm)
        metrics.update({"update-norm": length, UNCLIPPED_KEY: int(length <= self.norm)})
        return {k: torch.from_numpy((o + u).astype(o.dtype))
                for k, o, u in zip(names, before, update, strict=True)}


def update_steps(cfg: RunConfig, round_config: Mapping[str, Any]) -> list[UpdateStep]:
    """The steps this run applies to a client's update, in order."""
    steps: list[UpdateStep] = []
    if cfg.leakage.prune_update:
        steps.append(Prune(cfg.leakage.prune_update))
    if cfg.privacy.dp == "central" and CLIP_KEY in round_config:
        steps.append(ClipToNorm(float(round_config[CLIP_KEY])))
    return steps
