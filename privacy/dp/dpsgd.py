"""DP-SGD through Opacus' PrivacyEngine (Abadi et al. 2016; Yousefpour et al. 2021).

One call, :func:`make_private`, turns a model, optimizer and data loader into their
private counterparts with Poisson sampling, per-sample clipping and Gaussian noise.
The grad-sample mode decides how per-sample gradient norms are computed:

- ``hooks``: Opacus' default, materializes per-sample gradients with backward hooks;
- ``ghost``: ghost clipping (Li et al. 2022; Bu et al. 2023), computes per-sample norms
  without materializing per-sample gradients and does a second backward pass;
- ``bookkeeping``: fedpriv's one-pass book-keeping clipping (Bu et al. 2023,
  :mod:`privacy.dp.bookkeeping`) inside Opacus' own loader, optimizer and accountant,
  for models of Linear, Conv2d, Embedding, LayerNorm, GroupNorm and (swapped for
  Opacus') recurrent layers; the same step as ``hooks`` to float rounding (tested,
  noise included).

All process the empty batches Poisson sampling produces as a noise-only step, as the
analysis requires. Opacus' ``ew`` and ``functorch`` modes fail on an empty batch
(measured: "Batch size must be positive, got 0") and were no faster than hooks where
they run, so they are not offered. ``auto`` picks the mode measured fastest for the
model (docs/BENCHMARKS.md): book-keeping for both CNNs, MLPs, the linear probe and the
character models, hooks for ResNet-18 (where the two tie).
"""

from __future__ import annotations

import logging
import secrets
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .modes import GRAD_SAMPLE_MODES
from .public import PublicSchedule


class UnsupportedModelError(ValueError):
    """The model has a layer Opacus cannot compute per-sample gradients for."""

# Opacus' notices that do not apply here: the non-cryptographic RNG is a documented choice
# (research, not production), and ghost clipping's second backward pass fires full hooks.
warnings.filterwarnings("ignore", "Secure RNG turned off", UserWarning)
warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)


def import_opacus() -> None:
    """Import Opacus without the root logging handler it installs (which doubles Flower's logs)."""
    root = logging.getLogger()
    before = list(root.handlers)
    import opacus  # noqa: F401
    import opacus.utils.module_utils  # noqa: F401  (the module that calls basicConfig)

    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)


def _recurrent_pairs() -> dict[type, type]:
    from opacus.layers import DPGRU, DPLSTM, DPRNN

    return {nn.LSTM: DPLSTM, nn.GRU: DPGRU, nn.RNN: DPRNN}


def _opacus_layer(child: nn.Module, target: type) -> nn.Module:
    """Opacus' DPLSTM/DPGRU/DPRNN (``target``) with ``child``'s sizes and weights (they
    name their weights as torch does), or torch's own layer from one of Opacus'."""
    options: dict[str, Any] = {"num_layers": child.num_layers, "bias": child.bias,
                               "batch_first": child.batch_first, "dropout": child.dropout,
                               "bidirectional": child.bidirectional}
    if isinstance(child, nn.RNN):
        options["nonlinearity"] = child.nonlinearity
    elif target is nn.RNN:  # Opacus' DPRNN keeps it among its cells' settings
        options["nonlinearity"] = child.cell_params["nonlinearity"]
    new = target(child.input_size, child.hidden_size, **options)
    new.load_state_dict(child.state_dict())
    return new.to(next(child.parameters()).device)


def _swap_layers(model: nn.Module, convert: Callable[[nn.Module], nn.Module | None]) -> bool:
    """Replace each layer ``convert`` gives a replacement for (same sizes and weights);
    True if any was replaced."""
    swapped = False
    for name, child in list(model.named_children()):
        new = convert(child)
        if new is None:
            swapped |= _swap_layers(child, convert)
            continue
        setattr(model, name, new)
        swapped = True
    return swapped


def private_layers(model: nn.Module, mode: str = "hooks") -> bool:
    """Swap torch's LSTM, GRU and RNN in place (same weights) for layers with per-sample
    gradients: under book-keeping, :mod:`.recurrent`'s (each input projection once per
    sequence) where they apply; otherwise Opacus' DPLSTM, DPGRU and DPRNN. True if any
    was swapped (:func:`plain_layers` swaps them back)."""
    import_opacus()
    from .recurrent import sequence_layer, supported

    pairs = _recurrent_pairs()

    def convert(child: nn.Module) -> nn.Module | None:
        if mode == "bookkeeping" and supported(child):
            return sequence_layer(child)
        target = pairs.get(type(child))
        return None if target is None else _opacus_layer(child, target)

    return _swap_layers(model, convert)


def plain_layers(model: nn.Module) -> nn.Module:
    """Undo :func:`private_layers`: the model with torch's own recurrent layers (and its
    weights' state-dict order), as the server built it."""
    from .recurrent import SequenceRecurrent

    back = {v: k for k, v in _recurrent_pairs().items()}

    def convert(child: nn.Module) -> nn.Module | None:
        if isinstance(child, SequenceRecurrent):
            return child.plain()
        target = back.get(type(child))
        return None if target is None else _opacus_layer(child, target)

    _swap_layers(model, convert)
    return model


def check_model(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` naming every layer Opacus cannot train privately."""
    import_opacus()
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        listed = "; ".join(str(e) for e in errors[:5])
        hint = (" Replace BatchNorm with GroupNorm (opacus.validators.ModuleValidator.fix(model)"
                " does it) or choose another model (cnn, small-cnn, resnet18, mlp and linear "
                "are all compatible)." if "BatchNorm" in listed else "")
        raise UnsupportedModelError(f"the model cannot be trained with DP-SGD: {listed}.{hint}")


# Measured (docs/BENCHMARKS.md): one local epoch, 1 thread, batch 32, DP-SGD / SGD time.
# 2026-11-26: the CNNs re-measured after book-keeping's torch.func conv path.
FASTER_MODE = {"small-cnn": "bookkeeping",  # hooks 2.4x, ghost 2.4x, bookkeeping 1.6x
               "cnn": "bookkeeping",  # hooks 8.3x, ghost 2.3x, bookkeeping 1.5x
               "mlp": "bookkeeping",  # hooks 11x, ghost 3.9x, bookkeeping 2.5x
               "linear": "bookkeeping",  # hooks 2.4x, ghost 2.6x, bookkeeping 1.55x
               # 2026-12-02, batch 32, 4 steps: hooks 3.97x, ghost 4.05x, bookkeeping
               # 1.25x (ghost norms for its last two stages, bookkeeping.ghost_cheaper)
               "resnet18": "bookkeeping",
               # batch 10, 80 steps: the GRU hooks 4.1x (Opacus' DPGRU), bookkeeping
               # 1.12x (privacy.dp.recurrent); the 2 x 256 LSTM hooks 12x, bookkeeping 2.1x
               "char-lstm": "bookkeeping", "char-gru": "bookkeeping",
               "char-transformer": "bookkeeping"}  # hooks 1.76x, bookkeeping 1.32x


RECURRENT = ("grad-sample-mode = {mode!r} cannot train recurrent layers (Opacus' DPLSTM/DPGRU "
             "reuse a layer at every step, which its ghost clipping assumes never happens). "
             "Use grad-sample-mode = 'bookkeeping', 'hooks' or 'auto'.")


def check_mode(mode: str, model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` when ``mode`` cannot train ``model``."""
    from .bookkeeping import supports, uncovered

    recurrent = any(isinstance(m, nn.RNNBase) or type(m).__name__ in ("DPLSTM", "DPGRU", "DPRNN")
                    for m in model.modules())
    if mode == "ghost" and recurrent:
        raise UnsupportedModelError(RECURRENT.format(mode=mode))
    if mode == "bookkeeping" and not supports(model):
        raise UnsupportedModelError(
            "grad-sample-mode = 'bookkeeping' covers models whose trained layers are all "
            "Linear, ungrouped Conv2d, Embedding, LayerNorm, GroupNorm or recurrent (every "
            f"built-in model); this one has others ({', '.join(uncovered(model))}). Use "
            "grad-sample-mode = 'hooks', 'ghost' or 'auto'.")


def resolve_mode(mode: str, model_name: str) -> str:
    """'auto' -> the grad-sample mode measured fastest for this model (ghost if unknown)."""
    if mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"grad-sample-mode must be one of {GRAD_SAMPLE_MODES}, got {mode!r}")
    return FASTER_MODE.get(model_name, "ghost") if mode == "auto" else mode


@dataclass
class PrivateTraining:
    """What :func:`make_private` returns: train with these instead of the originals."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    criterion: Any
    engine: Any
    mode: str

    @property
    def steps_per_epoch(self) -> int:
        return len(self.loader)

    @property
    def sample_rate(self) -> float:
        return float(self.loader.sample_rate)

    def history(self) -> list[tuple[float, float, int]]:
        """The (noise multiplier, sample rate, steps) entries this training has taken."""
        return [tuple(e) for e in self.engine.accountant.history]

    swapped: bool = False  # recurrent layers swapped for Opacus' (private_layers)

    @property
    def reusable(self) -> bool:
        """Whether :meth:`module` gives the model back as built (book-keeping removes all
        it added; Opacus' GradSampleModule leaves its hooks on the layers)."""
        return self.mode == "bookkeeping" and not self.swapped

    def module(self) -> nn.Module:
        """The plain model underneath (its state dict has the original keys, in order)."""
        model = unwrap(self.model)
        return plain_layers(model) if self.swapped else model


def unwrap(model: nn.Module) -> nn.Module:
    """Strip Opacus' GradSampleModule wrapper (or book-keeping's, removing its hooks)."""
    from .bookkeeping import BookKeeping

    if isinstance(model, BookKeeping):
        return model.remove()
    return getattr(model, "_module", model)


def _opacus_accountant(accountant: str) -> str:
    """The Opacus accountant that records the steps (pld is fedpriv's, from that history)."""
    return "rdp" if accountant == "pld" else accountant


def _apply_schedule(loader: Any, optimizer: Any, acc: Any, schedule: PublicSchedule) -> None:
    """Give Opacus' Poisson loader, optimizer and accountant hook the public schedule in
    place of what they derived from the data's length (:mod:`privacy.dp.public`)."""
    q = schedule.sample_rate
    loader.sample_rate = q
    loader.batch_sampler.sample_rate = q
    loader.batch_sampler.steps = schedule.steps_per_epoch
    optimizer.expected_batch_size = schedule.expected_batch_size
    optimizer.attach_step_hook(acc.get_optimizer_hook_fn(sample_rate=q))


def _bookkeeping(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, *,
                 noise_multiplier: float, max_grad_norm: float, seed: int | None,
                 accountant: str, secure: bool, noise: torch.Generator | None,
                 schedule: PublicSchedule | None = None, draw_ahead: bool = True
                 ) -> PrivateTraining:
    """DP-SGD with book-keeping clipping (:mod:`privacy.dp.bookkeeping`), assembled from
    the same Opacus parts ``PrivacyEngine.make_private`` uses — the Poisson data loader,
    ``DPOptimizer``'s noise and scaling, the accountant and its step hook — with the
    same seeds, so batches, noise draws and accounting are those of the other modes."""
    from types import SimpleNamespace

    from opacus.accountants import create_accountant
    from opacus.data_loader import DPDataLoader
    from opacus.optimizers import DPOptimizer

    from .bookkeeping import BookKeeping, make_optimizer_class

    rng = secure_generator() if secure else None  # the batches are drawn on the CPU
    if rng is None and seed is not None and loader.generator is not None:
        loader.generator.manual_seed(seed)
    dp_loader = DPDataLoader.from_data_loader(loader, generator=rng or loader.generator)
    sample_rate = 1 / len(dp_loader)  # as PrivacyEngine.make_private computes it
    wrapped = BookKeeping(model)
    dp_opt = make_optimizer_class(DPOptimizer)(
        optimizer, bookkeeping=wrapped, draw_ahead=draw_ahead,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=int(len(dp_loader.dataset) * sample_rate),
        loss_reduction="mean", generator=noise, secure_mode=secure)
    acc = create_accountant(mechanism=_opacus_accountant(accountant))
    dp_opt.attach_step_hook(acc.get_optimizer_hook_fn(sample_rate=sample_rate))
    if schedule is not None:
        _apply_schedule(dp_loader, dp_opt, acc, schedule)
    return PrivateTraining(wrapped, dp_opt, dp_loader, nn.CrossEntropyLoss(),
                           SimpleNamespace(accountant=acc), "bookkeeping")


def secure_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` seeded from the OS's entropy pool (63 bits,
    ``secrets``): the Poisson batches are drawn on the CPU, the noise where the gradients are.

    Opacus' ``secure_mode`` wants ``torchcsprng``, which has no build for current torch
    (PyPI has no distribution of it); torch's own generator seeded unpredictably is what
    fedpriv offers instead. It is not a cryptographic stream: an adversary who sees
    many raw draws could in principle recover its state.
    """
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def rebuilt(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """The same optimizer, with the same settings, over ``model``'s (new) parameters: only
    the settings its constructor takes (AdamW's defaults hold one it does not accept)."""
    import inspect

    accepted = inspect.signature(type(optimizer)).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(model.parameters(), **settings)


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, *,
                 noise_multiplier: float, max_grad_norm: float, grad_sample_mode: str = "hooks",
                 seed: int | None = None, accountant: str = "rdp",
                 secure: bool = False, noise_seed: int | None = None,
                 schedule: PublicSchedule | None = None,
                 device: torch.device | str = "cpu", draw_ahead: bool = True
                 ) -> PrivateTraining:
    """Wrap (model, optimizer, loader) for DP-SGD with Poisson sampling.

    With a ``schedule`` the sampling rate, steps per epoch and normaliser are its public
    values (:mod:`privacy.dp.public`: what a release must depend on under add/remove
    neighbours); without one they are Opacus' own, derived from the loader's length
    (q = 1 / ceil(n / B), normaliser int(n q)), which reveals n.

    ``grad_sample_mode`` is ``hooks``, ``ghost`` or ``bookkeeping`` (see
    :func:`resolve_mode` for auto).

    ``seed`` makes the Poisson sampling reproducible. The noise is drawn from a generator of its own
    on ``device`` (where training runs) seeded with ``noise_seed`` (nothing then depends on
    torch's global generator, so clients may train side by side in threads with the noise they
    would draw alone), or without it from torch's global generator, seeded by the caller, as
    Opacus draws it. ``secure`` instead draws batches and noise from :func:`secure_generator`
    and samples noise as Opacus' secure mode does (the sum of four Gaussians, robust to the
    floating-point attacks of Jin et al. 2022 and Haney et al. 2022; Holohan & Braghin 2021):
    about 4x the noise-sampling cost. With ``draw_ahead`` (book-keeping, a generator of its
    own) each step's noise is drawn on a worker thread while the step before trains: the
    same draws, faster only where a core is spare (on busy cores the hand-over costs more
    than it saves).
    """
    model.train()  # Opacus validates (and trains) a model in training mode
    mode = resolve_mode(grad_sample_mode, "")
    swapped = private_layers(model, mode)
    if swapped:  # the optimizer must hold the new layers' parameters
        optimizer = rebuilt(optimizer, model)
    check_model(model)
    from opacus import PrivacyEngine

    if swapped and mode == "ghost":
        raise UnsupportedModelError(RECURRENT.format(mode=mode))
    # the noise is drawn where the gradients are: a generator of the training device
    noise = (secure_generator(device) if secure else None if noise_seed is None
             else torch.Generator(device=device).manual_seed(noise_seed))
    if mode == "bookkeeping":
        check_mode(mode, model)
        private = _bookkeeping(model, optimizer, loader, noise_multiplier=noise_multiplier,
                               max_grad_norm=max_grad_norm, seed=seed, accountant=accountant,
                               secure=secure, noise=noise, schedule=schedule,
                               draw_ahead=draw_ahead)
        private.swapped = swapped
        return private
    # Opacus' grad samplers misread a channels-last convolution: its per-example gradients
    # were off by up to 0.1 on the small CNN (tests/test_dp_bookkeeping.py), so the
    # clipping would not bound what each example adds. Its modes get NCHW convolutions
    # (the same Parameters: the optimizer is unchanged); book-keeping takes either layout.
    model.to(memory_format=torch.contiguous_format)
    engine = PrivacyEngine(accountant=_opacus_accountant(accountant))
    if secure:  # Opacus' secure mode without torchcsprng (see secure_generator)
        engine.secure_mode = True
        engine.secure_rng = secure_generator()
    elif seed is not None and loader.generator is not None:
        loader.generator.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="opacus")
        out = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                  noise_multiplier=noise_multiplier,
                                  max_grad_norm=max_grad_norm, poisson_sampling=True,
                                  grad_sample_mode=mode,
                                  noise_generator=None if secure else noise,
                                  criterion=nn.CrossEntropyLoss())
    if mode == "ghost":
        dp_model, dp_opt, criterion, dp_loader = out
    else:
        (dp_model, dp_opt, dp_loader), criterion = out, nn.CrossEntropyLoss()
    if secure:  # Opacus gives its one secure_rng (a CPU one: the batches) the noise too
        dp_opt.generator = noise
    if schedule is not None:
        _apply_schedule(dp_loader, dp_opt, engine.accountant, schedule)
    return PrivateTraining(dp_model, dp_opt, dp_loader, criterion, engine, mode, swapped)
