"""FEMNIST and Shakespeare from a researcher's own files: LEAF's JSON and Flower's Hugging Face
copies (parquet, CSV), written here small in exactly those formats; the held-out users are
the server's, each client's own test rows are its own, and damaged files are named."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tasks import leaf_files as lf
from tasks import shakespeare as shk
from tasks.errors import ConfigError

WRITERS = [f"f{i:04d}_{10 + i % 7:02d}" for i in range(10)]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A private cache, and a network that fails the test if anything reaches for it."""
    import huggingface_hub

    monkeypatch.setenv("FEDPRIV_CACHE", str(tmp_path / "cache"))

    def offline(*args, **kwargs):
        raise AssertionError(f"snapshot_download called without download = true: {kwargs}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)


# --------------------------------------------------------------------------- writing files


def glyph(rng: np.random.Generator, white: bool = True) -> np.ndarray:
    """A 28x28 uint8 'character': a background (255 on NIST's white paper, else 0) with a
    random stroke."""
    ink = np.zeros((28, 28), dtype=np.uint8)
    r, c = rng.integers(4, 20, 2)
    ink[r:r + 6, c:c + rng.integers(2, 6)] = rng.integers(120, 256, (6, 1), dtype=np.uint8)
    ink[rng.integers(3, 25, 8), rng.integers(3, 25, 8)] = rng.integers(1, 256, 8)
    return (255 - ink) if white else ink


def femnist_samples(per_writer: int, seed: int = 0, white: bool = True):
    """{writer: (gray images, labels)}, labels covering 0 and 61."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, w in enumerate(WRITERS):
        imgs = np.stack([glyph(rng, white) for _ in range(per_writer)])
        labels = (np.arange(per_writer) * 7 + i * 13) % 62
        labels[0] = 61 if i % 2 else 0
        out[w] = (imgs, labels)
    return out


def leaf_file(path: Path, users: dict[str, tuple[list, list]], **extra) -> Path:
    """A LEAF JSON file with LEAF's keys (users, num_samples, user_data{x, y})."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}, **extra}
    path.write_text(json.dumps(data))
    return path


def write_leaf_femnist(root: Path, samples, n_train: int = 5) -> dict:
    """LEAF's femnist/data/{train,test}: x = gray/255 per pixel (white background 1.0), two
    files per split, the first n_train samples of each writer to train."""
    expected = {}
    halves = [WRITERS[:5], WRITERS[5:]]
    for which, rows in (("train", slice(0, n_train)), ("test", slice(n_train, None))):
        for k, group in enumerate(halves):
            users = {}
            for w in group:
                imgs, labels = samples[w]
                users[w] = ((imgs[rows].reshape(-1, 784) / 255).tolist(),
                            labels[rows].tolist())
                for img, y in zip(imgs[rows], labels[rows], strict=True):
                    expected[(255 - img).tobytes()] = (w, which, int(y))
            leaf_file(root / which / f"all_data_{k}_niid_1_keep_0_{which}_8.json", users)
    return expected


def png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img, mode="L").save(buf, format="PNG")
    return buf.getvalue()


IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def femnist_table(rows: list[tuple[str, np.ndarray, int]], drop: str = "") -> pa.Table:
    """flwrlabs/femnist's columns: image (Hugging Face Image: PNG bytes), writer_id, hsf_id,
    character (class label 0-61)."""
    cols = {"image": pa.array([{"bytes": png(img), "path": None} for _, img, _ in rows],
                              type=IMAGE_TYPE),
            "writer_id": pa.array([w for w, _, _ in rows], type=pa.string()),
            "hsf_id": pa.array([4] * len(rows), type=pa.int64()),
            "character": pa.array([y for _, _, y in rows], type=pa.int64())}
    return pa.table({k: v for k, v in cols.items() if k != drop})


def write_flwr_femnist(root: Path, samples) -> list[tuple[str, np.ndarray, int]]:
    """Two parquet files as huggingface-cli leaves them (data/train-0000k-of-00002.parquet),
    and a stray file in its hidden .cache folder."""
    rows = [(w, img, int(y)) for w in WRITERS for img, y in zip(*samples[w], strict=True)]
    folder = root / "flwrlabs" / "femnist" / "data"
    folder.mkdir(parents=True)
    half = len(rows) // 2 + 3  # a writer across both files
    pq.write_table(femnist_table(rows[:half]), folder / "train-00000-of-00002.parquet")
    pq.write_table(femnist_table(rows[half:]), folder / "train-00001-of-00002.parquet")
    hidden = root / "flwrlabs" / "femnist" / ".cache" / "huggingface" / "x.parquet"
    hidden.parent.mkdir(parents=True)
    hidden.write_bytes(b"not a parquet file")
    return rows


def role_text(rng: np.random.Generator, role: int, n: int, newlines: bool = False) -> str:
    """A speech of n + 80 characters in LEAF's vocabulary, distinct per role."""
    words = ["thou", "art", "my", "lord", "Kent!", "good", "night,", "sweet", "prince;",
             f"R{role}x", "(aside)", "'tis", "2", "mad?"]
    out = ""
    while len(out) < n + 80:
        out += str(rng.choice(words)) + ("\n" if newlines and rng.random() < 0.05 else " ")
    return out[:n + 80]


def windows(text: str) -> tuple[list[str], list[str]]:
    """LEAF's __txt_to_data: every 80 characters and the one after."""
    return ([text[i:i + 80] for i in range(len(text) - 80)],
            [text[i + 80] for i in range(len(text) - 80)])


def decode(rows: np.ndarray) -> list[str]:
    return ["".join(shk.VOCABULARY[i] for i in r) for r in np.asarray(rows)]


def chars(y: np.ndarray) -> str:
    return "".join(shk.VOCABULARY[i] for i in y)


ROLES = [f"THE_TRAGEDY_OF_KING_LEAR_ROLE{i:02d}" for i in range(10)]


def write_leaf_shakespeare(root: Path, n: int = 420) -> dict[str, dict[str, list]]:
    """LEAF's shakespeare/data/{train,test}, split as its split_data.py does for
    Shakespeare: the first int(0.8 n) windows train, the test from 79 after them."""
    rng = np.random.default_rng(1)
    train, test, expected = {}, {}, {}
    for i, role in enumerate(ROLES):
        x, y = windows(role_text(rng, i, n + 10 * i))
        k = int(0.8 * len(x))
        train[role] = (x[:k], y[:k])
        test[role] = (x[k + 79:], y[k + 79:])
        expected[role] = {"train": train[role], "test": test[role]}
        assert len(test[role][0]) >= 5
    hier = {"hierarchies": ["THE_TRAGEDY_OF_KING_LEAR"] * len(ROLES)}
    leaf_file(root / "train" / "all_data_niid_0_keep_0_train_8.json", train, **hier)
    leaf_file(root / "test" / "all_data_niid_0_keep_0_test_8.json", test, **hier)
    return expected


def shakespeare_rows(rng: np.random.Generator) -> dict[str, tuple[list, list]]:
    """Roles of 420-510 windows (kept), one of 300 (no test rows once 79 are skipped) and
    one of 50 (not more than 64: dropped)."""
    out = {}
    for i, role in enumerate(ROLES):
        out[role] = windows(role_text(rng, i, 420 + 10 * i, newlines=True))
    out["AS_YOU_LIKE_IT_SHORT"] = windows(role_text(rng, 98, 300))
    out["AS_YOU_LIKE_IT_TINY"] = windows(role_text(rng, 99, 50))
    return out


def shakespeare_table(roles: dict[str, tuple[list, list]]) -> pa.Table:
    ids = [r for r, (x, _) in roles.items() for _ in x]
    return pa.table({"character_id": ids, "x": [s for x, _ in roles.values() for s in x],
                     "y": [s for _, y in roles.values() for s in y]})


# --------------------------------------------------------------------------- checks


def check_natural(bundle, all_users: set[str], held_count: int) -> set[str]:
    """Clients and held-out users partition the users; returns the held-out ones."""
    c = bundle.clients
    assert len(c.names) == len(set(c.names)) == len(all_users) - held_count
    assert set(c.names) <= all_users
    assert c.train.min() >= 0 and c.train.max() < len(c.names)
    assert len(c.train) == len(bundle.y_train) == len(bundle.x_train)
    assert len(c.test) == len(c.y_test) == len(c.x_test)
    return all_users - set(c.names)


def test_femnist_is_registered_as_a_natural_image_dataset():
    from tasks.datasets import dataset_meta
    from tasks.registry import DATASETS

    info = DATASETS.info("femnist")
    assert info.natural and info.kind == "image" and info.input_shape == (1, 28, 28)
    meta = dataset_meta("femnist")
    assert (meta.num_classes, meta.input_shape, meta.kind) == (62, (1, 28, 28), "image")
    assert 0 < meta.mean[0] < 0.5 and 0 < meta.std[0] < 1  # ink bright: a dark mean


@pytest.mark.parametrize("layout", ["leaf/femnist/data", "leaf/data/femnist/data",
                                    "femnist/data"])
def test_femnist_from_leaf_json_reads_rows_labels_and_writers_back(tmp_path, layout):
    from tasks.registry import DATASETS

    expected = write_leaf_femnist(tmp_path / layout, femnist_samples(7))
    b = DATASETS.load("femnist").read(tmp_path, False)
    c = b.clients
    assert b.x_train.dtype == np.uint8 and b.x_train.shape[1:] == (28, 28)
    assert "LEAF's JSON" in b.source and str(tmp_path / layout) in b.source
    assert "inverted" in b.source
    held = check_natural(b, set(WRITERS), 1)
    seen = []
    for x, y, who in zip(b.x_train, b.y_train, c.train, strict=True):  # clients' train rows
        assert expected[x.tobytes()] == (c.names[who], "train", y)
        seen.append(x.tobytes())
    for x, y, who in zip(c.x_test, c.y_test, c.test, strict=True):  # their own test rows
        assert expected[x.tobytes()] == (c.names[who], "test", y)
        seen.append(x.tobytes())
    for x, y in zip(b.x_test, b.y_test, strict=True):  # the server's: held-out writers only
        w, _, label = expected[x.tobytes()]
        assert w in held and label == y
        seen.append(x.tobytes())
    assert sorted(seen) == sorted(expected)  # every image exactly once
    assert len(b.y_test) == 7 * len(held)
    assert np.bincount(c.train).tolist() == [5] * 9 and np.bincount(c.test).tolist() == [2] * 9
    # ink bright like MNIST: the background (border) is 0 after the inversion
    assert b.x_train[:, 0].max() == 0 and b.x_train.max() > 100


def test_femnist_from_flwrlabs_parquet_splits_each_writer_80_20(tmp_path):
    rows = write_flwr_femnist(tmp_path, femnist_samples(10, seed=3))
    expected = {(255 - img).tobytes(): (w, y) for w, img, y in rows}
    b = lf.load_femnist(tmp_path, False)
    c = b.clients
    assert "flwrlabs/femnist (2 .parquet file(s)" in b.source and "seed 0" in b.source
    held = check_natural(b, set(WRITERS), 1)
    for x, y, who in zip(b.x_train, b.y_train, c.train, strict=True):
        assert expected[x.tobytes()] == (c.names[who], y)
    for x, y, who in zip(c.x_test, c.y_test, c.test, strict=True):
        assert expected[x.tobytes()] == (c.names[who], y)
    assert {expected[x.tobytes()][0] for x in b.x_test} == held and len(b.y_test) == 10
    # LEAF's by-sample split: int(0.8 * 10) = 8 train, 2 test per writer, disjoint
    assert np.bincount(c.train).tolist() == [8] * 9 and np.bincount(c.test).tolist() == [2] * 9
    both = [x.tobytes() for x in (*b.x_train, *c.x_test, *b.x_test)]
    assert sorted(both) == sorted(expected)
    again = lf.load_femnist(tmp_path, False)  # from the cache: the same split
    assert np.array_equal(again.x_train, b.x_train) and again.clients.names == c.names
    assert list((tmp_path / "cache" / "datasets").glob("*.npz"))


def test_the_same_writers_are_held_out_from_json_and_from_parquet(tmp_path):
    samples = femnist_samples(10)
    write_leaf_femnist(tmp_path / "a" / "leaf" / "femnist" / "data", samples, n_train=8)
    write_flwr_femnist(tmp_path / "b", samples)
    a, b = lf.load_femnist(tmp_path / "a", False), lf.load_femnist(tmp_path / "b", False)
    assert a.clients.names == b.clients.names
    assert sorted(x.tobytes() for x in a.x_test) == sorted(x.tobytes() for x in b.x_test)


def test_images_already_ink_bright_are_kept_as_stored(tmp_path):
    rows = write_flwr_femnist(tmp_path, femnist_samples(4, white=False))
    b = lf.load_femnist(tmp_path, False)
    stored = {img.tobytes() for _, img, _ in rows}
    assert all(x.tobytes() in stored for x in b.x_train) and "as stored" in b.source


def test_leaf_json_is_preferred_when_both_formats_are_there(tmp_path):
    samples = femnist_samples(10)
    write_leaf_femnist(tmp_path / "leaf" / "femnist" / "data", samples, n_train=8)
    write_flwr_femnist(tmp_path, samples)
    assert "LEAF's JSON" in lf.load_femnist(tmp_path, False).source


def test_shakespeare_prefers_leaf_json_in_data_dir(tmp_path):
    expected = write_leaf_shakespeare(tmp_path / "leaf" / "shakespeare" / "data")
    b = lf.load_shakespeare_any(tmp_path, False)
    c = b.clients
    assert b.meta is shk.SHAKESPEARE_META and "LEAF's JSON" in b.source
    held = check_natural(b, set(ROLES), 1)
    for i, name in enumerate(c.names):
        mine = c.train == i
        assert decode(b.x_train[np.flatnonzero(mine)]) == expected[name]["train"][0]
        assert chars(b.y_train[mine]) == "".join(expected[name]["train"][1])
        own = c.test == i
        assert decode(c.x_test[np.flatnonzero(own)]) == expected[name]["test"][0]
        assert chars(c.y_test[own]) == "".join(expected[name]["test"][1])
    server = sorted(zip(decode(b.x_test), chars(b.y_test), strict=True))
    want = sorted((x, y) for r in held for part in ("train", "test")
                  for x, y in zip(*expected[r][part], strict=True))
    assert server == want  # all the held-out role's text, and nothing else
    # consecutive windows share one buffer: about one character per row
    assert len(b.x_train.buffer) < 2 * len(b.y_train)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_shakespeare_from_flwrlabs_files_splits_each_role_in_text_order(tmp_path, fmt):
    roles = shakespeare_rows(np.random.default_rng(2))
    folder = tmp_path / "flwrlabs" / "shakespeare"
    folder.mkdir(parents=True)
    table = shakespeare_table(roles)
    if fmt == "csv":  # the repository's own shakespeare.csv
        pcsv.write_csv(table, folder / "shakespeare.csv")
    else:  # its parquet conversion
        pq.write_table(table, folder / "0000.parquet")
    b = lf.load_shakespeare_any(tmp_path, False)
    c = b.clients
    assert f"flwrlabs/shakespeare (1 .{fmt} file(s)" in b.source
    held = check_natural(b, set(ROLES), 1)  # the SHORT and TINY roles are dropped
    for i, name in enumerate(c.names):
        x, y = roles[name]
        k = int(0.8 * len(x))
        assert decode(b.x_train[np.flatnonzero(c.train == i)]) == x[:k]
        assert chars(b.y_train[c.train == i]) == "".join(y[:k])
        assert decode(c.x_test[np.flatnonzero(c.test == i)]) == x[k + 79:]
        assert chars(c.y_test[c.test == i]) == "".join(y[k + 79:])
    (role,) = held
    assert sorted(decode(b.x_test)) == sorted(roles[role][0])


def test_shakespeare_without_files_is_built_from_the_package(tmp_path, monkeypatch):
    class Built(Exception):
        pass

    def package(data_dir):
        raise Built(data_dir)

    monkeypatch.setattr(shk, "archive_path", package)
    (tmp_path / "flwrlabs" / "shakespeare").mkdir(parents=True)  # nothing in it
    for data_dir in (tmp_path, None):
        with pytest.raises(Built):
            lf.load_shakespeare_any(data_dir, False)


# --------------------------------------------------------------------------- absent, download


def test_missing_femnist_names_the_layouts_and_never_downloads(tmp_path):
    with pytest.raises(ConfigError) as err:
        lf.load_femnist(tmp_path, False)
    msg = str(err.value)
    assert str(tmp_path / "leaf" / "femnist" / "data") + "/{train,test}/*.json" in msg
    assert str(tmp_path / "flwrlabs" / "femnist") in msg and "download = true" in msg
    with pytest.raises(ConfigError, match="needs a data-dir"):
        lf.load_femnist(None, False)


def test_download_fetches_flwrlabs_femnist_and_reads_it(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake(repo_id, repo_type, local_dir):
        calls.append((repo_id, repo_type, local_dir))
        write_flwr_femnist(Path(local_dir).parent.parent, femnist_samples(5))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    b = lf.load_femnist(tmp_path, True)
    assert calls == [("flwrlabs/femnist", "dataset", str(tmp_path / "flwrlabs" / "femnist"))]
    assert len(b.clients.names) == 9


def test_a_failed_download_says_so_and_leaves_no_folders(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError, match="no internet access") as err:
        lf.load_femnist(tmp_path, True)
    assert "flwrlabs/femnist" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "flwrlabs").exists()


# --------------------------------------------------------------------------- damaged files


def _femnist_json(tmp_path: Path) -> Path:
    write_leaf_femnist(tmp_path / "leaf" / "femnist" / "data", femnist_samples(7))
    return tmp_path / "leaf" / "femnist" / "data" / "train" / \
        "all_data_1_niid_1_keep_0_train_8.json"


def _edit(path: Path, change) -> Path:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


def truncated(tmp_path):
    path = _femnist_json(tmp_path)
    path.write_bytes(path.read_bytes()[:5000])
    return path, "not valid JSON"


def missing_user(tmp_path):
    return _edit(_femnist_json(tmp_path), lambda d: d["user_data"].pop(WRITERS[6])), \
        f"user {WRITERS[6]!r} in users, but user_data has no entry"


def x_y_differ(tmp_path):
    return _edit(_femnist_json(tmp_path),
                 lambda d: d["user_data"][WRITERS[7]]["y"].pop()), "5 x but 4 y"


def short_x(tmp_path):
    return _edit(_femnist_json(tmp_path),
                 lambda d: d["user_data"][WRITERS[8]]["x"][2].pop()), "x of 783 values"


def label_62(tmp_path):
    def change(d):
        d["user_data"][WRITERS[9]]["y"][3] = 62
    return _edit(_femnist_json(tmp_path), change), "label 62"


def pixel_above_1(tmp_path):
    def change(d):
        d["user_data"][WRITERS[5]]["x"][0][10] = 255
    return _edit(_femnist_json(tmp_path), change), "outside 0-1"


def not_leaf(tmp_path):
    path = _femnist_json(tmp_path)
    path.write_text(json.dumps({"images": []}))
    return path, "not a LEAF data file"


def users_differ(tmp_path):
    return _edit(_femnist_json(tmp_path), lambda d: (
        d["users"].append("f9999_99"), d["num_samples"].append(1),
        d["user_data"].__setitem__("f9999_99", {"x": [[1.0] * 784], "y": [3]}))), \
        "'f9999_99'"


def twice(tmp_path):
    path = _femnist_json(tmp_path)
    copy = path.with_name("all_data_1_niid_05_keep_0_train_8.json")
    copy.write_text(path.read_text())
    return copy, "two LEAF preprocessing runs"


def no_test_folder(tmp_path):
    path = _femnist_json(tmp_path)
    test = path.parent.parent / "test"
    for f in test.iterdir():
        f.unlink()
    return test, "holds none"


def _parquet(tmp_path: Path, rows=None, **kw) -> Path:
    samples = femnist_samples(4)
    rows = rows or [(w, img, int(y)) for w in WRITERS for img, y in zip(*samples[w],
                                                                         strict=True)]
    path = tmp_path / "flwrlabs" / "femnist" / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(femnist_table(rows, **kw), path)
    return path


def parquet_without_writer(tmp_path):
    return _parquet(tmp_path, drop="writer_id"), "no column writer_id"


def parquet_label_out_of_range(tmp_path):
    rng = np.random.default_rng(0)
    return _parquet(tmp_path, [(w, glyph(rng), 62 if w == WRITERS[3] else 1)
                               for w in WRITERS for _ in range(3)]), "label 62 (row 9)"


def parquet_truncated(tmp_path):
    path = _parquet(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    return path, "cannot be read as a table"


def parquet_big_image(tmp_path):
    rng = np.random.default_rng(0)
    rows = [(w, glyph(rng), 1) for w in WRITERS for _ in range(3)]
    rows[4] = (rows[4][0], np.zeros((32, 32), dtype=np.uint8), 1)
    return _parquet(tmp_path, rows), "32x32 image (row 4)"


def shakespeare_short_x(tmp_path):
    root = tmp_path / "shakespeare" / "data"
    write_leaf_shakespeare(root)
    path = root / "test" / "all_data_niid_0_keep_0_test_8.json"

    def change(d):
        d["user_data"][ROLES[4]]["x"][1] = d["user_data"][ROLES[4]]["x"][1][1:]
    return _edit(path, change), "x of 79 characters"


def shakespeare_csv_long_y(tmp_path):
    roles = shakespeare_rows(np.random.default_rng(2))
    roles[ROLES[0]][1][7] = "ab"
    path = tmp_path / "flwrlabs" / "shakespeare" / "shakespeare.csv"
    path.parent.mkdir(parents=True)
    pcsv.write_csv(shakespeare_table(roles), path)
    return path, "y of 2 characters (row 7)"


def shakespeare_parquet_without_y(tmp_path):
    path = tmp_path / "flwrlabs" / "shakespeare" / "0000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(shakespeare_table(shakespeare_rows(np.random.default_rng(2))).drop(["y"]),
                   path)
    return path, "no column y"


@pytest.mark.parametrize("damage", [
    truncated, missing_user, x_y_differ, short_x, label_62, pixel_above_1, not_leaf,
    users_differ, twice, no_test_folder, parquet_without_writer, parquet_label_out_of_range,
    parquet_truncated, parquet_big_image, shakespeare_short_x, shakespeare_csv_long_y,
    shakespeare_parquet_without_y])
def test_a_damaged_file_is_named_in_one_paragraph(tmp_path, damage):
    path, says = damage(tmp_path)
    read = lf.load_shakespeare_any if "shakespeare" in damage.__name__ else lf.load_femnist
    with pytest.raises(ConfigError) as err:
        read(tmp_path, False)
    msg = str(err.value)
    assert str(path) in msg and says in msg, msg
    assert "\n" not in msg and msg.count(str(path)) == 1
