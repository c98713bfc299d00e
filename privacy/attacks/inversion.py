"""Reconstructing a client's training data from its update.

- **Inverting Gradients** (Geiping, Bauermeister, Dröge & Moeller 2020): optimise candidate
  inputs so that replaying the client's local training on them (:mod:`.simulate`)
  produces an update pointing the same way as the observed one — cosine distance, plus
  total variation as an image prior — with Adam on the *sign* of the gradient, the
  inputs kept inside the data's box, the step size decayed at 3/8, 5/8 and 7/8 of the
  iterations, several random restarts, and the restart with the lowest loss kept.
- **DLG** (Zhu, Liu & Han 2019), the classic baseline: the squared L2 distance between
  the replayed and observed updates, minimised with L-BFGS; labels are optimised as soft
  labels unless given.

Both take only what the server holds: the model, the weights it sent, the observed
update, the round's training configuration and the number of examples; the labels are
recovered from the update (:mod:`.labels`) or given, and the result says which.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .observation import LocalTraining
from .simulate import flatten, replay, total_variation

Progress = Callable[[str], None]


@dataclass(frozen=True)
class InversionConfig:
    iterations: int = 1000
    restarts: int = 1
    lr: float = 0.1
    tv: float = 1e-4
    seed: int = 0


@dataclass
class Reconstruction:
    x: torch.Tensor  # in the model's input space (normalized), (n, *input_shape)
    y: torch.Tensor  # the labels used (recovered or given)
    loss: float  # the attack's own objective at the end (lower: a better match)
    seconds: float
    method: str
    labels: str  # "recovered" or "given"


def _bounds(mean: tuple[float, ...], std: tuple[float, ...], ndim: int
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The box of valid inputs: pixels in [0, 1], normalized per channel."""
    if ndim < 3:
        return None
    m = torch.tensor(mean).view(-1, 1, 1)
    s = torch.tensor(std).view(-1, 1, 1)
    return (0 - m) / s, (1 - m) / s


def invert(model: nn.Module, sent: Mapping[str, torch.Tensor],
           update: Mapping[str, torch.Tensor], labels: torch.Tensor, t: LocalTraining,
           input_shape: tuple[int, ...], cfg: InversionConfig, *,
           mean: tuple[float, ...] = (0.0,), std: tuple[float, ...] = (1.0,),
           labels_source: str = "recovered", progress: Progress | None = None
           ) -> Reconstruction:
    """Inverting Gradients on a (possibly multi-step) FedAvg update; best of the restarts."""
    start = time.perf_counter()
    keys = [k for k, _ in model.named_parameters()]
    target = flatten(update, keys).detach()
    device = target.device
    labels = labels.to(device)
    box = _bounds(mean, std, len(input_shape))
    if box is not None:
        box = (box[0].to(device), box[1].to(device))
    gen = torch.Generator().manual_seed(cfg.seed)  # on the CPU: the same start on any device
    best: tuple[float, torch.Tensor] | None = None
    for trial in range(cfg.restarts):
        x = torch.randn(len(labels), *input_shape, generator=gen).to(device).requires_grad_()
        opt = torch.optim.Adam([x], lr=cfg.lr)
        milestones = [int(cfg.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.1)
        for it in range(cfg.iterations):
            opt.zero_grad()
            guess = flatten(replay(model, sent, x, labels, t), keys)
            loss = 1 - nn.functional.cosine_similarity(guess, target, dim=0) + \
                cfg.tv * total_variation(x)
            loss.backward()
            x.grad.sign_()
            opt.step()
            sched.step()
            if box is not None:
                with torch.no_grad():
                    x.copy_(torch.max(torch.min(x, box[1]), box[0]))
            if progress and (it + 1) % max(1, cfg.iterations // 5) == 0:
                progress(f"inverting: restart {trial + 1}/{cfg.restarts}, iteration "
                         f"{it + 1}/{cfg.iterations}, loss {loss.item():.4f}")
        replayed = replay(model, sent, x.detach(), labels, t, create_graph=False)
        final = 1 - nn.functional.cosine_similarity(flatten(replayed, keys).detach(), target,
                                                    dim=0).item()
        if best is None or final < best[0]:
            best = (final, x.detach().clone())
    assert best is not None
    return Reconstruction(best[1].cpu(), labels.cpu(), best[0], time.perf_counter() - start,
                          "inverting-gradients", labels_source)


def dlg(model: nn.Module, sent: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor],
        n: int, num_classes: int, t: LocalTraining, input_shape: tuple[int, ...],
        iterations: int = 300, labels: torch.Tensor | None = None, seed: int = 0,
        restarts: int = 1, progress: Progress | None = None) -> Reconstruction:
    """Deep Leakage from Gradients: L2 update matching with L-BFGS (soft labels if none);
    the best of ``restarts`` random starts."""
    start = time.perf_counter()
    keys = [k for k, _ in model.named_parameters()]
    target = flatten(update, keys).detach()
    scale = target.norm().clamp_min(1e-12)
    device = target.device
    labels = None if labels is None else labels.to(device)
    gen = torch.Generator().manual_seed(seed)

    def distance(x: torch.Tensor, logits: torch.Tensor, graph: bool = True) -> torch.Tensor:
        y = labels if labels is not None else torch.softmax(logits, dim=1)
        guess = flatten(replay(model, sent, x, y, t, create_graph=graph), keys)
        return ((guess - target) / scale).pow(2).sum()

    def one_start(trial: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        # As in the original: step size 1 and no line search; the default tolerances would
        # stop it within a few dozen steps, so they are off.
        opt = torch.optim.LBFGS([x] + ([logits] if labels is None else []), lr=1.0,
                                max_iter=20, history_size=100, tolerance_grad=0.0,
                                tolerance_change=0.0)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = distance(x, logits)
            loss.backward()
            return loss

        rounds = max(1, iterations // 20)
        for r in range(rounds):
            opt.step(closure)
            if not torch.isfinite(x).all():  # without a line search it can diverge
                return
            if progress and (r + 1) % max(1, rounds // 5) == 0:
                progress(f"DLG: restart {trial + 1}/{restarts}, {20 * (r + 1)}/{iterations} "
                         "L-BFGS iterations")

    best: tuple[float, torch.Tensor, torch.Tensor] | None = None
    for trial in range(restarts):
        x = torch.randn(n, *input_shape, generator=gen).to(device).requires_grad_()
        logits = torch.randn(n, num_classes, generator=gen).to(device).requires_grad_(
            labels is None)
        one_start(trial, x, logits)
        if not torch.isfinite(x).all():
            continue
        final = distance(x.detach(), logits.detach(), graph=False).item()
        if best is None or final < best[0]:
            best = (final, x.detach().clone(), logits.detach().clone())
    if best is None:  # every restart diverged: report the starting point honestly
        best = (float("inf"), torch.zeros(n, *input_shape), torch.zeros(n, num_classes))
    y = labels if labels is not None else best[2].argmax(1)
    return Reconstruction(best[1].cpu(), y.cpu(), best[0], time.perf_counter() - start, "dlg",
                          "given" if labels is not None else "optimised")
