"""A malicious server's trap weights: binning the first linear layer ("Robbing the Fed").

Fowl, Geiping, Czaja, Goldblum & Goldstein (ICLR 2022) show that a server choosing the
weights of a linear layer followed by a ReLU can make each record of a batch fall out of
the update verbatim, and through secure aggregation, since the attack reads only sums.
Weights-only version for fedpriv's MLP and CNNs (the client builds the architecture
itself):

- every unit i of the first layer measures the same statistic, w_i = v (here the mean
  input value, v = 1/d), with bias -c_i, where c_1 < ... < c_h are quantiles of
  <v, x> over the server's own data: unit i fires for exactly the records whose
  statistic exceeds c_i;
- the second layer gives every first-layer unit the same outgoing weights, so a
  record's loss gradient reaches every unit it fires with the same factor gamma(x);
- then the gradient of row i minus that of row i+1 sums gamma(x) x over the records in
  bin (c_i, c_(i+1)], and the bias gradients sum gamma(x): their ratio is the mean of
  the bin's records, *exactly one record* when the bin holds one.

Behind a CNN's convolutions (fedpriv's cnn and small-cnn) the first linear layer reads
the trunk's features, so the bins return *features*; the server sends conv weights
chosen to make them invertible (:func:`.feature_inversion.invertible_trunk`) and
inverts them (:func:`.feature_inversion.invert_features`).

A FedAvg update of one local SGD step is -lr times that gradient, and an aggregate a
weighted sum of such updates, so the ratio is unchanged by either (lr and each client's
weight cancel within a bin that holds one record).

**Gain.** Dividing the first layer by g and multiplying the next layer's columns by g
leaves every forward pass as it was but multiplies the first layer's gradient by g. The
server picks g so that a client's update is as large as the aggregation carries
(:func:`calibrate_gain`, on its own data): SecAgg+ rounds each coordinate to a grid of
step 2r/L after scaling it by the client's weight, and a record's signal far below that
step is lost in the sum; scaled up, it survives. More local steps move the trap a
little between steps; bins then mix records. Bins are at most the layer's width: with
h units and n records in all (the whole cohort under secure aggregation), a record is
alone in its bin with probability about (1 - 1/h)^(n - 1).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from .observation import LocalTraining
from .simulate import replay

DISGUISE = 1.5  # the disguise's norm per row, relative to the row's own
BLIND = 32  # inputs the disguise uses


@dataclass(frozen=True)
class Trap:
    """Which parameters the server tampered with."""

    first: str  # the first linear layer's name ("1" in the MLP, "classifier.0" in a CNN)
    second: str  # the next linear layer's
    raw: bool  # whether the first layer reads the (flattened) input itself


def linear_layers(model: nn.Module) -> list[str]:
    """The names of the model's linear layers, in order."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def trap_layers(model: nn.Module) -> Trap:
    """The two layers the trap uses: the first linear layer, which a ReLU must follow,
    and the next linear layer. Raises ValueError for a model without them."""
    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    at = next((i for i, (_, m) in enumerate(leaves) if isinstance(m, nn.Linear)), None)
    layers = linear_layers(model)
    if (at is None or len(layers) < 2 or at + 1 >= len(leaves)
            or not isinstance(leaves[at + 1][1], nn.ReLU)):
        raise ValueError("the binning trap needs a linear layer followed by a ReLU and "
                         "another linear layer (fedpriv's mlp, cnn, small-cnn)")
    raw = all(isinstance(m, nn.Flatten) for _, m in leaves[:at])
    return Trap(layers[0], layers[1], raw)


class _Reached(Exception):
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


def layer_input(model: nn.Module, weights: Mapping[str, torch.Tensor], layer: str,
                x: torch.Tensor) -> torch.Tensor:
    """What ``layer`` reads when the model with ``weights`` runs on ``x``, flattened
    (differentiable in ``x``; the rest of the forward pass is skipped)."""
    def stop(module: nn.Module, args: tuple) -> None:
        raise _Reached(args[0])

    handle = dict(model.named_modules())[layer].register_forward_pre_hook(stop)
    try:
        functional_call(model, dict(weights), (x,))
    except _Reached as reached:
        return reached.value.flatten(1)
    finally:
        handle.remove()
    raise ValueError(f"layer {layer!r} is not reached by the model's forward pass")


def trap_weights(model: nn.Module, honest: Mapping[str, torch.Tensor], aux_x: torch.Tensor,
                 gain: float = 1.0, disguise: int | None = None
                 ) -> tuple[dict[str, torch.Tensor], Trap]:
    """The weights the malicious server sends: ``honest`` with its first linear layer set to
    equal-mass bins of the mean input value over ``aux_x`` (the server's own data) and the
    next layer's columns made equal, the first layer divided by ``gain`` and the next
    multiplied by it (see the module docstring).

    ``disguise`` (a seed): hide the trap from a client that screens the weights for a
    rank-one first layer (:mod:`privacy.screening`). Each row gets a large random component on
    the inputs that are constant over the server's data (MNIST's border pixels), its
    bias compensating the constant: every unit fires for the same records as before, so
    the attack reads exactly as much, while the rows look unrelated."""
    trap = trap_layers(model)
    w1 = honest[f"{trap.first}.weight"]
    h, d = w1.shape
    with torch.no_grad():
        flat = layer_input(model, honest, trap.first, aux_x).double()
    stat = flat.mean(1)
    levels = torch.quantile(stat, torch.linspace(0, 1, h + 2, dtype=torch.float64)[1:-1])
    rows = torch.full((h, d), 1.0 / d, dtype=torch.float64)
    bias = -levels
    if disguise is not None:
        hidden = _blind_inputs(aux_x if trap.raw else flat)
        gen = torch.Generator().manual_seed(disguise)
        noise = torch.randn(h, len(hidden), generator=gen, dtype=torch.float64)
        noise *= DISGUISE / (d ** 0.5 * len(hidden) ** 0.5)  # relative to the row's norm
        rows[:, hidden] += noise
        bias = bias - noise @ flat[:, hidden].mean(0)
    out = {k: v.clone() for k, v in honest.items()}
    out[f"{trap.first}.weight"] = rows.to(w1.dtype)
    out[f"{trap.first}.bias"] = bias.to(w1.dtype)
    w2 = honest[f"{trap.second}.weight"]
    out[f"{trap.second}.weight"] = w2[:, :1].expand_as(w2).clone()  # equal outgoing weights
    return with_gain(out, trap, gain), trap


def with_gain(weights: Mapping[str, torch.Tensor], trap: Trap, gain: float
              ) -> dict[str, torch.Tensor]:
    """``weights`` with the trapped layer divided by ``gain`` and the next layer multiplied
    by it: the same forward pass, the trapped layer's gradient times ``gain``."""
    out = dict(weights)
    for p in ("weight", "bias"):
        out[f"{trap.first}.{p}"] = weights[f"{trap.first}.{p}"] / gain
    out[f"{trap.second}.weight"] = weights[f"{trap.second}.weight"] * gain
    return out


def _blind_inputs(aux_x: torch.Tensor) -> torch.Tensor:
    """The inputs the disguise hides in: the least varying over the server's data, and
    among those constant there, for images the farthest from the centre (a stray stroke
    of a client's record in a corner would move its bin)."""
    flat = aux_x.reshape(len(aux_x), -1).double()
    spread = flat.std(0)
    order = torch.argsort(spread)
    constant = order[spread[order] == 0]
    if len(constant) < BLIND or aux_x.dim() < 3:
        return order[:BLIND]
    h, w = aux_x.shape[-2:]
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    far = ((rows - (h - 1) / 2) ** 2 + (cols - (w - 1) / 2) ** 2).double().flatten()
    far = far.repeat(flat.shape[1] // (h * w))  # the same for every channel
    return constant[torch.argsort(far[constant], descending=True)[:BLIND]]


def cnn_trunk(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """A copy of the model's convolutional trunk (``model.features``) holding
    ``weights``: what :func:`.feature_inversion.invert_features` inverts."""
    trunk = getattr(model, "features", None)
    if not isinstance(trunk, nn.Sequential):
        raise ValueError("the trap's first linear layer reads features, and the model has "
                         "no nn.Sequential trunk (model.features) to invert them through")
    local = copy.deepcopy(trunk)
    local.load_state_dict({k.removeprefix("features."): v for k, v in weights.items()
                           if k.startswith("features.")})
    return local


def calibrate_gain(model: nn.Module, sent: Mapping[str, torch.Tensor], trap: Trap,
                   x: torch.Tensor, y: torch.Tensor, t: LocalTraining, limit: float) -> float:
    """The gain that brings the largest coordinate of one client's update of the trapped
    layer to ``limit``: the server replays a client's round on its own records ``(x, y)``
    from the weights ``sent`` (built with gain 1). With one local step the update grows
    linearly with the gain, the forward pass being unchanged."""
    update = replay(model, sent, x, y, t, create_graph=False)
    largest = max(float(update[f"{trap.first}.{p}"].detach().abs().max())
                  for p in ("weight", "bias"))
    return limit / largest if largest > 0 else 1.0


def _bins(update: Mapping[str, torch.Tensor], trap: Trap, min_weight: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per bin that held records: the weight rows' and the biases' difference of
    neighbouring units (unit i fires for the records above c_i)."""
    w = update[f"{trap.first}.weight"].double()
    b = update[f"{trap.first}.bias"].double()
    dw = torch.cat([w[:-1] - w[1:], w[-1:]])
    db = torch.cat([b[:-1] - b[1:], b[-1:]])
    held = db.abs() > min_weight * max(float(b.abs().max()), 1e-30)
    return dw[held], db[held]


def recover(update: Mapping[str, torch.Tensor], trap: Trap, min_weight: float = 1e-4
            ) -> torch.Tensor:
    """The records that fell alone (or together, averaged) into a bin, from an update
    (or an aggregate of updates) of the trapped layer: [bins that held records, d]. A bin
    whose bias difference is below ``min_weight`` times the largest is taken as empty
    (under SecAgg+ an empty bin holds quantization noise, not a record)."""
    dw, db = _bins(update, trap, min_weight)
    return (dw / db.unsqueeze(1)).float()


def trap_labels(model: nn.Module, sent: Mapping[str, torch.Tensor], trap: Trap,
                update: Mapping[str, torch.Tensor], x: torch.Tensor, num_classes: int,
                min_weight: float = 1e-4, tolerance: float = 0.02) -> torch.Tensor:
    """The label of each recovered record ``x`` (rows of :func:`recover`, in order).

    A bin's bias difference is k * gamma_c(x): gamma_c the loss gradient at the trap's
    units for the record with label c under the weights sent (the same for every unit it
    fires, the outgoing weights being equal), k = -lr * (the client's weight) / batch,
    common to every record when clients weigh the same. The server computes gamma_c for
    every class, finds the k most records agree on, and gives each record the class
    whose ratio is nearest to it."""
    _, db = _bins(update, trap, min_weight)
    layer = dict(model.named_modules())[trap.first]
    got: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        got["z"] = out.detach().requires_grad_()  # differentiate from here on
        return got["z"]

    handle = layer.register_forward_hook(keep)
    gammas = []
    try:
        for c in range(num_classes):
            with torch.enable_grad():
                logits = functional_call(model, dict(sent), (x.detach(),))
                loss = nn.functional.cross_entropy(
                    logits, torch.full((len(x),), c, dtype=torch.long, device=x.device),
                    reduction="sum")
                (grad,) = torch.autograd.grad(loss, got["z"])
            fired = (got["z"] > 0).double()
            gammas.append((grad.double() * fired).sum(1) / fired.sum(1).clamp(min=1))
    finally:
        handle.remove()
    ratio = db.unsqueeze(1) / torch.stack(gammas, 1)  # [records, classes]
    logs = torch.where(ratio < 0, (-ratio).clamp(min=1e-300).log(),
                       torch.full_like(ratio, float("inf")))
    candidates = logs[torch.isfinite(logs)]
    if not len(candidates):
        return torch.zeros(len(x), dtype=torch.long)
    near = (logs.unsqueeze(0) - candidates.view(-1, 1, 1)).abs() < tolerance
    k = candidates[near.any(2).sum(1).argmax()]
    return (logs - k).abs().argmin(1)


