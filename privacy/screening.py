"""A client's screen of the weights it receives, before it trains on them.

Adversary: an active server that plants the published binning trap (Fowl et al. 2022,
:mod:`privacy.attacks.imprint`). That trap makes every row of the first linear layer
the same measurement, so the layer is (close to) rank one: its top singular value
carries almost all of its Frobenius norm. Honest layers, freshly initialised or trained,
spread it over many directions (about 0.5% for fedpriv's 1,024-unit MLP at
initialisation). ``rank-one`` refuses to train when the top direction carries more than
half.

What it does not stop: a server that knows the screen. The same bins survive rows made
to look unrelated on inputs that carry no information (``server-trap =
binning-disguised``), and Garov et al. (ICLR 2024, "Hiding in Plain Sight: Disguising
Data Stealing Attacks in Federated Learning") show malicious weights that pass
statistical screens in general. A screen raises the bar against a careless server; only
local DP bounds what any server learns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config reads SCREENS without importing torch
    import torch
    from torch import nn

RANK_ONE_LIMIT = 0.5


def first_linear(model: nn.Module) -> nn.Linear | None:
    """The model's first linear layer, if it has one."""
    from torch import nn

    return next((m for m in model.modules() if isinstance(m, nn.Linear)), None)


def top_direction_share(weight: torch.Tensor) -> float:
    """sigma_1^2 / ||W||_F^2: the share of the layer's energy in its top direction."""
    import torch

    w = weight.detach().double()
    total = float((w ** 2).sum())
    if total == 0:
        return 1.0
    return float(torch.linalg.matrix_norm(w, ord=2) ** 2) / total


def rank_one(model: nn.Module) -> str | None:
    """Why the weights are refused (the first linear layer is nearly rank one), or None."""
    layer = first_linear(model)
    if layer is None or min(layer.weight.shape) < 2:
        return None
    share = top_direction_share(layer.weight)
    if share > RANK_ONE_LIMIT:
        return (f"the first linear layer is nearly rank one (its top direction carries "
                f"{share:.0%} of its norm; honest layers spread it): a binning trap")
    return None


SCREENS: dict[str, Callable[[nn.Module], str | None] | None] = {
    "none": None, "rank-one": rank_one}


def screen(name: str, model: nn.Module) -> str | None:
    """Run the screen ``name`` (a key of :data:`SCREENS`) on the received model."""
    check = SCREENS[name]
    return None if check is None else check(model)
