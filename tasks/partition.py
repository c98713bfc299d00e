"""Split a training set across clients with flwr-datasets partitioners.

The partitioners run on a local Hugging Face ``Dataset`` holding only the label and
the row index, so the same code partitions offline arrays and Hub datasets alike
and the image bytes are never copied. Every split is seeded and reproducible.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import numpy as np

from .cache import array_digest, cache_path, save_atomic
from .config import DataConfig
from .errors import ConfigError
from .registry import PARTITIONERS


def _flwr_partitioners() -> Any:
    """flwr-datasets' partitioners. Imported only to partition: they load Hugging Face
    ``datasets`` (about 220 MB and 1.7 s), which clients skip when the split is cached."""
    from flwr_datasets import partitioner

    return partitioner


def _labels_dataset(labels: np.ndarray, seed: int | None, clients: np.ndarray | None = None):
    import datasets  # see _flwr_partitioners

    datasets.disable_progress_bars()
    columns = {"label": labels, "index": np.arange(len(labels))}
    if clients is not None:
        keep = clients >= 0
        columns = {"label": labels[keep], "index": np.flatnonzero(keep),
                   "client": clients[keep]}
    ds = datasets.Dataset.from_dict(columns)
    if seed is not None:
        # IidPartitioner splits contiguously; shuffle first so class-sorted data mixes.
        ds = ds.shuffle(seed=seed).flatten_indices()
    return ds


@dataclass(frozen=True)
class PartitionArgs:
    """What a partitioner needs (everything that changes the split, hence its cache key)."""

    scheme: str
    alpha: float
    min_size: int
    shards_per_client: int
    classes_per_client: int
    seed: int

    @classmethod
    def of(cls, data: DataConfig, seed: int) -> PartitionArgs:
        return cls(data.partitioner, data.dirichlet_alpha, data.min_partition_size,
                   data.shards_per_client, data.classes_per_client, seed)


# The registered partitioners (tasks.registry.PARTITIONERS): flwr-datasets, configured.

def iid(num_partitions: int, a: PartitionArgs) -> Any:
    return _flwr_partitioners().IidPartitioner(num_partitions=num_partitions)


def dirichlet(num_partitions: int, a: PartitionArgs) -> Any:
    return _flwr_partitioners().DirichletPartitioner(
        num_partitions=num_partitions, partition_by="label", alpha=a.alpha,
        min_partition_size=a.min_size, self_balancing=False, shuffle=True, seed=a.seed)


def shard(num_partitions: int, a: PartitionArgs) -> Any:
    return _flwr_partitioners().ShardPartitioner(
        num_partitions=num_partitions, partition_by="label",
        num_shards_per_partition=a.shards_per_client, shuffle=True, seed=a.seed)


def pathological(num_partitions: int, a: PartitionArgs) -> Any:
    return _flwr_partitioners().PathologicalPartitioner(
        num_partitions=num_partitions, partition_by="label",
        num_classes_per_partition=a.classes_per_client,
        class_assignment_mode="first-deterministic", shuffle=True, seed=a.seed)


def column(ds: Any, name: str) -> np.ndarray:
    """A Hugging Face dataset's column as one numpy array, through Arrow (its ``ds[name]``
    is a lazy Column that formats row by row: minutes for millions of rows)."""
    return ds.with_format("arrow")[:][name].to_numpy()


def natural(num_partitions: int, a: PartitionArgs) -> Any:
    """flwr-datasets' ``NaturalIdPartitioner`` on the column naming each row's client,
    with its grouping of rows vectorized (flwr-datasets walks every row in Python)."""
    base = _flwr_partitioners().NaturalIdPartitioner

    class Natural(base):  # type: ignore[misc, valid-type]
        def _create_partition_id_to_indices(self) -> None:
            ids = column(self.dataset, self._partition_by)
            order = np.argsort(ids, kind="stable")
            values, starts = np.unique(ids[order], return_index=True)
            bounds = [*starts[1:], len(ids)]
            self._partition_id_to_indices = {
                self._natural_id_to_partition_id[v]: order[a:b]
                for v, a, b in zip(values.tolist(), starts, bounds, strict=True)}

    return Natural(partition_by="client")


def natural_clients(num_ids: int, num_partitions: int, seed: int) -> np.ndarray:
    """Which of a dataset's own clients take part, in partition order: all of them when
    ``num_partitions`` equals their number, else a seeded sample (LEAF's user sampling)."""
    if num_partitions > num_ids:
        raise ConfigError(
            f"num-clients = {num_partitions}, but the dataset has only {num_ids:,} clients of "
            f"its own (partitioner = 'natural'). Use num-clients = {num_ids} for all of them, "
            "or fewer for a seeded sample.")
    if num_partitions == num_ids:
        return np.arange(num_ids)
    return np.sort(np.random.default_rng(seed).permutation(num_ids)[:num_partitions])


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


def partition_indices(labels: np.ndarray, num_partitions: int, args: PartitionArgs, *,
                      num_classes: int, clients: np.ndarray | None = None,
                      num_ids: int = 0) -> list[np.ndarray]:
    """Return, for each client, the indices of its training examples. ``clients`` names
    each row's own client (of ``num_ids``) for the natural partitioner."""
    labels = np.asarray(labels)
    _check_feasible(args.scheme, len(labels), num_partitions, num_classes,
                    args.shards_per_client, args.classes_per_client)
    part = PARTITIONERS.load(args.scheme)(num_partitions, args)
    ranks = None
    if args.scheme == "natural":
        if clients is None:
            raise ConfigError("partitioner = 'natural' needs a dataset whose rows name their "
                              "client (shakespeare, femnist); use iid, dirichlet, shard or "
                              "pathological.")
        chosen = natural_clients(num_ids, num_partitions, args.seed)
        rank = np.full(num_ids, -1, dtype=np.int64)
        rank[chosen] = np.arange(len(chosen))
        ranks = rank[clients]
    part.dataset = _labels_dataset(labels, args.seed if args.scheme == "iid" else None, ranks)
    try:
        with warnings.catch_warnings():
            # Failed Dirichlet attempts are retried (and a final failure is reported below);
            # pyarrow's deprecation notice comes from inside flwr-datasets.
            warnings.filterwarnings("ignore", "The specified min_partition_size", UserWarning)
            warnings.filterwarnings("ignore", category=FutureWarning, module="pyarrow")
            out = [column(part.load_partition(i), "index").astype(np.int64)
                   for i in range(num_partitions)]
    except ValueError as exc:
        hint = ""
        if args.scheme == "dirichlet":
            hint = (" The Dirichlet partitioner could not give every client at least "
                    f"min-partition-size = {args.min_size} examples: raise dirichlet-alpha, "
                    "lower min-partition-size or lower num-clients.")
        raise ConfigError(f"partitioning failed: {exc}.{hint}") from exc
    empty = [i for i, idx in enumerate(out) if len(idx) == 0]
    if empty:
        raise ConfigError(
            f"{args.scheme} partitioning left clients {empty[:10]} with no data. Lower "
            "num-clients or change the partitioner's parameters.")
    return out


@functools.lru_cache(maxsize=4)
def cached_partitions(labels: LabelsKey, num_classes: int, num_partitions: int,
                      args: PartitionArgs, clients: LabelsKey | None = None,
                      num_ids: int = 0) -> tuple[np.ndarray, ...]:
    """Every client's indices, computed once and kept in memory and in fedpriv's cache.

    The disk copy (keyed by the labels, the partitioner's arguments, the flwr-datasets
    version and this module's code) lets simulated clients skip importing Hugging Face
    ``datasets`` after the CLI's pre-flight check has partitioned.
    """
    natural = [] if clients is None else [clients.digest, num_ids]
    path = cache_path("partitions", ".npz",
                      [labels.digest, num_partitions, args, version("flwr-datasets"),
                       version("datasets"), *natural], ["tasks.partition"])
    if path.is_file():
        with np.load(path) as f:
            return tuple(f[f"p{i}"] for i in range(num_partitions))
    parts = tuple(partition_indices(labels.array, num_partitions, args,
                                    num_classes=num_classes,
                                    clients=None if clients is None else clients.array,
                                    num_ids=num_ids))
    save_atomic(path, lambda tmp: np.savez(tmp, **{f"p{i}": p for i, p in enumerate(parts)}))
    return parts


class LabelsKey:
    """A label array that hashes by content (so :func:`cached_partitions` can be cached)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.asarray(array)
        self.digest = array_digest(self.array)

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LabelsKey) and other.digest == self.digest


def label_histogram(labels: np.ndarray, num_classes: int) -> list[int]:
    """Counts per class, as plain ints (JSON-ready)."""
    return np.bincount(np.asarray(labels), minlength=num_classes).astype(int).tolist()
