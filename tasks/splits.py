"""The tensors each side of the federation works on: a client's partition, the server's test set.

A Ray actor serves many simulated clients in turn: it reads the dataset and computes
the partitioning once per process (both cached); turning one client's uint8 rows into
normalized tensors is cheap (milliseconds) and is redone per message, so memory does
not grow with the number of clients. With ``features = "embeddings"`` the rows are the
frozen backbone's embeddings instead, cached on disk per partition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .datasets import DatasetBundle, client_dataset
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


def _embeddings(cfg: Mapping[str, Any]) -> bool:
    return cfg["features"] == "embeddings"


def public_fraction(cfg: Mapping[str, Any]) -> float:
    """The share of the training set held back as public data (0 unless a backbone uses it)."""
    if _embeddings(cfg) and not cfg["backbone-weights"] and cfg["backbone-data"] == "public-split":
        return float(cfg["public-fraction"])
    return 0.0


def dataset_key(cfg: Mapping[str, Any]) -> tuple[str, str, bool, float]:
    return (str(cfg["dataset"]), str(cfg["data-dir"]), bool(cfg["download"]),
            public_fraction(cfg))


def dataset_for(cfg: Mapping[str, Any]) -> DatasetBundle:
    """The (raw) dataset the clients split, without any public split."""
    return client_dataset(*dataset_key(cfg))


def feature_shape(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """What the model reads: image shape, tabular width, or the embedding width."""
    if _embeddings(cfg):
        from .embeddings import backbone_spec

        return (backbone_spec(cfg).dim,)
    return dataset_for(cfg).input_shape


def partitions_for(cfg: Mapping[str, Any], num_partitions: int) -> tuple[np.ndarray, ...]:
    """Every client's training indices for this config (computed once per process)."""
    return cached_partitions(dataset_key(cfg), num_partitions, **partition_args(cfg))


def client_split(cfg: Mapping[str, Any], partition_id: int, num_partitions: int) -> Split:
    """The training examples held by one client (pixels, or their embeddings)."""
    data = dataset_for(cfg)
    idx = partitions_for(cfg, num_partitions)[partition_id]
    if _embeddings(cfg):
        from .embeddings import backbone_spec, cached_embeddings

        emb = cached_embeddings(backbone_spec(cfg), data, data.x_train[idx],
                                f"p{partition_id}of{num_partitions}")
        x = torch.from_numpy(emb)
    else:
        x = data.to_tensor(data.x_train[idx])
    return Split(x, torch.from_numpy(data.y_train[idx]), data.num_classes)


def test_split(cfg: Mapping[str, Any]) -> Split:
    """The held-out test set (server side only; never sent to clients)."""
    data = dataset_for(cfg)
    if _embeddings(cfg):
        from .embeddings import backbone_spec, cached_embeddings

        x = torch.from_numpy(cached_embeddings(backbone_spec(cfg), data, data.x_test, "test"))
    else:
        x = data.to_tensor(data.x_test)
    return Split(x, torch.from_numpy(data.y_test), data.num_classes)
