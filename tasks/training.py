"""Local training and evaluation loops shared by clients, the server and the benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .errors import ConfigError

# Gives audit canaries their crafted gradients after backward (params, the batch's ids).
CanaryHook = Callable[[list[nn.Parameter], torch.Tensor], None]


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'.")
    return torch.device(name)


def convolutions_channels_last(model: nn.Module, device: torch.device) -> nn.Module:
    """On the CPU, ``model``'s 2-d convolution weights (and so its activations) in
    channels-last layout: oneDNN's channels-last kernels take a plain small-CNN step about
    15% faster, McMahan's CNN's 14%, a book-keeping DP-SGD epoch 17% (the NCHW kernels
    convert to it and back on every call). The same parameters, names and values'
    meaning; the sums run in another order, so the bits are not the NCHW kernels'. A
    client's sequential training uses it, plain or book-keeping DP-SGD (Opacus' own
    grad samplers misread channels-last: :func:`privacy.dp.dpsgd.make_private` gives
    them NCHW); torch.func has no channels-last, so clients trained together stay NCHW."""
    if device.type == "cpu" and any(isinstance(m, nn.Conv2d) for m in model.modules()):
        model.to(memory_format=torch.channels_last)
    return model


class _Rows(TensorDataset):
    """A TensorDataset that gives a batch's rows with one indexing per tensor: the
    DataLoader's row-by-row fetch and stack cost about 8% of a small CNN's step on 400
    examples, and ``index_select`` copies whole rows where advanced indexing computes an
    offset per element (8 us against 61 us for 64 MNIST images). The same values in the
    same order (the sampler is the DataLoader's own)."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.tensor(indices, dtype=torch.long)
        return [t.index_select(0, index) for t in self.tensors]


def _as_given(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    return batch


def make_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int,
                ids: torch.Tensor | None = None) -> DataLoader:
    """A shuffling loader whose order depends only on ``seed``; with ``ids`` (-1 for a
    real record, k >= 0 for audit canary k, -2 for a canary left out) each batch carries
    them as a third tensor."""
    gen = torch.Generator().manual_seed(seed)
    tensors = (x, y) if ids is None else (x, y, ids)
    return DataLoader(_Rows(*tensors), batch_size=batch_size, shuffle=True, generator=gen,
                      collate_fn=_as_given)


def sgd(model: nn.Module, lr: float, momentum: float = 0.0,
        weight_decay: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                           weight_decay=weight_decay)


class FunctionalSGD:
    """``torch.optim.SGD``'s update computed by its functional form (:func:`torch.optim.sgd.sgd`,
    called with the arguments ``SGD.step`` passes it: the same bits, tested), without
    ``torch.optim.Optimizer``, whose constructor imports ``torch._dynamo``: 1.3 s of CPU,
    a third of the in-process runtime's start, that a plain client never needed. One
    parameter group, dampening 0, not Nesterov: what ``client-optimizer = "sgd"`` builds."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: dict[int, torch.Tensor | None] = {}  # momentum, by parameter index

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim.sgd import sgd as sgd_update  # the module, not the Optimizer

        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = [self.params[i].grad for i in live]
        buffers = [self.buffers.get(i) for i in live] if self.momentum != 0 else []
        sgd_update([self.params[i] for i in live], grads, buffers,
                   has_sparse_grad=any(g.is_sparse for g in grads), foreach=None, fused=None,
                   weight_decay=self.weight_decay, momentum=self.momentum, lr=self.lr,
                   dampening=0.0, nesterov=False, maximize=False)
        if self.momentum != 0:  # the first step creates each buffer: keep it
            self.buffers.update(zip(live, buffers, strict=True))


# The client's local optimiser (FedOpt's client side, Reddi et al. 2021): built afresh each
# round, so its state (momentum, Adam's moments) never leaves the round. Under DP-SGD it
# steps on the noisy clipped gradient Opacus gives it: post-processing, accounted as SGD.
CLIENT_OPTIMIZERS = {
    "sgd": lambda params, t: torch.optim.SGD(params, lr=t.lr, momentum=t.momentum,
                                             weight_decay=t.weight_decay),
    "adam": lambda params, t: torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay),
    "adamw": lambda params, t: torch.optim.AdamW(params, lr=t.lr,
                                                 weight_decay=t.weight_decay),
}


def client_optimizer(model: nn.Module, t: Any, *, for_opacus: bool = False
                     ) -> torch.optim.Optimizer | FunctionalSGD:
    """The run's client optimiser (``client-optimizer``) over ``model``'s parameters, with
    the training section's lr, momentum (SGD) and weight decay; SGD as
    :class:`FunctionalSGD` unless Opacus is to wrap it (it needs a torch Optimizer)."""
    if t.client_optimizer == "sgd" and not for_opacus:
        return FunctionalSGD(model.parameters(), t.lr, t.momentum, t.weight_decay)
    return CLIENT_OPTIMIZERS[t.client_optimizer](model.parameters(), t)


@dataclass
class TrainResult:
    loss: float
    accuracy: float
    examples: int
    steps: int


def round_steps(epochs: int, per_epoch: int, max_steps: int) -> int:
    """The optimizer steps of one round: ``epochs`` of ``per_epoch`` batches, at most
    ``max_steps`` when that is > 0."""
    steps = epochs * per_epoch
    return min(steps, max_steps) if max_steps > 0 else steps


def train_epochs(model: nn.Module, loader: DataLoader,
                 optimizer: torch.optim.Optimizer | FunctionalSGD,
                 epochs: int, device: torch.device, proximal_mu: float = 0.0,
                 criterion: nn.Module | None = None,
                 canaries: CanaryHook | None = None, max_steps: int = 0) -> TrainResult:
    """Run ``epochs`` of mini-batch training, stopping after ``max_steps`` optimizer steps
    if that is > 0 (``local-steps``); with ``proximal_mu`` > 0 add FedProx's term.

    FedProx (Li et al. 2020) minimises ``loss + mu/2 * ||w - w_global||^2`` locally,
    where ``w_global`` is the model as received at the start of the round. Empty batches
    (Poisson sampling in DP-SGD draws them) still take their optimizer step: for DP-SGD
    that step is the noise-only release the privacy analysis counts. With ``canaries``
    the loader carries record ids: canary rows add no loss (they count in the batch's
    mean, as records) and get their crafted gradient from the hook after ``backward``.
    """
    model.to(device).train()
    criterion = criterion if criterion is not None else nn.CrossEntropyLoss()
    anchor = ([p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None)
    params = [p for p in model.parameters()]
    total_loss, correct, seen, steps = 0.0, 0, 0, 0
    for _ in range(epochs):
        for batch in loader:
            if max_steps and steps >= max_steps:
                break
            xb, yb = (t.to(device, non_blocking=True) for t in batch[:2])
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            if canaries is None:
                real, loss = yb, criterion(logits, yb)
                objective = loss
            else:
                mask = (batch[2] == -1).to(device)  # real records (canaries add no loss)
                per_row = nn.functional.cross_entropy(logits, yb, reduction="none")
                objective = (per_row * mask).sum() / max(len(yb), 1)
                real = yb[mask]
                loss = per_row[mask].mean() if len(real) else per_row.sum() * 0
                logits = logits[mask]
            if anchor is not None:
                prox = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))
                objective = objective + 0.5 * proximal_mu * prox
            objective.backward()
            if canaries is not None:
                canaries(params, batch[2])
            optimizer.step()
            steps += 1
            if len(real):
                total_loss += float(loss.item()) * len(real)
                correct += (logits.argmax(1) == real).sum().item()
                seen += len(real)
    return TrainResult(total_loss / max(seen, 1), correct / max(seen, 1), seen, steps)


@torch.no_grad()
def logits_of(model: nn.Module, x: torch.Tensor, batch_size: int,
              device: torch.device) -> torch.Tensor:
    """``model``'s logits on ``x``, batch by batch, as float32 on the CPU: the one evaluation
    loop (clients' own evaluation, the server's test and validation scores)."""
    model.to(device).eval()
    return torch.cat([model(x[i:i + batch_size].to(device, non_blocking=True)).float().cpu()
                      for i in range(0, len(x), batch_size)])


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
             device: torch.device) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y); (0, 0) on no data."""
    if len(y) == 0:
        return 0.0, 0.0
    logits = logits_of(model, x, batch_size, device)
    total = sum(float(nn.functional.cross_entropy(logits[i:i + batch_size], y[i:i + batch_size],
                                                  reduction="sum"))
                for i in range(0, len(y), batch_size))  # summed as the batches come
    return total / len(y), int((logits.argmax(1) == y).sum()) / len(y)
