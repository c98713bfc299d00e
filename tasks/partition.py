"""Split a training set across clients with flwr-datasets partitioners.

The partitioners run on a local Hugging Face ``Dataset`` holding only the label and
the row index, so the same code partitions offline arrays and Hub datasets alike
and the image bytes are never copied. Every split is seeded and reproducible.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

import numpy as np

from .config import ConfigError


def _labels_dataset(labels: np.ndarray, seed: int | None):
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"label": labels, "index": np.arange(len(labels))})
    if seed is not None:
        # IidPartitioner splits contiguously; shuffle first so class-sorted data mixes.
        ds = ds.shuffle(seed=seed).flatten_indices()
    return ds


def make_partitioner(scheme: str, num_partitions: int, *, alpha: float, min_size: int,
                     shards_per_client: int, classes_per_client: int, seed: int) -> Any:
    """Build the flwr-datasets partitioner for a scheme name."""
    from flwr_datasets import partitioner as P

    if scheme == "iid":
        return P.IidPartitioner(num_partitions=num_partitions)
    if scheme == "dirichlet":
        return P.DirichletPartitioner(num_partitions=num_partitions, partition_by="label",
                                      alpha=alpha, min_partition_size=min_size,
                                      self_balancing=False, shuffle=True, seed=seed)
    if scheme == "shard":
        return P.ShardPartitioner(num_partitions=num_partitions, partition_by="label",
                                  num_shards_per_partition=shards_per_client,
                                  shuffle=True, seed=seed)
    if scheme == "pathological":
        return P.PathologicalPartitioner(num_partitions=num_partitions, partition_by="label",
                                         num_classes_per_partition=classes_per_client,
                                         class_assignment_mode="first-deterministic",
                                         shuffle=True, seed=seed)
    raise ConfigError(f"unknown partitioner {scheme!r}; choose iid, dirichlet, shard or "
                      "pathological.")


def _check_feasible(scheme: str, n: int, num_partitions: int, num_classes: int,
                    shards_per_client: int, classes_per_client: int) -> None:
    if num_partitions > n:
        raise ConfigError(
            f"num-clients = {num_partitions} is more than the {n:,} training examples: "
            "some clients would hold no data. Lower num-clients or use a larger dataset."
        )
    if scheme == "shard" and n // (num_partitions * shards_per_client) < 1:
        raise ConfigError(
            f"shard partitioner: {n:,} examples cannot make {num_partitions} x "
            f"{shards_per_client} non-empty shards. Lower num-clients or shards-per-client."
        )
    if scheme == "pathological" and classes_per_client > num_classes:
        raise ConfigError(
            f"classes-per-client = {classes_per_client} but the dataset has only "
            f"{num_classes} classes. Use a value from 1 to {num_classes}."
        )


def partition_indices(labels: np.ndarray, num_partitions: int, scheme: str, *,
                      num_classes: int, alpha: float = 0.5, min_size: int = 10,
                      shards_per_client: int = 2, classes_per_client: int = 2,
                      seed: int = 42) -> list[np.ndarray]:
    """Return, for each client, the indices of its training examples."""
    labels = np.asarray(labels)
    _check_feasible(scheme, len(labels), num_partitions, num_classes, shards_per_client,
                    classes_per_client)
    part = make_partitioner(scheme, num_partitions, alpha=alpha, min_size=min_size,
                            shards_per_client=shards_per_client,
                            classes_per_client=classes_per_client, seed=seed)
    part.dataset = _labels_dataset(labels, seed if scheme == "iid" else None)
    try:
        with warnings.catch_warnings():
            # Failed Dirichlet attempts are retried (and a final failure is reported below);
            # pyarrow's deprecation notice comes from inside flwr-datasets.
            warnings.filterwarnings("ignore", "The specified min_partition_size", UserWarning)
            warnings.filterwarnings("ignore", category=FutureWarning, module="pyarrow")
            out = [np.asarray(part.load_partition(i)["index"], dtype=np.int64)
                   for i in range(num_partitions)]
    except ValueError as exc:
        hint = ""
        if scheme == "dirichlet":
            hint = (" The Dirichlet partitioner could not give every client at least "
                    f"min-partition-size = {min_size} examples: raise dirichlet-alpha, "
                    "lower min-partition-size or lower num-clients.")
        raise ConfigError(f"partitioning failed: {exc}.{hint}") from exc
    empty = [i for i, idx in enumerate(out) if len(idx) == 0]
    if empty:
        raise ConfigError(
            f"{scheme} partitioning left clients {empty[:10]} with no data. Lower "
            "num-clients or change the partitioner's parameters."
        )
    return out


def partition_args(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The partitioner keyword arguments held in a run config."""
    return {"scheme": str(cfg["partitioner"]), "alpha": float(cfg["dirichlet-alpha"]),
            "min_size": int(cfg["min-partition-size"]),
            "shards_per_client": int(cfg["shards-per-client"]),
            "classes_per_client": int(cfg["classes-per-client"]), "seed": int(cfg["seed"])}


@functools.lru_cache(maxsize=4)
def cached_partitions(dataset_key: tuple, num_partitions: int, scheme: str, alpha: float,
                      min_size: int, shards_per_client: int, classes_per_client: int,
                      seed: int) -> tuple[np.ndarray, ...]:
    """Every client's indices for a dataset, computed once and kept in memory and on disk.

    The disk copy (in fedpriv's cache folder, keyed by a hash of the labels, every
    partitioner argument and the flwr-datasets version) lets simulated clients skip
    importing Hugging Face ``datasets`` after the CLI's pre-flight check has partitioned.
    """
    from .datasets import cache_dir, client_dataset

    data = client_dataset(*dataset_key)
    args = dict(scheme=scheme, alpha=alpha, min_size=min_size,
                shards_per_client=shards_per_client, classes_per_client=classes_per_client,
                seed=seed)
    digest = hashlib.sha256(np.ascontiguousarray(data.y_train).tobytes())
    digest.update(repr((num_partitions, sorted(args.items()), version("flwr-datasets"),
                        version("datasets"))).encode())
    path = cache_dir() / "partitions" / f"{digest.hexdigest()[:32]}.npz"
    if path.is_file():
        with np.load(path) as f:
            return tuple(f[f"p{i}"] for i in range(num_partitions))
    parts = tuple(partition_indices(data.y_train, num_partitions, num_classes=data.num_classes,
                                    **args))
    try:  # only a speed-up: a read-only cache folder must not stop a run
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
        np.savez(tmp, **{f"p{i}": p for i, p in enumerate(parts)})
        os.replace(tmp, path)
    except OSError:
        pass
    return parts


def label_histogram(labels: np.ndarray, num_classes: int) -> list[int]:
    """Counts per class, as plain ints (JSON-ready)."""
    return np.bincount(np.asarray(labels), minlength=num_classes).astype(int).tolist()
