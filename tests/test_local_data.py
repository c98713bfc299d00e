"""A host's own data (``data-path``): the two layouts read as the run's dataset reads its
rows, every malformed input refused with what is expected, a federation of SuperNodes
serving their own files, and a real SuperNode that takes neither its data nor where it
writes from the server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from PIL import Image

import clients.app as client_app
from server.app import run_one
from tasks import local_data
from tasks.config import ConfigError, validate
from tasks.datasets import dataset_meta, load_dataset
from tasks.messages import NODE_RECORD
from tasks.results.ledger import read_ledger
from tasks.splits import own_split

from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)

MNIST = dataset_meta("mnist")


def _digits(n: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` training digits of every class (the embedded copy is sorted by class)."""
    data = load_dataset("mnist")
    rows = np.random.default_rng(0).permutation(len(data.y_train))[offset:offset + n]
    return data.x_train[rows], data.y_train[rows]


def _image_folder(root, x, y):
    for i, (img, label) in enumerate(zip(x, y, strict=True)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(root / str(label) / f"{i:04d}.png")
    return root


def test_npz_and_image_folder_are_read_as_the_dataset_reads_its_rows(tmp_path, monkeypatch):
    # a cache of its own: other tests on the same worker cache other hosts' data
    monkeypatch.setenv("FEDPRIV_CACHE", str(tmp_path / "cache"))
    x, y = _digits(40)
    np.savez(tmp_path / "own.npz", x=x, y=y)
    got_x, got_y = local_data.read_local_data(tmp_path / "own.npz", MNIST)
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)
    folder = _image_folder(tmp_path / "folder", x, y)
    fx, fy = local_data.read_local_data(folder, MNIST)
    order = np.lexsort((np.arange(len(y)), y))  # class folders in index order, files by name
    np.testing.assert_array_equal(fx, x[order])  # PNG is lossless
    np.testing.assert_array_equal(fy, y[order])
    assert "40 images in" in local_data.describe(folder)
    # decoded once (a SuperNode starts a ClientApp process per message), then from the cache
    assert len(list(Path(os.environ["FEDPRIV_CACHE"]).glob("local-data/*.npz"))) == 1
    cfg = validate({"dataset": "mnist"})
    split = own_split(cfg, str(tmp_path / "own.npz"))
    torch.testing.assert_close(split.x, load_dataset("mnist").to_tensor(x))
    assert split.label_counts() == np.bincount(y, minlength=10).tolist()


def test_rgb_images_become_grayscale_for_a_one_channel_dataset(tmp_path):
    x, y = _digits(3)
    (tmp_path / "d" / "7").mkdir(parents=True)
    Image.fromarray(np.stack([x[0]] * 3, axis=-1)).save(tmp_path / "d" / "7" / "a.png")
    got, labels = local_data.read_local_data(tmp_path / "d", MNIST)
    assert got.shape == (1, 28, 28) and labels.tolist() == [7]
    np.testing.assert_array_equal(got[0], x[0])


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "absent", "does not exist on this host"),
    (lambda p: (p / "a.csv").write_text("1,2") and p / "a.csv", "not an .npz file"),
    (lambda p: np.savez(p / "a.npz", x=_digits(5)[0]) or p / "a.npz", "no array y"),
    (lambda p: np.savez(p / "a.npz", x=np.zeros((5, 32, 32), np.uint8),
                        y=np.zeros(5, np.int64)) or p / "a.npz", r"needs \(N, 28, 28\)"),
    (lambda p: np.savez(p / "a.npz", x=np.zeros((5, 28, 28)), y=np.zeros(5, np.int64))
     or p / "a.npz", "images are uint8"),
    (lambda p: np.savez(p / "a.npz", x=np.zeros((5, 28, 28), np.uint8),
                        y=np.arange(5) + 8) or p / "a.npz", r"class indices 0\.\.9"),
    (lambda p: np.savez(p / "a.npz", x=np.zeros((5, 28, 28), np.uint8),
                        y=np.zeros(4, np.int64)) or p / "a.npz", "one label per row"),
    (lambda p: (p / "a.npz").write_bytes(b"junk") and p / "a.npz", "not a readable .npz"),
    (lambda p: (p / "d" / "cats").mkdir(parents=True) or p / "d", "named by class index"),
    (lambda p: (p / "d" / "0").mkdir(parents=True) or p / "d", "no image files"),
    (lambda p: (p / "d" / "0").mkdir(parents=True)
     or Image.fromarray(np.zeros((32, 32), np.uint8)).save(p / "d" / "0" / "a.png")
     or p / "d", "32x32 pixels; mnist images are 28x28"),
    (lambda p: [(p / "d" / "0").mkdir(parents=True),
                (p / "d" / "0" / "a.png").write_bytes(b"not a png")] and p / "d",
     "cannot be read as an image"),
])
def test_malformed_data_is_refused_with_what_is_expected(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        local_data.read_local_data(path, MNIST)
    assert "ImageFolder layout" in str(err.value)


def test_tabular_and_embedding_runs_state_what_a_host_may_give(tmp_path):
    with pytest.raises(ConfigError, match="tabular: give an .npz file"):
        _image_folder(tmp_path / "d", *_digits(2))
        local_data.read_local_data(tmp_path / "d", dataset_meta("breast-cancer"))
    rows = np.random.default_rng(0).normal(size=(6, 30)).astype(np.float32)
    np.savez(tmp_path / "t.npz", x=rows, y=np.array([0, 1] * 3))
    x, y = local_data.read_local_data(tmp_path / "t.npz", dataset_meta("breast-cancer"))
    np.testing.assert_array_equal(x, rows)
    with pytest.raises(ConfigError, match="features = 'embeddings' needs the backbone"):
        own_split(validate({"features": "embeddings"}), str(tmp_path / "t.npz"))


def _ctx(cfg, node_config):
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(),
                   run_config=cfg.flat())


def test_supernodes_serving_their_own_files_train_a_federation(tmp_path,
                                                               _task_identity):  # noqa: F811
    """Two hosts, each with its own .npz of digits nobody else holds; the server learns
    each one's size from its reply and records that it was the host's own data."""
    cfg = validate({"num-clients": 2, "num-server-rounds": 3, "local-epochs": 2,
                    "save-model": False, "run-dir": str(tmp_path / "run")})
    sizes = {0: 600, 1: 400}
    for pid, n in sizes.items():
        x, y = _digits(n, offset=1000 * pid)
        np.savez(tmp_path / f"host-{pid}.npz", x=x, y=y)
    grid = InProcessGrid(cfg, node_config=lambda pid: {
        "data-path": str(tmp_path / f"host-{pid}.npz")})
    run_one(grid, _ctx(cfg, {}), cfg)
    clients = json.loads((tmp_path / "run" / "partitions.json").read_text())["clients"]
    assert [(c["num-examples"], c["own-data"]) for c in clients] == [(600, True), (400, True)]
    ledger = read_ledger(tmp_path / "run")
    assert [r.round for r in ledger] == [1, 2, 3]
    assert {c["partition-id"]: c["num-examples"] for c in ledger[-1].clients} == sizes
    assert ledger[-1].test["accuracy"] > 0.5  # it learned from the hosts' own digits


def test_a_real_supernode_ignores_the_servers_partition_and_state_folder(
        tmp_path, _task_identity):  # noqa: F811
    """Only a simulated node (a Flower Ray worker) is told what to serve and where to write;
    a SuperNode's host decides both (no Ray in this process: a real SuperNode's view)."""
    assert not client_app.in_simulation()
    cfg = validate({"num-clients": 3, "dp": "local"})
    np.savez(tmp_path / "own.npz", x=_digits(20)[0], y=_digits(20)[1])
    msg = Message(RecordDict({"config": ConfigRecord({}),
                              NODE_RECORD: ConfigRecord({"partition-id": 2, "num-partitions": 3,
                                                         "state-dir": str(tmp_path / "evil")})}),
                  message_type=MessageType.QUERY, dst_node_id=7)
    host = {"partition-id": 0, "num-partitions": 3, "data-path": str(tmp_path / "own.npz")}
    metrics = client_app.app(msg, _ctx(cfg, host)).content["metrics"]
    assert (metrics["partition-id"], metrics["own-data"], metrics["keeps-state"],
            metrics["num-examples"]) == (0, 1, 0, 20)
    assert not (tmp_path / "evil").exists()
