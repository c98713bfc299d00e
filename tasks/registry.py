"""Registries: one dict per kind of component, from its name to where it is implemented.

An entry names its implementation as ``"module:attribute"`` and is imported on first
use, so the run-config schema — and with it ``--help`` and every input check — knows
every allowed name without importing torch, Flower or scikit-learn.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import ConfigError


class Registry(Mapping[str, str]):
    """Named implementations of one kind (datasets, models, ...), loaded lazily."""

    def __init__(self, kind: str, entries: Mapping[str, str]) -> None:
        self.kind = kind
        self._entries = dict(entries)
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> str:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def load(self, name: str) -> Any:
        """The implementation registered as ``name`` (imported on first use)."""
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of "
                              f"{', '.join(self._entries)}.")
        if name not in self._loaded:
            module, attr = self._entries[name].split(":")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]


DATASETS = Registry("dataset", {  # tasks.datasets.Dataset: description and reader
    "mnist": "tasks.datasets:MNIST",
    "fashion-mnist": "tasks.datasets:FASHION_MNIST",
    "cifar10": "tasks.datasets:CIFAR10",
    "cifar100": "tasks.datasets:CIFAR100",
    "breast-cancer": "tasks.datasets:BREAST_CANCER",
})
PARTITIONERS = Registry("partitioner", {
    "iid": "tasks.partition:iid",
    "dirichlet": "tasks.partition:dirichlet",
    "shard": "tasks.partition:shard",
    "pathological": "tasks.partition:pathological",
})
MODELS = Registry("model", {
    "cnn": "tasks.models:mcmahan_cnn",
    "small-cnn": "tasks.models:small_cnn",
    "resnet18": "tasks.models:resnet18",
    "mlp": "tasks.models:mlp",
    "linear": "tasks.models:linear",
})
BACKBONES = Registry("backbone", {  # trunks a frozen embedding network is built on
    "cnn": "tasks.models:mcmahan_cnn_trunk",
    "small-cnn": "tasks.models:small_cnn_trunk",
    "resnet18": "tasks.models:resnet18_trunk",
})
STRATEGIES = Registry("strategy", {  # Flower's strategies, configured in strategies.build
    "fedavg": "strategies.build:fedavg",
    "fedprox": "strategies.build:fedprox",
    "fedadam": "strategies.build:fedadam",
    "fedavgm": "strategies.build:fedavgm",
    "fedmedian": "strategies.build:fedmedian",
    "fedtrimmedavg": "strategies.build:fedtrimmedavg",
})
