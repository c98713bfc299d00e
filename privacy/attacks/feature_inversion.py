"""Recovering images from the exact feature vectors a trunk computes from them.

A malicious server that plants Fowl et al.'s binning trap ("Robbing the Fed", ICLR 2022;
:mod:`.imprint`) in the first linear layer after a CNN's convolutional trunk reads back
``trunk(x)`` for single records, not ``x``. This module takes the second step:

- :func:`invert_features` finds images in the data's box whose features match: the
  squared feature error (relative to the features' distance from a mid-grey image's) plus
  a small total-variation prior (Mahendran & Vedaldi, "Understanding deep image
  representations by inverting them", CVPR 2015) and a pull toward the box's lower bound
  (MNIST's black background), minimised by Adam with projection onto the box. The
  trunk's ReLUs and max-pools are smoothed at first (softplus and log-sum-exp pooling at a
  temperature annealed to zero, a continuation in the spirit of graduated
  non-convexity, Blake & Zisserman 1987): on fedpriv's small CNN this lowered the feature
  error tenfold (3e-2 to 3e-3 on 16 MNIST digits) where plain Adam stalls at dead units
  and the wrong max-pool winners. Both priors fade to zero over the run, so what is left
  is matching the features exactly.
- :func:`invertible_trunk`: the conv weights a server could send instead of the honest
  ones. The small CNN's trunk ends in 512 features for 784 pixels; inverting it works
  like compressed sensing (the box and the dark background make the image sparse), and
  it works better with orthogonal kernels and biases raised so that few ReLUs are dead
  (a dead unit only says "at most zero").

Measured on 32 MNIST training digits (mean PSNR, share above 30 dB; 3,000 iterations;
initial weights of 3 seeds): the McMahan CNN's honest trunk (3,136 features) 76 dB, all;
the small CNN's honest trunk 17 dB, 5%; its invertible trunk (the server's own digits as
``probe``) 33 dB, 50% (28 dB, 30% with the default noise probe). Training can hurt: after
3 epochs on 1,000 digits (one seed) 95% of the McMahan trunk's features are 0, and it gives
13 dB, none (the invertible trunk made from it: 60 dB, all, in 400 iterations); the small
CNN's 24 dB, 12% (invertible: 31 dB, 41%).

Records are independent: all are optimised as one batch, each with its own loss.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .inversion import _bounds

# The smoothing temperature falls from ``smooth`` to this share of it, then jumps to 0
ANNEAL_FLOOR = 0.01


class _Smooth(nn.Module):
    """A trunk's ReLU or max-pool, smoothed at temperature ``t * scale`` (softplus,
    log-sum-exp pooling); ``t`` is set before each step, and 0 gives the exact layer."""

    def __init__(self, layer: nn.ReLU | nn.MaxPool2d, scale: float) -> None:
        super().__init__()
        self.layer, self.scale, self.t = layer, scale, 0.0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tau = self.t * self.scale
        if tau <= 0:
            return self.layer(h)
        if isinstance(self.layer, nn.ReLU):
            return tau * F.softplus(h / tau)
        p = self.layer
        n, c, height, width = h.shape
        (kh, kw), (sh, sw), (ph, pw) = (_pair(p.kernel_size), _pair(p.stride),
                                        _pair(p.padding))
        oh, ow = (height + 2 * ph - kh) // sh + 1, (width + 2 * pw - kw) // sw + 1
        cols = F.unfold(h / tau, (kh, kw), stride=(sh, sw), padding=(ph, pw))
        return (tau * torch.logsumexp(cols.view(n, c, kh * kw, oh * ow), 2)).view(n, c, oh, ow)


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (v[0], v[1])


def _smoothed(trunk: nn.Module, probe: torch.Tensor) -> tuple[nn.Module, list[_Smooth]]:
    """The trunk with its ReLUs and max-pools behind :class:`_Smooth` (a sequential trunk
    only; any other is used as it is). A ReLU's temperature scales with the RMS of its
    input on ``probe``, a pool's with its input's spread within a channel (log-sum-exp
    ignores a channel's offset)."""
    if not isinstance(trunk, nn.Sequential):
        return trunk, []
    layers: list[nn.Module] = []
    smooth: list[_Smooth] = []
    h = probe
    with torch.no_grad():
        for layer in trunk:
            poolable = (isinstance(layer, nn.MaxPool2d) and not layer.ceil_mode
                        and layer.dilation == 1)
            if isinstance(layer, nn.ReLU) or poolable:
                dims = [d for d in range(h.ndim) if d != 1]
                scale = (h.pow(2).mean().sqrt() if isinstance(layer, nn.ReLU)
                         else h.std(dim=dims).mean())
                s = _Smooth(layer, float(scale.clamp_min(1e-6)))
                smooth.append(s)
                layers.append(s)
            else:
                layers.append(layer)
            h = layer(h)
    return nn.Sequential(*layers), smooth


def _total_variation(z: torch.Tensor) -> torch.Tensor:
    """Each image's anisotropic total variation (mean absolute neighbour difference)."""
    return ((z[..., 1:] - z[..., :-1]).abs().flatten(1).mean(1)
            + (z[..., 1:, :] - z[..., :-1, :]).abs().flatten(1).mean(1))


def _descend(trunk: nn.Module, smoothed: tuple[nn.Module, list[_Smooth]], z: torch.Tensor,
             target: torch.Tensor, norm: torch.Tensor, box: tuple[torch.Tensor, torch.Tensor],
             iterations: int, lr: float, tv: float, dark: float, smooth: float,
             anneal: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One run of projected Adam from ``z`` (cosine step-size decay, the smoothing annealed
    geometrically over the first ``anneal`` of the run, the priors fading linearly);
    returns the images and each one's relative feature error through the exact trunk."""
    surrogate, layers = smoothed
    lo, hi = box
    z = z.clone().requires_grad_()
    opt = torch.optim.Adam([z], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, iterations)
    try:
        for it in range(iterations):
            frac = it / iterations
            t = smooth * ANNEAL_FLOOR ** (frac / anneal) if frac < anneal else 0.0
            for s in layers:
                s.t = t
            opt.zero_grad()
            loss = ((surrogate(z).flatten(1) - target).pow(2).sum(1) / norm).sum()
            fade = 1 - frac
            if tv:
                loss = loss + fade * tv * _total_variation(z).sum()
            if dark:
                loss = loss + fade * dark * ((z - lo) / (hi - lo)).flatten(1).mean(1).sum()
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                z.copy_(torch.max(torch.min(z, hi), lo))
    finally:
        for s in layers:
            s.t = 0.0
    with torch.no_grad():
        rel = (trunk(z).flatten(1) - target).pow(2).sum(1) / norm
    return z.detach(), rel


def invert_features(trunk: nn.Module, features: torch.Tensor,
                    input_shape: tuple[int, int, int], *, mean: tuple[float, ...],
                    std: tuple[float, ...], iterations: int = 3000, seed: int = 0,
                    lr: float = 0.1, tv: float = 0.03, dark: float = 0.03,
                    smooth: float = 1.0, anneal: float = 0.7, restarts: int = 1,
                    tol: float = 1e-5) -> torch.Tensor:
    """Images (normalized, ``(n, *input_shape)``, in the pixel box) whose ``trunk``
    features match ``features`` (n rows), one batched optimisation (module docstring).

    ``tv`` and ``dark`` weigh the total-variation prior and the pull toward the box's
    lower bound (0 for data without a dark background); ``smooth`` is the starting
    temperature as a share of each layer's scale. The first run starts from a dark image;
    each of the ``restarts - 1`` further runs restarts, from uniform noise in the box, the
    records whose relative feature error is still above ``tol``, and each record keeps
    its best run (on the small CNN most wrong basins are the record's, not the start's:
    four runs added 0.4-1.2 dB on 16 digits)."""
    box = _bounds(mean, std, 3)
    assert box is not None
    lo, hi = box
    n = features.shape[0]
    gen = torch.Generator().manual_seed(seed)
    target = features.detach().flatten(1).float()
    needs_grad = [p.requires_grad for p in trunk.parameters()]
    for p in trunk.parameters():
        p.requires_grad_(False)
    try:
        with torch.no_grad():
            ref = trunk(((lo + hi) / 2).expand(1, *input_shape)).flatten(1)
        norm = (target - ref).pow(2).sum(1).clamp_min(1e-12)
        # the smoothing's scales from a fixed probe: a record's result is the same in any batch
        smoothed = _smoothed(trunk, lo + (hi - lo) * torch.rand(64, *input_shape, generator=gen))
        best = lo + 0.01 * (hi - lo) * torch.randn(n, *input_shape, generator=gen).abs()
        best_rel = torch.full((n,), float("inf"))
        for run in range(max(1, restarts)):
            todo = (best_rel > tol).nonzero().flatten()
            if len(todo) == 0:
                break
            start = best[todo] if run == 0 else \
                lo + (hi - lo) * torch.rand(len(todo), *input_shape, generator=gen)
            z, rel = _descend(trunk, smoothed, start, target[todo], norm[todo], (lo, hi),
                              iterations, lr, tv, dark, smooth, anneal)
            better = rel < best_rel[todo]
            best[todo[better]] = z[better]
            best_rel[todo[better]] = rel[better]
    finally:
        for p, g in zip(trunk.parameters(), needs_grad, strict=True):
            p.requires_grad_(g)
    return best


def invertible_trunk(model: nn.Module, honest: Mapping[str, torch.Tensor], *,
                     probe: torch.Tensor | None = None, shift: tuple[float, ...] = (0.5, 2.0),
                     seed: int = 0) -> dict[str, torch.Tensor]:
    """``honest`` with the trunk's (``model.features``) conv kernels made orthogonal
    (Saxe, McClelland & Ganguli 2014's initialisation, each channel keeping its honest
    norm) and each conv bias raised by ``shift[i]`` times that layer's pre-activation
    spread on ``probe``, so that few ReLUs are dead. ``probe``: the server's own
    normalized inputs (default: standard Gaussian noise, the normalized data's scale, which
    does worse; module docstring). Only weights change: the clients build the
    architecture. The shifts were picked on the small CNN from (0.5, 1, 2, 3, 4) std."""
    trunk = getattr(model, "features", None)
    if not isinstance(trunk, nn.Sequential):
        raise ValueError("invertible_trunk needs a model whose trunk is the nn.Sequential "
                         "model.features (fedpriv's cnn and small-cnn)")
    out = {k: v.detach().clone() for k, v in honest.items()}
    local = copy.deepcopy(trunk)
    local.load_state_dict({k.removeprefix("features."): v for k, v in out.items()
                           if k.startswith("features.")})
    convs = [m for m in local if isinstance(m, nn.Conv2d)]
    if not convs:
        raise ValueError("the trunk has no conv layer")
    if probe is None:
        probe = torch.randn(256, convs[0].in_channels, 32, 32,
                            generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    h = probe
    i = 0
    with torch.no_grad():
        for name, layer in local.named_children():
            if isinstance(layer, nn.Conv2d):
                w = layer.weight
                norms = w.flatten(1).norm(dim=1).view(-1, *[1] * (w.ndim - 1))
                nn.init.orthogonal_(w, generator=gen)
                w.mul_(norms / w.flatten(1).norm(dim=1).view_as(norms))
                out[f"features.{name}.weight"] = w.detach().clone()
                if layer.bias is not None:
                    pre = layer(h)
                    layer.bias.add_(shift[min(i, len(shift) - 1)] * pre.std(dim=(0, 2, 3)))
                    out[f"features.{name}.bias"] = layer.bias.detach().clone()
                i += 1
            h = layer(h)
    return out
