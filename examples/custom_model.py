"""A model of your own: a two-layer MLP registered as ``tiny-mlp``.

From the repository root::

    fedpriv run --set plugins=examples.custom_model --set model=tiny-mlp
    python examples/custom_model_study.py     # tiny-mlp against the built-in small-cnn

``plugins`` makes every fedpriv process — the CLI, the pre-flight check, the ServerApp and
each ClientApp (Ray workers) — import this module before it checks the run config, so
they all know ``tiny-mlp``. A model factory takes the input shape (without the batch
dimension), the number of classes and the ``mlp-hidden`` widths, and returns a torch
module; DP-SGD (``dp = "local"``) can train it when it has no BatchNorm.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tasks.registry import MODELS

if TYPE_CHECKING:
    from torch import nn

WIDTH = 32  # hidden units: 784 -> 32 -> 10 on MNIST is 25,450 parameters


@MODELS.register("tiny-mlp")
def tiny_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = ()
             ) -> nn.Module:
    """Flatten, Linear(WIDTH), ReLU, Linear(num_classes); ``hidden`` is not used."""
    from torch import nn  # imported when the model is built: the CLI, which only checks
    # the config, never loads torch

    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, num_classes))
