"""A round's clients trained together: K models of one architecture as one batched program.

The K clients' parameters are stacked on a leading client dimension and one
``torch.func`` program (``vmap`` over clients of ``grad`` of a ``functional_call``)
computes every client's mini-batch gradient at once; PyTorch's SGD (momentum, weight
decay: ``torch.optim.SGD`` with dampening 0, not Nesterov) is then applied per client
on the stacked tensors. Each client keeps its own batch schedule: the batches are
those of :func:`tasks.training.make_loader` with the client's seed, so the result is
the sequential reference's (:func:`tasks.training.train_epochs`, one client after the
other) to float rounding.

Uneven partitions are padded and masked: at step t every client takes its t-th batch
(epochs concatenated), padded to the batch size with masked rows that add neither
loss nor gradient (the mean is over the real rows, as the client's own loader has
them); a client whose batches are used up stands still (its parameters and momentum
are kept by a mask) while the others finish.

With :class:`CohortDP`, each client runs DP-SGD (Abadi et al. 2016) as
:func:`privacy.dp.dpsgd.make_private` sets it up: the same Poisson batches (Opacus'
``DPDataLoader`` with the client's seed), each example's gradient (``vmap`` of
``grad`` over the batch, inside the ``vmap`` over clients) clipped to C with Opacus'
factor ``min(1, C / (|g_i| + 1e-6))``, summed, ``N(0, (sigma C)^2)`` noise added and
divided by the expected batch size q n. The noise comes from ``generator`` (torch's
global one by default), so its draws, not its law, differ from the sequential run's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from .training import TrainResult, make_loader


class CohortError(ValueError):
    """The cohort cannot be trained as one batched program (what is wrong, what to do)."""


@dataclass(frozen=True)
class CohortTraining:
    """The local training every client of the cohort runs (as ``tasks.config``'s training)."""

    lr: float
    batch_size: int
    local_epochs: int = 1
    momentum: float = 0.0
    weight_decay: float = 0.0

    @classmethod
    def of(cls, training: object) -> CohortTraining:
        """From a run's training section (``RunConfig.training``)."""
        return cls(lr=float(training.lr), batch_size=int(training.batch_size),
                   local_epochs=int(training.local_epochs),
                   momentum=float(training.momentum),
                   weight_decay=float(training.weight_decay))


_REFUSED = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)


@dataclass(frozen=True)
class CohortDP:
    """DP-SGD's per-client parameters: noise multiplier sigma and clipping norm C."""

    noise_multiplier: float
    max_grad_norm: float


def check_cohort(model: nn.Module, states: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Raise :class:`CohortError` unless every state fits ``model`` exactly and the model
    has no layer whose training is not a function of its weights and batch."""
    bad = sorted({type(m).__name__ for m in model.modules() if isinstance(m, _REFUSED)
                  and not (isinstance(m, nn.modules.dropout._DropoutNd) and m.p == 0)})
    if bad:
        raise CohortError(
            f"the model has {', '.join(bad)} layers: BatchNorm keeps running statistics "
            "updated outside the gradient and dropout draws random masks in an order a "
            "batched program cannot reproduce. Use a model without them (GroupNorm for "
            "BatchNorm: opacus.validators.ModuleValidator.fix) or train these clients one "
            "after the other with tasks.training.train_epochs.")
    if not states:
        raise CohortError("the cohort is empty: pass at least one client's state")
    want = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    for i, state in enumerate(states):
        have = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))[:3]
            raise CohortError(
                f"client {i}'s state does not fit the model's architecture (first "
                f"differences: {diff}): a cohort shares one architecture. Train clients "
                "of other architectures in a cohort of their own or sequentially.")


def _schedules(data: Sequence[tuple[torch.Tensor, torch.Tensor]], seeds: Sequence[int],
               training: CohortTraining, dp: CohortDP | None
               ) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Each client's batches (row indices), epoch after epoch, exactly as its own
    :func:`make_loader` (or, for DP-SGD, Opacus' Poisson ``DPDataLoader`` built from it
    as :func:`privacy.dp.dpsgd.make_private` does) would draw them with its seed; and
    the divisor of each client's summed gradient (DP-SGD's expected batch size q n)."""
    out, divisors = [], []
    for (_, y), seed in zip(data, seeds, strict=True):
        rows = torch.arange(len(y))  # the loader itself: each pass also draws a base seed
        loader = make_loader(rows, rows, training.batch_size, seed)
        divisor = 0
        if dp is not None:
            from opacus.data_loader import DPDataLoader

            loader.generator.manual_seed(seed)
            loader = DPDataLoader.from_data_loader(loader, generator=loader.generator)
            divisor = int(len(y) * (1 / len(loader)))
        out.append([b.long() for _ in range(training.local_epochs) for b, _ in loader])
        divisors.append(divisor)
    return out, divisors


def train_cohort(model: nn.Module, states: Sequence[Mapping[str, torch.Tensor]],
                 data: Sequence[tuple[torch.Tensor, torch.Tensor]], seeds: Sequence[int],
                 training: CohortTraining, device: torch.device | None = None,
                 dp: CohortDP | None = None, generator: torch.Generator | None = None
                 ) -> list[tuple[dict[str, torch.Tensor], TrainResult]]:
    """Train client k from ``states[k]`` on ``data[k]`` (its batches drawn with
    ``seeds[k]``) as :func:`tasks.training.train_epochs` would, all K at once.

    ``model`` gives the architecture (its own weights are not used). With ``dp``, DP-SGD
    (see the module's notes; ``generator`` draws the noise). Returns, per client, its
    new state dict (on the CPU) and its :class:`TrainResult` (``steps`` is what a
    DP-SGD client accounts: one per Poisson batch, empty ones included).
    """
    check_cohort(model, states)
    if len(data) != len(states) or len(seeds) != len(states):
        raise CohortError(f"{len(states)} states, {len(data)} datasets and {len(seeds)} "
                          "seeds: pass one of each per client")
    device = device or torch.device("cpu")
    model = model.to(device).train()
    names = [k for k, _ in model.named_parameters()]
    schedules, divisors = _schedules(data, seeds, training, dp)
    k_clients = len(states)
    steps = max(len(s) for s in schedules)
    params = {n: torch.stack([s[n] for s in states]).to(device) for n in names}
    buffers = {n: torch.stack([s[n] for s in states]).to(device)
               for n in states[0] if n not in params}

    def loss(p: dict[str, torch.Tensor], buf: dict[str, torch.Tensor], xb: torch.Tensor,
             yb: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = functional_call(model, (p, buf), (xb,))
        rows = nn.functional.cross_entropy(logits, yb, reduction="none") * mask
        return rows.sum() / mask.sum().clamp(min=1), (rows.sum().detach(), logits.detach())

    if dp is None:
        step_fn = vmap(grad(loss, has_aux=True))
    else:
        step_fn = vmap(_private_gradient(model, loss, dp))
    scale = torch.tensor([max(d, 1) for d in divisors], dtype=torch.float32, device=device)
    xs = [x for x, _ in data]
    ys = [y for _, y in data]
    momentum: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros(k_clients, dtype=torch.float64)
    correct = torch.zeros(k_clients, dtype=torch.long)
    seen = torch.zeros(k_clients, dtype=torch.long)
    taken = torch.tensor([len(s) for s in schedules])
    for t in range(steps):
        b = max(1, max(len(s[t]) for s in schedules if t < len(s)))  # Poisson: may exceed B
        rows = torch.zeros(k_clients, b, dtype=torch.long)
        mask = torch.zeros(k_clients, b)
        for k, sched in enumerate(schedules):
            if t < len(sched):
                idx = sched[t]
                rows[k, :len(idx)] = idx
                mask[k, :len(idx)] = 1.0
        xb = torch.stack([xs[k][rows[k]] for k in range(k_clients)]).to(device)
        yb = torch.stack([ys[k][rows[k]] for k in range(k_clients)]).to(device)
        grads, (sums, logits) = step_fn(params, buffers, xb, yb, mask.to(device))
        active = (t < taken).to(device)
        if dp is not None:  # clipped sums + N(0, (sigma C)^2), over q n
            std = dp.noise_multiplier * dp.max_grad_norm
            grads = {n: (g + std * torch.randn(g.shape, generator=generator).to(device))
                     / _bcast(scale, g) for n, g in grads.items()}
        for n in names:
            g = grads[n]
            if training.weight_decay:
                g = g + training.weight_decay * params[n]
            if training.momentum:
                g = g if n not in momentum else torch.where(
                    _bcast(active, g), training.momentum * momentum[n] + g, momentum[n])
                momentum[n] = g
            params[n] = torch.where(_bcast(active, g), params[n] - training.lr * g, params[n])
        m = mask.bool()
        loss_sum += sums.detach().cpu().double()
        correct += ((logits.argmax(-1).cpu() == yb.cpu()) & m).sum(1)
        seen += m.sum(1)
    out = []
    for k in range(k_clients):
        state = {n: (params[n][k] if n in params else buffers[n][k]).detach().cpu()
                 for n in states[k]}
        n_seen = max(int(seen[k]), 1)
        out.append((state, TrainResult(float(loss_sum[k]) / n_seen,
                                       int(correct[k]) / n_seen, int(seen[k]), int(taken[k]))))
    return out


def _private_gradient(model: nn.Module, loss: object, dp: CohortDP) -> object:
    """One client's step of DP-SGD before the noise: each example's gradient (``vmap``
    of ``grad``), clipped with Opacus' factor, summed over the real rows."""
    def one(p: dict[str, torch.Tensor], buf: dict[str, torch.Tensor], xi: torch.Tensor,
            yi: torch.Tensor, mi: torch.Tensor) -> tuple[dict[str, torch.Tensor], tuple]:
        return grad(loss, has_aux=True)(p, buf, xi[None], yi[None], mi[None])

    per_example = vmap(one, in_dims=(None, None, 0, 0, 0))

    def clipped(p: dict[str, torch.Tensor], buf: dict[str, torch.Tensor], xb: torch.Tensor,
                yb: torch.Tensor, mask: torch.Tensor) -> tuple[dict[str, torch.Tensor], tuple]:
        g, (sums, logits) = per_example(p, buf, xb, yb, mask)
        norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
        factor = (dp.max_grad_norm / (norms + 1e-6)).clamp(max=1.0) * mask
        out = {n: torch.einsum("b,b...->...", factor, v) for n, v in g.items()}
        return out, (sums.sum(), logits[:, 0])

    return clipped


def _bcast(active: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return active.view(-1, *[1] * (like.dim() - 1))
