"""Reference updates: the server simulates the client's local training on its own data.

Reference-model membership inference (LiRA, RMIA: :mod:`.calibrated`) calibrates each
candidate record's score against models trained like the target but on known data. For
a federated update the server has all it needs: the weights it sent, the round's
training configuration (it chose both), the architecture, and an auxiliary split of the
training distribution that is its own (``reference-fraction``; never a client's record).
So each reference is "the client's round, replayed on a reference dataset": local SGD
(or DP-SGD with the run's public noise multiplier and clipping norm) from the sent
weights, for the same epochs and batch size, on ``examples`` records drawn from the
auxiliary data and, for online attacks, from the candidates themselves (each in about
half of the references, Carlini et al. 2022). For an aggregate, a reference is the mean
of ``clients`` such simulated updates.

All references train at once: their parameters are stacked and one ``torch.func``
program (``vmap`` of ``grad`` over ``functional_call``; per-sample gradients for DP-SGD)
steps them together, on the GPU when the model is on one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from .observation import LocalTraining

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ReferenceSetup:
    """How the references are trained: as the observed client was (public facts only)."""

    training: LocalTraining
    examples: int  # records per simulated client (the client's disclosed count)
    clients: int = 1  # simulated clients averaged into one reference (an aggregate's cohort)
    references: int = 16
    dp_noise: float = 0.0  # DP-SGD's noise multiplier (0: plain SGD)
    dp_clip: float = 0.0  # DP-SGD's clipping norm
    seed: int = 0
    chunk: int = 16  # simulated clients stepped together (memory)


@dataclass
class References:
    """The trained references and which candidates each one trained on."""

    weights: dict[str, torch.Tensor]  # name -> [references, *shape], the released weights
    included: torch.Tensor  # bool [references, candidates]

    def __len__(self) -> int:
        return int(self.included.shape[0])


def inclusion_rate(setup: ReferenceSetup, candidates: int, min_in: int = 4) -> float:
    """Each candidate's chance to be in a reference's data: 1/2 (online LiRA) when the
    references hold enough records for that, less when they do not, and 0 (offline: the
    references train on the auxiliary data only) when a candidate would be in fewer than
    ``min_in`` references on average."""
    room = setup.examples * setup.clients / max(candidates, 1)
    rate = min(0.5, room)
    return rate if rate * setup.references >= min_in else 0.0


def draw_datasets(setup: ReferenceSetup, candidates: int, pool: int, rate: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each reference and simulated client, the rows it trains on: indices into
    candidates (0..C-1) then the pool (C..C+P-1), shape [R, clients, examples]; and which
    candidates each reference holds ([R, C])."""
    g = torch.Generator().manual_seed(setup.seed)
    n, c, r = setup.examples, setup.clients, setup.references
    if pool + (candidates if rate else 0) < n * c:
        raise ValueError(f"a reference needs {n * c} records and the server's auxiliary data "
                         f"has {pool}: raise reference-fraction")
    rows = torch.empty(r, c, n, dtype=torch.long)
    included = torch.zeros(r, candidates, dtype=torch.bool)
    for k in range(r):
        chosen = torch.nonzero(torch.rand(candidates, generator=g) < rate).flatten()
        chosen = chosen[torch.randperm(len(chosen), generator=g)][: n * c]
        fill = torch.randperm(pool, generator=g)[: n * c - len(chosen)] + candidates
        data = torch.cat([chosen, fill])
        rows[k] = data[torch.randperm(len(data), generator=g)].reshape(c, n)
        included[k, chosen] = True
    return rows, included


def train_references(model: nn.Module, sent: Mapping[str, torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor, candidates: int, setup: ReferenceSetup,
                     progress: Progress | None = None) -> References:
    """Train ``setup.references`` references from ``sent`` on rows of ``x``/``y`` (the
    candidates first, then the server's auxiliary data)."""
    rate = inclusion_rate(setup, candidates)
    rows, included = draw_datasets(setup, candidates, len(y) - candidates, rate)
    flat = rows.reshape(-1, setup.examples)  # one row per simulated client
    names = [k for k, _ in model.named_parameters()]
    device = sent[names[0]].device
    total: dict[str, torch.Tensor] = {}
    began = time.perf_counter()
    for start in range(0, len(flat), setup.chunk):
        idx = flat[start:start + setup.chunk]
        upd = local_training(model, sent, x[idx].to(device), y[idx].to(device), setup,
                             seed=setup.seed + start)
        for k in names:
            total[k] = torch.cat([total[k], upd[k]]) if k in total else upd[k]
        if progress:
            done = min(start + setup.chunk, len(flat))
            left = (time.perf_counter() - began) / done * (len(flat) - done)
            progress(f"reference training: {done}/{len(flat)} simulated clients"
                     + (f", about {left:.0f} s left" if done < len(flat) else ""))
    r, c = setup.references, setup.clients
    weights = {k: sent[k].unsqueeze(0) + total[k].reshape(r, c, *sent[k].shape).mean(1)
               for k in names}
    return References(weights, included)


def local_training(model: nn.Module, start: Mapping[str, torch.Tensor], x: torch.Tensor,
                   y: torch.Tensor, setup: ReferenceSetup, seed: int = 0
                   ) -> dict[str, torch.Tensor]:
    """M clients' local updates at once: ``x`` is [M, n, ...], ``y`` [M, n]. PyTorch SGD
    (momentum, weight decay, FedProx's term) or, with ``dp_noise``, DP-SGD: each record's
    gradient clipped to ``dp_clip`` and Gaussian noise of std ``dp_noise * dp_clip`` added
    to the batch's sum (Abadi et al. 2016), with shuffled batches of the set size."""
    t = setup.training
    names = [k for k, _ in model.named_parameters()]
    buffers = dict(model.named_buffers())
    m, n = y.shape
    anchor = {k: start[k].detach() for k in names}
    params = {k: anchor[k].unsqueeze(0).repeat(m, *([1] * anchor[k].ndim)) for k in names}
    g = torch.Generator(device="cpu").manual_seed(seed)

    def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xb,))
        return nn.functional.cross_entropy(out, yb)

    if setup.dp_noise or setup.dp_clip:
        per_sample = vmap(vmap(grad(lambda p, xi, yi: loss(p, xi[None], yi[None])),
                               in_dims=(None, 0, 0)))
    batch_grad = vmap(grad(loss))
    momentum: dict[str, torch.Tensor] = {}
    for _ in range(t.local_epochs):
        order = torch.stack([torch.randperm(n, generator=g) for _ in range(m)]).to(x.device)
        for i in range(0, n, t.batch_size):
            sel = order[:, i:i + t.batch_size]
            xb = torch.gather(x, 1, sel.view(m, -1, *[1] * (x.ndim - 2)).expand(
                -1, -1, *x.shape[2:]))
            yb = torch.gather(y, 1, sel)
            if setup.dp_noise or setup.dp_clip:
                grads = _dp_gradient(per_sample(params, xb, yb), setup, sel.shape[1], g)
            else:
                grads = batch_grad(params, xb, yb)
            for k in names:
                gk = grads[k]
                if t.proximal_mu:
                    gk = gk + t.proximal_mu * (params[k] - anchor[k])
                if t.weight_decay:
                    gk = gk + t.weight_decay * params[k]
                buf = gk if k not in momentum else t.momentum * momentum[k] + gk
                momentum[k] = buf
                params[k] = params[k] - t.lr * buf
    return {k: (params[k] - anchor[k]).detach() for k in names}


def _dp_gradient(sample: dict[str, torch.Tensor], setup: ReferenceSetup, batch: int,
                 g: torch.Generator) -> dict[str, torch.Tensor]:
    """Clip each record's gradient ([M, b, ...]) to the norm, sum, add noise, average."""
    norms = torch.sqrt(sum(v.flatten(2).pow(2).sum(-1) for v in sample.values()))
    factor = (setup.dp_clip / (norms + 1e-6)).clamp(max=1.0)
    out = {}
    for k, v in sample.items():
        clipped = (v * factor.view(*factor.shape, *[1] * (v.ndim - 2))).sum(1)
        noise = torch.randn(clipped.shape, generator=g).to(clipped.device)
        out[k] = (clipped + setup.dp_noise * setup.dp_clip * noise) / batch
    return out


@torch.no_grad()
def stacked_logits(model: nn.Module, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
                   batch: int = 1024) -> torch.Tensor:
    """[R, N, classes]: every record's logits under each of R stacked weight sets (a
    leading dim of 1 for a single model)."""
    names = [k for k, _ in model.named_parameters()]
    buffers = dict(model.named_buffers())
    device = weights[names[0]].device

    def logits(p: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
        return functional_call(model, (p, buffers), (xb,))

    stacked = vmap(logits, in_dims=(0, None))
    out = [stacked({k: weights[k] for k in names}, x[i:i + batch].to(device)).cpu()
           for i in range(0, len(x), batch)]
    return torch.cat(out, dim=1)
