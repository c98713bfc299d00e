"""Built models kept within a process for the next message of the same architecture.

Every training or evaluation message overwrites all of a model's weights with the ones
it carries, so building a fresh model for it (initialising every weight; the small CNN
also runs a forward pass to size its classifier) is pure overhead: about 1.5 ms a
message, more than a four-image client's whole step. A model taken from the pool has
the message's state loaded, no gradients and training mode on, so what it computes is
what a freshly built model with that state computes. Only models that came back
unchanged in structure are returned (plain training, evaluation and book-keeping DP-SGD,
which removes all it added; a model Opacus' own modes wrapped keeps their hooks and is
never given back).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from .config import RunConfig
from .splits import model_args, model_for

_IDLE: dict[tuple, list[nn.Module]] = {}
_LOCK = threading.Lock()


def take(cfg: RunConfig, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """A model of ``cfg``'s architecture holding ``state``: an idle one, else a new one."""
    key = model_args(cfg)
    with _LOCK:
        idle = _IDLE.get(key)
        model = idle.pop() if idle else None
    if model is None:
        model, _ = model_for(cfg)
    model.load_state_dict(state)
    return model


def give(cfg: RunConfig, model: nn.Module) -> None:
    """Keep ``model`` (whose weights the caller no longer reads) for the next ``take``, in
    the layout it was built in (plain training switches its convolutions to channels-last:
    :func:`tasks.training.convolutions_channels_last`)."""
    for p in model.parameters():
        p.grad = None
    model.to(memory_format=torch.contiguous_format)
    model.train()
    with _LOCK:
        _IDLE.setdefault(model_args(cfg), []).append(model)


@contextmanager
def borrowed(cfg: RunConfig, state: Mapping[str, torch.Tensor]) -> Iterator[nn.Module]:
    """``take`` for a block that only reads the model; given back when the block ends
    without an error."""
    model = take(cfg, state)
    yield model
    give(cfg, model)


def clear() -> None:
    """Drop every idle model (tests; a process that changes a model's definition)."""
    with _LOCK:
        _IDLE.clear()
