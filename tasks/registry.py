"""The registries both sides of the federation share: datasets, partitioners, models and
backbones (:class:`privacy.registry.Registry`; strategies are in :mod:`strategies.registry`).

fedpriv's own entries are ``"module:attribute"`` strings imported on first use, so the
run-config schema — and with it ``--help`` and every input check — knows every allowed
name without importing torch, Flower or scikit-learn. Register your own in a module the
run config's ``plugins`` key names (docs/EXTENDING.md).
"""

from __future__ import annotations

from privacy.registry import Registry

from .errors import ConfigError

__all__ = ["BACKBONES", "DATASETS", "MODELS", "PARTITIONERS", "Registry"]

DATASETS: Registry = Registry(
    "dataset", where="tasks.registry.DATASETS", error=ConfigError,
    signature="a tasks.datasets.Dataset: its DatasetMeta (kind, input shape, classes, "
              "normalization) and read(data_dir: Path | None, download: bool) -> DatasetBundle")
"""Datasets by name: each a :class:`tasks.datasets.Dataset` (metadata plus a reader)."""
DATASETS.register("mnist", "tasks.datasets:MNIST")
DATASETS.register("fashion-mnist", "tasks.datasets:FASHION_MNIST")
DATASETS.register("cifar10", "tasks.datasets:CIFAR10")
DATASETS.register("cifar100", "tasks.datasets:CIFAR100")
DATASETS.register("breast-cancer", "tasks.datasets:BREAST_CANCER")

PARTITIONERS: Registry = Registry(
    "partitioner", where="tasks.registry.PARTITIONERS", error=ConfigError,
    signature="partitioner(num_partitions: int, args: tasks.partition.PartitionArgs) -> a "
              "flwr_datasets Partitioner (its dataset is set to the label column)")
"""Partitioners by name: ``(num_partitions, PartitionArgs) -> flwr-datasets Partitioner``."""
PARTITIONERS.register("iid", "tasks.partition:iid")
PARTITIONERS.register("dirichlet", "tasks.partition:dirichlet")
PARTITIONERS.register("shard", "tasks.partition:shard")
PARTITIONERS.register("pathological", "tasks.partition:pathological")

MODELS: Registry = Registry(
    "model", where="tasks.registry.MODELS", error=ConfigError,
    signature="model(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...]) "
              "-> torch.nn.Module (no BatchNorm, so that DP-SGD can train it)")
"""Models by name: ``(input shape without batch dim, classes, mlp-hidden widths) ->
nn.Module``; DP-SGD (Opacus) needs layers it can compute per-sample gradients for."""
MODELS.register("cnn", "tasks.models:mcmahan_cnn")
MODELS.register("small-cnn", "tasks.models:small_cnn")
MODELS.register("resnet18", "tasks.models:resnet18")
MODELS.register("mlp", "tasks.models:mlp")
MODELS.register("linear", "tasks.models:linear")

BACKBONES: Registry = Registry(
    "backbone", where="tasks.registry.BACKBONES", error=ConfigError,
    signature="backbone(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module "
              "(a trunk: the model without its classifier; its flattened output is the "
              "embedding)")
"""Trunks a frozen embedding network is built on: ``(input shape, classes) -> nn.Module``."""
BACKBONES.register("cnn", "tasks.models:mcmahan_cnn_trunk")
BACKBONES.register("small-cnn", "tasks.models:small_cnn_trunk")
BACKBONES.register("resnet18", "tasks.models:resnet18_trunk")
