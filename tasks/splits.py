"""The tensors each side of the federation works on: a client's partition, the server's test set.

A Ray actor serves many simulated clients in turn: it reads the dataset and computes
the partitioning once per process (both cached); turning one client's uint8 rows into
normalized tensors is cheap (milliseconds) and is redone per message, so memory does
not grow with the number of clients.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .datasets import DatasetBundle, load_dataset
from .partition import cached_partitions, label_histogram, partition_args


@dataclass(frozen=True)
class Split:
    """Model-ready tensors plus the raw labels they came from."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int

    def __len__(self) -> int:
        return len(self.y)

    def label_counts(self) -> list[int]:
        return label_histogram(self.y.numpy(), self.num_classes)


def dataset_key(cfg: Mapping[str, Any]) -> tuple[str, str, bool]:
    return (str(cfg["dataset"]), str(cfg["data-dir"]), bool(cfg["download"]))


def dataset_for(cfg: Mapping[str, Any]) -> DatasetBundle:
    return load_dataset(*dataset_key(cfg))


def partitions_for(cfg: Mapping[str, Any], num_partitions: int) -> tuple[np.ndarray, ...]:
    """Every client's training indices for this config (computed once per process)."""
    return cached_partitions(dataset_key(cfg), num_partitions, **partition_args(cfg))


def client_split(cfg: Mapping[str, Any], partition_id: int, num_partitions: int) -> Split:
    """The training examples held by one client."""
    args = partition_args(cfg)
    return _client_split(dataset_key(cfg), num_partitions, tuple(args.items()), partition_id)


def _client_split(key: tuple, num_partitions: int, args: tuple, partition_id: int) -> Split:
    data = load_dataset(*key)
    idx = cached_partitions(key, num_partitions, **dict(args))[partition_id]
    return Split(data.to_tensor(data.x_train[idx]), torch.from_numpy(data.y_train[idx]),
                 data.num_classes)


@functools.lru_cache(maxsize=2)
def _test_split(key: tuple) -> Split:
    data = load_dataset(*key)
    return Split(data.to_tensor(data.x_test), torch.from_numpy(data.y_test), data.num_classes)


def test_split(cfg: Mapping[str, Any]) -> Split:
    """The held-out test set (server side only; never sent to clients)."""
    return _test_split(dataset_key(cfg))
