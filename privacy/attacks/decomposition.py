"""Membership by decomposing the update into the candidates' gradients (white-box).

A FedAvg update is minus the learning rate times a sum of its records' gradients, taken
along the path of local SGD from the weights the server sent to those it got back. The
server knows both ends of that path and every candidate record, so it can ask which
candidates' gradients the update is made of: it computes each candidate's gradient at
``points`` weights spaced along the straight path from sent to returned (a linearisation
of the SGD trajectory, as in the path-integral view of Koh & Liang 2017's influence and
in the multi-step replay of Geiping et al. 2020), and solves the ridge least-squares
problem  min_a || -update - sum_{j,p} a_{j,p} g_j(theta_p) ||^2 + lam ||a||^2 .
A candidate's score is its total coefficient sum_p a_{j,p}: members' gradients are in
the update, so they get clearly positive weights; non-members' only explain what
correlates with members.

This is a white-box membership attack in the family of Nasr, Shokri & Houmansadr (2019,
"Comprehensive Privacy Analysis of Deep Learning", gradient features of the target
record), made joint over all candidates; it needs the per-record gradients of every
candidate at each point (candidates x points x parameters floats) and a solve of that
size, so its cost grows with the candidate count squared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from .membership import per_record_gradients

Progress = Callable[[str], None]


def decomposition_scores(model: nn.Module, sent: Mapping[str, torch.Tensor],
                         update: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                         points: int = 3, ridge: float = 1e-4,
                         progress: Progress | None = None) -> torch.Tensor:
    """Each candidate's total coefficient in the ridge decomposition of ``-update`` over
    the candidates' gradients at ``points`` weights from sent to sent + update."""
    names = [k for k, _ in model.named_parameters()]
    target = -torch.cat([update[k].reshape(-1) for k in names]).double()
    blocks = []
    for p in range(points):
        t = p / (points - 1) if points > 1 else 0.5
        at = {k: sent[k] + t * update[k] for k in names}
        blocks.append(per_record_gradients(model, at, x, y))
        if progress:
            progress(f"decomposition: gradients at {p + 1}/{points} points of the path")
    n = len(y)
    gram = torch.empty(points * n, points * n, dtype=torch.float64, device=target.device)
    rhs = torch.empty(points * n, dtype=torch.float64, device=target.device)
    for i, a in enumerate(blocks):
        rhs[i * n:(i + 1) * n] = a.double() @ target
        for j in range(i, points):
            block = (a @ blocks[j].T).double()
            gram[i * n:(i + 1) * n, j * n:(j + 1) * n] = block
            gram[j * n:(j + 1) * n, i * n:(i + 1) * n] = block.T
    scale = float(gram.diagonal().mean()) or 1.0
    gram.diagonal().add_(ridge * scale)
    coef = torch.linalg.solve(gram, rhs)
    return coef.reshape(points, n).sum(0).float().cpu()
