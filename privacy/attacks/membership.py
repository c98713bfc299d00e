"""Membership inference: was a candidate record in a client's training data?

Each attack scores candidate records (higher: more likely a member) from what the
server holds; the candidates come without their membership, which only the scorer knows
(:mod:`privacy.analysis.leakage_metrics`).

- **Loss threshold** (Yeom, Giacomelli, Fredrikson & Jha 2018): members have lower loss
  under the trained model; score = -loss under the model the client returned (or the
  released global model).
- **Gradient alignment**: a member's gradient at the weights the server sent points the
  way the client's update went; score = cosine(-gradient, update), per candidate.
- **Loss drop**: score = loss under the sent model - loss under the returned one, which
  removes how hard a record is to begin with (a calibrated loss attack, in the spirit of
  the reference-model attacks of Carlini et al. 2022, with the sent model as reference).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


@torch.no_grad()
def losses(model: nn.Module, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
           y: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """Per-record cross-entropy of ``model`` with ``weights``."""
    model.load_state_dict(dict(weights), strict=False)
    model.eval()
    device = next(model.parameters()).device
    out = [nn.functional.cross_entropy(model(x[i:i + batch].to(device)),
                                       y[i:i + batch].to(device), reduction="none").cpu()
           for i in range(0, len(y), batch)]
    return torch.cat(out) if out else torch.zeros(0)


def loss_scores(model: nn.Module, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
                y: torch.Tensor) -> torch.Tensor:
    """Yeom et al.'s attack: minus the loss."""
    return -losses(model, weights, x, y)


def loss_drop_scores(model: nn.Module, sent: Mapping[str, torch.Tensor],
                     received: Mapping[str, torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor) -> torch.Tensor:
    """How much the client's training lowered each candidate's loss."""
    return losses(model, sent, x, y) - losses(model, received, x, y)


def per_record_gradients(model: nn.Module, weights: Mapping[str, torch.Tensor],
                         x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """[N, parameters]: each record's loss gradient at ``weights`` (model order)."""
    names = [k for k, _ in model.named_parameters()]
    buffers = dict(model.named_buffers())
    params = {k: weights[k].detach() for k in names}
    device = params[names[0]].device

    def loss_of(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_record = vmap(grad(loss_of), in_dims=(None, 0, 0))
    rows = []
    for i in range(0, len(y), batch):
        g = per_record(params, x[i:i + batch].to(device), y[i:i + batch].to(device))
        rows.append(torch.cat([g[k].reshape(len(g[k]), -1) for k in names], dim=1))
    return torch.cat(rows) if rows else torch.zeros(0, sum(params[k].numel() for k in names))


def alignment_scores(model: nn.Module, sent: Mapping[str, torch.Tensor],
                     update: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                     batch: int = 256) -> torch.Tensor:
    """cosine(-per-record gradient at the sent weights, the observed update)."""
    names = [k for k, _ in model.named_parameters()]
    target = torch.cat([update[k].reshape(-1) for k in names])
    scores = [nn.functional.cosine_similarity(  # a batch at a time: N x parameters is big
        -per_record_gradients(model, sent, x[i:i + batch], y[i:i + batch]),
        target.unsqueeze(0), dim=1).cpu() for i in range(0, len(y), batch)]
    return torch.cat(scores) if scores else torch.zeros(0)
