"""Which labels a client trained on, read from its update's last layer.

- **iDLG** (Zhao, Mopuri & Bilen 2020): with one example and one step, the gradient of
  the cross-entropy with respect to the output bias is softmax - onehot(y), negative
  only at the true class; the update is minus the learning rate times it, so the true
  label is where the bias moved up.
- **Counts for larger batches** (the bias-gradient estimate of Wainakh et al. 2022,
  "User-level label leakage from gradients in federated learning"): averaged over the
  client's steps, the bias gradient is about p_mean - counts / n, where p_mean is the
  model's mean prediction; the attacker estimates p_mean from the model it sent on
  random inputs, and counts = n (p_mean - g_mean), rounded to sum to n.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from .observation import LocalTraining
from .simulate import effective_steps


def output_bias(model: nn.Module) -> str:
    """The name of the last layer's bias: the parameter the labels leak through."""
    names = [k for k, p in model.named_parameters() if k.endswith("bias") and p.ndim == 1]
    return names[-1]


def idlg_label(update: Mapping[str, torch.Tensor], model: nn.Module) -> int:
    """The label of a one-example, one-step update (iDLG)."""
    return int(torch.argmax(update[output_bias(model)].cpu()))


def label_counts(update: Mapping[str, torch.Tensor], model: nn.Module,
                 sent: Mapping[str, torch.Tensor], n: int, t: LocalTraining,
                 input_shape: tuple[int, ...], probes: int = 256, seed: int = 0) -> np.ndarray:
    """Estimated number of examples of each class behind an update of ``n`` examples."""
    gen = torch.Generator().manual_seed(seed)
    model.load_state_dict({k: v for k, v in sent.items()}, strict=False)
    device = next(model.parameters()).device
    with torch.no_grad():
        probe = torch.randn(probes, *input_shape, generator=gen).to(device)
        p_mean = torch.softmax(model.eval()(probe), dim=1).mean(0).cpu()
    g_mean = -update[output_bias(model)].cpu() / (t.lr * effective_steps(n, t))
    raw = np.clip((n * (p_mean - g_mean)).double().numpy(), 0, None)
    if raw.sum() == 0:
        raw = np.ones_like(raw)
    raw = raw * n / raw.sum()
    counts = np.floor(raw).astype(int)
    for c in np.argsort(-(raw - counts))[: n - counts.sum()]:  # largest remainders
        counts[c] += 1
    return counts


def labels_from_counts(counts: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.repeat(np.arange(len(counts)), counts)).long()
