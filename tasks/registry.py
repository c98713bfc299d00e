"""The registries both sides of the federation share: datasets, partitioners, models and
backbones (:class:`privacy.registry.Registry`; strategies are in :mod:`strategies.registry`).

fedpriv's own entries are ``"module:attribute"`` strings imported on first use, so the
run-config schema — and with it ``--help`` and every input check — knows every allowed
name without importing torch, Flower or scikit-learn. Register your own in a module the
run config's ``plugins`` key names (docs/EXTENDING.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from privacy.registry import Registry

from .errors import ConfigError

__all__ = ["BACKBONES", "DATASETS", "MODELS", "PARTITIONERS", "DatasetInfo", "ModelInfo",
           "Registry", "auto_model"]


@dataclass(frozen=True)
class DatasetInfo:
    """What the run-config checks may know of a dataset without reading it (or importing
    torch): its input shape without the batch dimension (None: known only once loaded)."""

    input_shape: tuple[int, ...] | None = None
    kind: str = "image"  # "image", "tabular" or "text": which models can read it
    natural: bool = False  # its rows name their client (a role, a writer): partitioner natural


@dataclass(frozen=True)
class ModelInfo:
    """What the run-config checks may know of a model without building it: whether its
    factory reads ``hidden`` (the ``mlp-hidden`` widths). A plugin's factory is given them
    and may, so True unless it says otherwise."""

    reads_hidden: bool = True
    reads: tuple[str, ...] = ("image", "tabular", "text")  # the dataset kinds it takes


def auto_model(input_shape: tuple[int, ...], kind: str = "image") -> str:
    """The model ``model = 'auto'`` means for inputs of ``input_shape``: mlp for vectors
    (tabular rows, embeddings), resnet18 for 32x32 images or larger, else small-cnn; for
    text, char-gru."""
    if kind == "text":
        return "char-gru"
    if len(input_shape) == 1:
        return "mlp"
    return "resnet18" if input_shape[-1] >= 32 else "small-cnn"


DATASETS: Registry = Registry(
    "dataset", where="tasks.registry.DATASETS", error=ConfigError, info=DatasetInfo,
    signature="a tasks.datasets.Dataset: its DatasetMeta (kind, input shape, classes, "
              "normalization) and read(data_dir: Path | None, download: bool) -> DatasetBundle")
"""Datasets by name: each a :class:`tasks.datasets.Dataset` (metadata plus a reader)."""
# (the shapes are their DatasetMeta's: tests/test_fuzz_keys.py checks)
DATASETS.register("mnist", "tasks.datasets:MNIST", input_shape=(1, 28, 28))
DATASETS.register("fashion-mnist", "tasks.datasets:FASHION_MNIST", input_shape=(1, 28, 28))
DATASETS.register("cifar10", "tasks.datasets:CIFAR10", input_shape=(3, 32, 32))
DATASETS.register("cifar100", "tasks.datasets:CIFAR100", input_shape=(3, 32, 32))
DATASETS.register("breast-cancer", "tasks.datasets:BREAST_CANCER", input_shape=(30,),
                  kind="tabular")
DATASETS.register("shakespeare", "tasks.leaf_files:SHAKESPEARE", input_shape=(80,),
                  kind="text", natural=True)
DATASETS.register("femnist", "tasks.leaf_files:FEMNIST", input_shape=(1, 28, 28),
                  natural=True)

PARTITIONERS: Registry = Registry(
    "partitioner", where="tasks.registry.PARTITIONERS", error=ConfigError,
    signature="partitioner(num_partitions: int, args: tasks.partition.PartitionArgs) -> a "
              "flwr_datasets Partitioner (its dataset is set to the label column)")
"""Partitioners by name: ``(num_partitions, PartitionArgs) -> flwr-datasets Partitioner``."""
PARTITIONERS.register("iid", "tasks.partition:iid")
PARTITIONERS.register("dirichlet", "tasks.partition:dirichlet")
PARTITIONERS.register("shard", "tasks.partition:shard")
PARTITIONERS.register("pathological", "tasks.partition:pathological")
PARTITIONERS.register("natural", "tasks.partition:natural")

MODELS: Registry = Registry(
    "model", where="tasks.registry.MODELS", error=ConfigError, info=ModelInfo,
    signature="model(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...]) "
              "-> torch.nn.Module (no BatchNorm, so that DP-SGD can train it)")
"""Models by name: ``(input shape without batch dim, classes, mlp-hidden widths) ->
nn.Module``; DP-SGD (Opacus) needs layers it can compute per-sample gradients for."""
_IMAGES, _VECTORS = ("image",), ("image", "tabular")
MODELS.register("cnn", "tasks.models:mcmahan_cnn", reads_hidden=False, reads=_IMAGES)
MODELS.register("small-cnn", "tasks.models:small_cnn", reads_hidden=False, reads=_IMAGES)
MODELS.register("resnet18", "tasks.models:resnet18", reads_hidden=False, reads=_IMAGES)
MODELS.register("mlp", "tasks.models:mlp", reads=_VECTORS)
MODELS.register("linear", "tasks.models:linear", reads_hidden=False, reads=_VECTORS)
MODELS.register("char-lstm", "tasks.models:char_lstm", reads_hidden=False, reads=("text",))
MODELS.register("char-gru", "tasks.models:char_gru", reads_hidden=False, reads=("text",))
MODELS.register("char-transformer", "tasks.models:char_transformer", reads_hidden=False,
                reads=("text",))

BACKBONES: Registry = Registry(
    "backbone", where="tasks.registry.BACKBONES", error=ConfigError,
    signature="backbone(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module "
              "(a trunk: the model without its classifier; its flattened output is the "
              "embedding)")
"""Trunks a frozen embedding network is built on: ``(input shape, classes) -> nn.Module``."""
BACKBONES.register("cnn", "tasks.models:mcmahan_cnn_trunk")
BACKBONES.register("small-cnn", "tasks.models:small_cnn_trunk")
BACKBONES.register("resnet18", "tasks.models:resnet18_trunk")
