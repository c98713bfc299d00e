"""A host's own data: what a SuperNode started with ``data-path`` trains on.

A hospital's SuperNode serves records no other host has (``--node-config
"data-path=..."``, or ``fedpriv deploy supernode --data-path``); the ClientApp reads them,
the server never sees them. Two layouts are read:

* an ``.npz`` file with arrays ``x`` and ``y``: images as uint8 ``(N, H, W)`` (one
  channel) or ``(N, H, W, C)``, or tabular rows as floats ``(N, D)`` already scaled as
  the run's dataset is; ``y`` holds class indices ``0..K-1``;
* a folder in torchvision's ``ImageFolder`` layout, ``<data-path>/<class>/<image>``,
  whose class folders are named by class index (``0``, ``1``, ... ``K-1``; a host may
  lack some classes). Images are read with PIL, converted to the dataset's channels
  (grayscale or RGB), and must already have its size. The decoded arrays are cached (keyed
  by every file's name, size and modification time), since a SuperNode starts a new
  ClientApp process for each message.

The run's dataset (``dataset``) fixes what the rows must look like
(:class:`tasks.datasets.DatasetMeta`: shape, classes, normalization); the dataset itself
is not needed on the host. ``fedpriv deploy supernode`` does not know the run's dataset
when it starts, so :func:`describe` reads everything (every image decoded) and refuses
data that fits none of the registered datasets; the run's first message then checks it
against the run's own (:func:`read_local_data`).
"""

from __future__ import annotations

import zipfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .cache import cache_path, save_atomic
from .datasets import DatasetMeta, dataset_meta
from .errors import ConfigError
from .registry import DATASETS

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".pgm", ".ppm", ".tif", ".tiff", ".webp")
FORMAT = ("an .npz file with arrays x and y, or a folder <data-path>/<class index>/<image "
          "files> (torchvision's ImageFolder layout, class folders named 0..K-1)")


def _error(path: Path, what: str) -> ConfigError:
    return ConfigError(f"data-path {str(path)!r}: {what}. A host's own data is {FORMAT}; see "
                       "README 'A host's own data'.")


class _Mismatch(ConfigError):
    """Readable data that does not fit one dataset (another may take it)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(str(_error(path, why)))
        self.why = why


def _class_folders(path: Path) -> dict[int, list[Path]]:
    """Each class index's image files (sorted), checking the folder layout."""
    folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    bad = [p.name for p in folders if not p.name.isdigit()]
    if not folders or bad:
        raise _error(path, f"class folders must be named by class index; found "
                     f"{', '.join(bad[:5]) if bad else 'no class folders'}")
    files = {int(p.name): sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
             for p in folders}
    if not any(files.values()):
        raise _error(path, f"no image files ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    return files


def describe(path: str | Path) -> str:
    """A one-line description of the data at ``path``, read in full (every image decoded)
    and checked against every registered dataset: what ``fedpriv deploy supernode`` prints
    before it starts. ConfigError (what is wrong, what is expected) when it is unreadable
    or fits none of them: the host can fix it before its node joins a run."""
    path = _existing(path)
    if path.is_file():
        x, y = _read_npz(path)
        if len(y) == 0 or x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
            raise _error(path, f"x {tuple(x.shape)} and y {tuple(y.shape)} are not N examples "
                         "with N labels (N > 0): x must be (N, ...) and y (N,)")
        if not np.issubdtype(y.dtype, np.integer) or (y < 0).any():
            raise _error(path, f"the labels y ({y.dtype}) must be class indices 0, 1, ...")
        fits = _fitting(path, lambda meta: _mismatch(x, y, meta, named=False))
        counts = Counter(int(v) for v in y)
        return (f"{len(y):,} examples of shape {tuple(x.shape[1:])} ({x.dtype}) in {path.name}; "
                f"labels {dict(sorted(counts.items()))}; fits {', '.join(fits)}")
    files = _class_folders(path)

    def decoded(meta: DatasetMeta) -> str | None:
        if meta.kind != "image":
            return "tabular: it needs an .npz file of float rows, not a folder of images"
        try:
            return _mismatch(*_read_folder(path, meta), meta, named=False)
        except _Mismatch as exc:
            return exc.why

    fits = _fitting(path, decoded)
    return (f"{sum(len(v) for v in files.values()):,} images in {len(files)} class folders; "
            f"per class {({k: len(v) for k, v in files.items()})}; fits {', '.join(fits)}")


def _fitting(path: Path, mismatch: Callable[[DatasetMeta], str | None]) -> list[str]:
    """The registered datasets the data fits; ConfigError saying what each needs (those that
    need the same, together) when it fits none."""
    fits: list[str] = []
    why: dict[str, list[str]] = {}
    for name in DATASETS.names:
        reason = mismatch(dataset_meta(name))
        if reason is None:
            fits.append(name)
        else:
            why.setdefault(reason, []).append(name)
    if not fits:
        raise _error(path, "fits none of the datasets a run can use (" + "; ".join(
            f"{', '.join(names)}: {reason}" for reason, names in why.items()) + ")")
    return fits


def _mismatch(x: np.ndarray, y: np.ndarray, meta: DatasetMeta, named: bool = True
              ) -> str | None:
    """Why rows ``x`` with labels ``y`` do not fit the dataset ``meta`` (None: they do);
    ``named``: the reason names the dataset."""
    want, name = meta.raw_shape(), f"{meta.name} " if named else ""
    if x.ndim < 2 or tuple(x.shape[1:]) != want:
        return (f"x has shape {tuple(x.shape)}; {name or 'it '}needs (N, "
                f"{', '.join(map(str, want))})")
    if meta.kind == "image" and x.dtype != np.uint8:
        return f"x is {x.dtype}; images are uint8 pixels 0-255"
    if meta.kind == "tabular" and not np.issubdtype(x.dtype, np.floating):
        return f"x is {x.dtype}; tabular rows are floats"
    if y.ndim != 1 or len(y) != len(x) or not len(y):
        return f"y has shape {tuple(y.shape)}; it needs one label per row of x ({len(x)})"
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= meta.num_classes:
        return (f"labels must be class indices 0..{meta.num_classes - 1}"
                f"{' for ' + meta.name if named else ''}; found {y.dtype} from {y.min()} to "
                f"{y.max()}")
    if meta.kind == "tabular" and not np.isfinite(x).all():
        return "x has NaN or infinite values"
    return None


def _existing(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise _error(path, "does not exist on this host")
    if path.is_file() and path.suffix != ".npz":
        raise _error(path, f"a file, but not an .npz file ({path.suffix or 'no suffix'})")
    return path


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise _error(path, f"the .npz file has no array {' or '.join(missing)} (it has "
                             f"{', '.join(f.files) or 'none'})")
            return f["x"], f["y"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise _error(path, f"not a readable .npz file ({type(exc).__name__}: {exc})") from None


def _read_folder(path: Path, meta: DatasetMeta) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    files = _class_folders(path)
    stamp = [(str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns)
             for v in files.values() for f in v]
    mode = "L" if meta.input_shape[0] == 1 else "RGB"
    cached = cache_path("local-data", ".npz", [str(path.resolve()), mode, stamp],
                        ["tasks.local_data"])
    if cached.is_file():
        with np.load(cached) as f:
            return f["x"], f["y"]
    want = meta.raw_shape()[:2]
    xs, ys = [], []
    for label, images in files.items():
        for image in images:
            try:
                with Image.open(image) as img:
                    pixels = np.asarray(img.convert(mode), dtype=np.uint8)
            except (OSError, UnidentifiedImageError) as exc:
                raise _error(path, f"{image} cannot be read as an image ({exc})") from None
            if pixels.shape[:2] != want:
                raise _Mismatch(path, f"{image} is {pixels.shape[1]}x{pixels.shape[0]} pixels; "
                                f"{meta.name} images are {want[1]}x{want[0]}: resize them "
                                "first")
            xs.append(pixels)
            ys.append(label)
    x, y = np.stack(xs), np.asarray(ys, dtype=np.int64)
    save_atomic(cached, lambda tmp: np.savez(tmp, x=x, y=y))
    return x, y


def read_local_data(path: str | Path, meta: DatasetMeta) -> tuple[np.ndarray, np.ndarray]:
    """The host's rows as the dataset ``meta`` stores them (uint8 images or float rows) and
    their labels; ConfigError saying what is wrong and what is expected otherwise."""
    path = _existing(path)
    if path.is_dir():
        if meta.kind != "image":
            raise _error(path, f"{meta.name} is tabular: give an .npz file, not a folder")
        x, y = _read_folder(path, meta)
    else:
        x, y = _read_npz(path)
    why = _mismatch(x, y, meta)
    if why is not None:
        raise _error(path, why)
    return x, y.astype(np.int64)
