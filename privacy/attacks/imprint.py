"""A malicious server's trap weights: binning the first linear layer ("Robbing the Fed").

Fowl, Geiping, Czaja, Goldblum & Goldstein (ICLR 2022) show that a server choosing the
weights of a linear layer followed by a ReLU can make each record of a batch fall out of
the update verbatim, and through secure aggregation, since the attack reads only sums.
Weights-only version for fedpriv's MLP (the client builds the architecture itself):

- every unit i of the first layer measures the same statistic, w_i = v (here the mean
  input value, v = 1/d), with bias -c_i, where c_1 < ... < c_h are quantiles of
  <v, x> over the server's own data: unit i fires for exactly the records whose
  statistic exceeds c_i;
- the second layer gives every first-layer unit the same outgoing weights, so a
  record's loss gradient reaches every unit it fires with the same factor gamma(x);
- then the gradient of row i minus that of row i+1 sums gamma(x) x over the records in
  bin (c_i, c_(i+1)], and the bias gradients sum gamma(x): their ratio is the mean of
  the bin's records, *exactly one record* when the bin holds one.

A FedAvg update of one local SGD step is -lr times that gradient, and an aggregate a
weighted sum of such updates, so the ratio is unchanged by either (lr and each client's
weight cancel within a bin that holds one record). More local steps move the trap a
little between steps; bins then mix records. Bins are at most the layer's width: with
h units and n records in all (the whole cohort under secure aggregation), a record is
alone in its bin with probability about (1 - 1/h)^(n - 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Trap:
    """Which parameters the server tampered with, and the bins it set."""

    first: str  # the first linear layer's parameter name prefix ("1" in nn.Sequential)
    second: str  # the next linear layer's prefix
    thresholds: torch.Tensor  # c_1 < ... < c_h


def linear_layers(model: nn.Module) -> list[str]:
    """The names of the model's linear layers, in order."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def trap_weights(model: nn.Module, honest: Mapping[str, torch.Tensor], aux_x: torch.Tensor
                 ) -> tuple[dict[str, torch.Tensor], Trap]:
    """The weights the malicious server sends: ``honest`` with its first linear layer set to
    equal-mass bins of the mean input value over ``aux_x`` (the server's own data) and the
    next layer's columns made equal. Raises ValueError for a model with no two linear
    layers in a row after the input (the attack needs the first layer to see the input)."""
    layers = linear_layers(model)
    if len(layers) < 2 or not isinstance(next(iter(model.children()), None),
                                         (nn.Flatten, nn.Linear)):
        raise ValueError("the binning trap needs a model whose first layer is linear on "
                         "the (flattened) input and is followed by another linear layer "
                         "(fedpriv's mlp)")
    first, second = layers[0], layers[1]
    w1 = honest[f"{first}.weight"]
    h, d = w1.shape
    stat = aux_x.reshape(len(aux_x), -1).double().mean(1)
    levels = torch.quantile(stat, torch.linspace(0, 1, h + 2, dtype=torch.float64)[1:-1])
    out = {k: v.clone() for k, v in honest.items()}
    out[f"{first}.weight"] = torch.full_like(w1, 1.0 / d)
    out[f"{first}.bias"] = (-levels).to(w1.dtype)
    w2 = honest[f"{second}.weight"]
    out[f"{second}.weight"] = w2[:, :1].expand_as(w2).clone()  # equal outgoing weights
    return out, Trap(first, second, levels)


def recover(update: Mapping[str, torch.Tensor], trap: Trap, min_weight: float = 1e-12
            ) -> torch.Tensor:
    """The records that fell alone (or together, averaged) into a bin, from an update
    (or an aggregate of updates) of the trapped layer: [bins that held records, d]."""
    w = update[f"{trap.first}.weight"].double()
    b = update[f"{trap.first}.bias"].double()
    # unit i fires for records above c_i: differences of neighbours isolate one bin
    dw = torch.cat([w[:-1] - w[1:], w[-1:]])
    db = torch.cat([b[:-1] - b[1:], b[-1:]])
    held = db.abs() > min_weight * max(float(b.abs().max()), 1e-30)
    return (dw[held] / db[held].unsqueeze(1)).float()


def trap_of(model: nn.Module, sent: Mapping[str, torch.Tensor]) -> Trap | None:
    """The trap in weights a server sent, if they hold one: a first linear layer whose
    rows are all equal with distinct increasing thresholds (an honest layer never is)."""
    layers = linear_layers(model)
    if len(layers) < 2 or f"{layers[0]}.weight" not in sent:
        return None
    w, b = sent[f"{layers[0]}.weight"], sent[f"{layers[0]}.bias"]
    if not (bool(torch.allclose(w, w[:1].expand_as(w))) and bool((b[:-1] >= b[1:]).all())):
        return None
    return Trap(layers[0], layers[1], -b.detach().double().cpu())

