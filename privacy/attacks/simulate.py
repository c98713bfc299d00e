"""The client's local training, replayed differentiably: how an attacker maps candidate
data to the update that data would have produced.

The server configured the round (learning rate, momentum, weight decay, epochs, batch
size, FedProx's mu) and knows the model, so it can replay plain SGD from the weights it
sent on candidate inputs and differentiate the resulting update with respect to them
(Geiping et al. 2020, section 5: attacking multi-step FedAvg updates). The batch order
of the real client is unknown; the replay takes the candidates in order, which is the
standard assumption. Under DP-SGD the replay is still plain SGD: the attacker does not
know the clipping's effect or the noise that was added.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call

from .observation import LocalTraining


def batches(n: int, t: LocalTraining) -> list[slice]:
    """The local steps of a client with ``n`` examples: epochs x ceil(n / B) batches."""
    per_epoch = [slice(i, min(i + t.batch_size, n)) for i in range(0, n, t.batch_size)]
    return per_epoch * t.local_epochs


def replay(model: nn.Module, start: Mapping[str, torch.Tensor], x: torch.Tensor,
           y: torch.Tensor, t: LocalTraining, create_graph: bool = True
           ) -> dict[str, torch.Tensor]:
    """The update (trained - start) that local SGD on (x, y) produces from ``start``.

    ``y`` holds class indices, or per-example class probabilities (soft labels, DLG).
    Differentiable with respect to ``x`` (and a soft ``y``) when ``create_graph``.
    """
    names = [k for k, _ in model.named_parameters()]
    buffers = {k: v for k, v in model.named_buffers()}
    anchor = {k: start[k].detach() for k in names}
    params = {k: start[k].detach().clone().requires_grad_(True) for k in names}
    momentum: dict[str, torch.Tensor] = {}
    for step in batches(len(x), t):
        out = functional_call(model, (params, buffers), (x[step],))
        loss = nn.functional.cross_entropy(out, y[step])
        if t.proximal_mu:
            loss = loss + 0.5 * t.proximal_mu * sum(((params[k] - anchor[k]) ** 2).sum()
                                                    for k in names)
        grads = torch.autograd.grad(loss, [params[k] for k in names],
                                    create_graph=create_graph)
        for k, g in zip(names, grads, strict=True):
            if t.weight_decay:
                g = g + t.weight_decay * params[k]
            # PyTorch's SGD: buf = g on the first step, then momentum * buf + g
            buf = g if k not in momentum else t.momentum * momentum[k] + g
            momentum[k] = buf
            params[k] = params[k] - t.lr * buf
    return {k: params[k] - anchor[k] for k in names}


def effective_steps(n: int, t: LocalTraining) -> float:
    """How many gradients' worth one update holds: sum over steps s of (1 - m^(T-s+1))/(1-m).

    Local SGD with momentum m over T steps moves the weights by -lr times that weighted
    sum of the gradients; without momentum it is T.
    """
    steps = len(batches(n, t))
    m = t.momentum
    if m == 0:
        return float(steps)
    return sum((1 - m ** (steps - s)) / (1 - m) for s in range(steps))


def flatten(tensors: Mapping[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([tensors[k].reshape(-1) for k in keys])


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation of a batch of images (mean absolute neighbour difference)."""
    if x.ndim < 4:
        return x.new_zeros(())
    dx = (x[:, :, :, 1:] - x[:, :, :, :-1]).abs().mean()
    dy = (x[:, :, 1:, :] - x[:, :, :-1, :]).abs().mean()
    return dx + dy
