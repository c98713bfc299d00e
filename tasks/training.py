"""Local training and evaluation loops shared by clients, the server and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'.")
    return torch.device(name)


def make_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> DataLoader:
    """A shuffling loader whose order depends only on ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=gen)


def sgd(model: nn.Module, lr: float, momentum: float = 0.0,
        weight_decay: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                           weight_decay=weight_decay)


@dataclass
class TrainResult:
    loss: float
    accuracy: float
    examples: int
    steps: int


def train_epochs(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
                 epochs: int, device: torch.device, proximal_mu: float = 0.0,
                 criterion: nn.Module | None = None) -> TrainResult:
    """Run ``epochs`` of mini-batch training; with ``proximal_mu`` > 0 add FedProx's term.

    FedProx (Li et al. 2020) minimises ``loss + mu/2 * ||w - w_global||^2`` locally,
    where ``w_global`` is the model as received at the start of the round. Empty batches
    (Poisson sampling in DP-SGD draws them) still take their optimizer step: for DP-SGD
    that step is the noise-only release the privacy analysis counts.
    """
    model.to(device).train()
    criterion = criterion if criterion is not None else nn.CrossEntropyLoss()
    anchor = ([p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None)
    total_loss, correct, seen, steps = 0.0, 0, 0, 0
    for _ in range(epochs):
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            logits = model(xb)
            loss = criterion(logits, yb)
            objective = loss
            if anchor is not None:
                params = zip(model.parameters(), anchor, strict=True)
                prox = sum(((p - a) ** 2).sum() for p, a in params)
                objective = loss + 0.5 * proximal_mu * prox
            objective.backward()
            optimizer.step()
            steps += 1
            if len(yb):
                total_loss += float(loss.item()) * len(yb)
                correct += (logits.argmax(1) == yb).sum().item()
                seen += len(yb)
    return TrainResult(total_loss / max(seen, 1), correct / max(seen, 1), seen, steps)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
             device: torch.device) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    model.to(device).eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    total_loss, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        xb = x[start:start + batch_size].to(device, non_blocking=True)
        yb = y[start:start + batch_size].to(device, non_blocking=True)
        logits = model(xb)
        total_loss += criterion(logits, yb).item()
        correct += (logits.argmax(1) == yb).sum().item()
    n = max(len(y), 1)
    return total_loss / n, correct / n
