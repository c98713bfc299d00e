"""The tensors each side of the federation works on: a client's partition, the server's test set.

A Ray actor serves many simulated clients in turn: it reads the dataset and computes
the partitioning once per process (both cached); turning one client's uint8 rows into
normalized tensors is cheap (milliseconds) and is redone per message, so memory does
not grow with the number of clients. With ``features = "embeddings"`` the rows are the
frozen backbone's embeddings instead, cached on disk per partition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from privacy.anonymize import public_transform

from .config import RunConfig
from .datasets import DatasetBundle, client_dataset, dataset_meta, reference_rows
from .embeddings import BackboneSpec, backbone_spec, cached_embeddings
from .errors import ConfigError
from .local_data import read_local_data
from .models import build_model, resolve_model_name
from .partition import PartitionArgs, cached_partitions, label_histogram, natural_clients


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


def public_fraction(cfg: RunConfig) -> float:
    """The share of the training set held back as public data (0 unless a backbone uses it)."""
    emb = cfg.embeddings
    if emb.enabled and not emb.backbone_weights and emb.backbone_data == "public-split":
        return emb.public_fraction
    return 0.0


def dataset_for(cfg: RunConfig) -> DatasetBundle:
    """The (raw) dataset the clients split, without any public split or the server's
    auxiliary data."""
    d = cfg.data
    return client_dataset(d.dataset, d.data_dir, d.download, public_fraction(cfg),
                          cfg.leakage.reference_fraction)


def reference_split(cfg: RunConfig) -> Split | None:
    """The server's auxiliary data (``reference-fraction`` of the training set, held back
    from every client), as the model reads it; None when the run keeps none. The
    reference-model membership attacks train their reference updates on it."""
    fraction = cfg.leakage.reference_fraction
    if fraction <= 0:
        return None
    d = cfg.data
    x, y = reference_rows(d.dataset, d.data_dir, d.download, public_fraction(cfg), fraction)
    data = dataset_for(cfg)
    if cfg.embeddings.enabled:
        xs = torch.from_numpy(cached_embeddings(_backbone(cfg), data, x))
    else:
        xs = data.to_tensor(x)
    return Split(model_inputs(cfg, xs), torch.from_numpy(y), data.num_classes)


def _backbone(cfg: RunConfig) -> BackboneSpec:
    return backbone_spec(cfg.embeddings, cfg.data)


def feature_shape(cfg: RunConfig) -> tuple[int, ...]:
    """What the model reads: image shape, tabular width, or the embedding width."""
    if cfg.embeddings.enabled:
        return (_backbone(cfg).dim,)
    return dataset_meta(cfg.data.dataset).input_shape


def model_name(cfg: RunConfig) -> str:
    """The concrete model a run trains ('auto' resolved for what the clients read)."""
    kind = "tabular" if cfg.embeddings.enabled else dataset_meta(cfg.data.dataset).kind
    return resolve_model_name(cfg.training.model, feature_shape(cfg), kind)


def model_inputs(cfg: RunConfig, x: torch.Tensor) -> torch.Tensor:
    """``x`` (a split's rows) as the model reads them: unchanged, or, with an anonymizer that
    publishes a transform of every row (e.g. hashing), transformed the same way on the
    server's test split as on a client's data."""
    a = cfg.anonymization
    transform = public_transform(a.anonymizer, a.params(), int(x.shape[1])) \
        if cfg.embeddings.enabled else None
    return x if transform is None else torch.from_numpy(transform(x.numpy()))


def model_args(cfg: RunConfig) -> tuple[str, tuple[int, ...], int, tuple[int, ...]]:
    """What decides the model's structure: the architecture, input shape, classes, widths."""
    return (model_name(cfg), feature_shape(cfg), dataset_meta(cfg.data.dataset).num_classes,
            tuple(cfg.training.hidden))


def model_for(cfg: RunConfig) -> tuple[nn.Module, str]:
    """The model a run config asks for, sized for what the clients train on."""
    name, shape, classes, hidden = model_args(cfg)
    return build_model(name, shape, classes, hidden), name


def partitions_for(cfg: RunConfig, num_partitions: int) -> tuple[np.ndarray, ...]:
    """Every client's training indices for this config (computed once per process)."""
    data = dataset_for(cfg)
    natural = data.clients if cfg.data.partitioner == "natural" else None
    return cached_partitions(data.labels_key, data.num_classes, num_partitions,
                             PartitionArgs.of(cfg.data, cfg.training.seed),
                             None if natural is None else data.clients_key,
                             0 if natural is None else len(natural.names))


def expected_partition_size(cfg: RunConfig, num_partitions: int) -> int:
    """The clients' training rows divided by the partitions, rounded down: a function of
    the configuration (dataset, public and reference fractions, and with natural
    partitions the clients the seed picks), not of any one partition."""
    if cfg.data.partitioner == "natural":
        rows = sum(len(p) for p in partitions_for(cfg, num_partitions))
    else:
        rows = len(dataset_for(cfg).y_train)
    return max(1, rows // max(1, num_partitions))


def client_split(cfg: RunConfig, partition_id: int, num_partitions: int) -> Split:
    """The training examples held by one client (pixels, or their embeddings)."""
    data = dataset_for(cfg)
    idx = partitions_for(cfg, num_partitions)[partition_id]
    if cfg.embeddings.enabled:
        x = torch.from_numpy(cached_embeddings(_backbone(cfg), data, data.x_train[idx]))
    else:
        x = data.to_tensor(data.x_train[idx])
    y = torch.from_numpy(data.y_train[idx])
    if cfg.memorization.enabled:  # the canary lines this client holds (Secret Sharer)
        from .text_canaries import canary_rows, planted

        cx, cy = canary_rows(planted(cfg), partition_id)
        x, y = torch.cat([x, data.to_tensor(cx)]), torch.cat([y, torch.from_numpy(cy)])
    return Split(x, y, data.num_classes)


def own_test_split(cfg: RunConfig, partition_id: int, num_partitions: int) -> Split | None:
    """A natural client's own held-out rows (LEAF's per-user test split), which federated
    evaluation scores the global model on; None for datasets without clients of their own
    or partitioners other than natural."""
    data = dataset_for(cfg)
    if data.clients is None or cfg.data.partitioner != "natural":
        return None
    chosen = natural_clients(len(data.clients.names), num_partitions, cfg.training.seed)
    rows = np.flatnonzero(data.clients.test == chosen[partition_id])
    return Split(data.to_tensor(data.clients.x_test[rows]),
                 torch.from_numpy(data.clients.y_test[rows]), data.num_classes)


def own_split(cfg: RunConfig, data_path: str) -> Split:
    """A host's own training examples (:mod:`tasks.local_data`), read as the run's dataset
    reads its rows; the dataset itself is not needed on the host."""
    if cfg.embeddings.enabled:
        raise ConfigError(
            f"data-path {data_path!r}: features = 'embeddings' needs the backbone's training "
            "data on every host, so a host's own data is read as raw features only. Run with "
            "features = 'raw', or serve a partition of the shared dataset instead.")
    meta = dataset_meta(cfg.data.dataset)
    x, y = read_local_data(data_path, meta)
    return Split(meta.to_tensor(x), torch.from_numpy(y), meta.num_classes)


def validation_split(cfg: RunConfig, heldout: Split) -> tuple[Split, Split | None]:
    """(test, validation): a fixed, stratified ``validation-fraction`` of the server's
    held-out set for model selection, and the rest to score it (None: no validation)."""
    fraction = cfg.training.validation_fraction
    if fraction <= 0:
        return heldout, None
    from sklearn.model_selection import train_test_split  # lazy: about a second to import

    idx = np.arange(len(heldout.y))
    test, val = train_test_split(idx, test_size=fraction, stratify=heldout.y.numpy(),
                                 random_state=0)
    test, val = np.sort(test), np.sort(val)
    return (Split(heldout.x[test], heldout.y[test], heldout.num_classes),
            Split(heldout.x[val], heldout.y[val], heldout.num_classes))


def heldout_split(cfg: RunConfig) -> Split:
    """The held-out test set (server side only; never sent to clients)."""
    data = dataset_for(cfg)
    if cfg.embeddings.enabled:
        x = torch.from_numpy(cached_embeddings(_backbone(cfg), data, data.x_test))
    else:
        x = data.to_tensor(data.x_test)
    return Split(x, torch.from_numpy(data.y_test), data.num_classes)
