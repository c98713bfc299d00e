"""Shared test helpers: small on-disk datasets in the real formats, and the CLI as a subprocess."""

from __future__ import annotations

import gzip
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

# One math thread in every test process and every process a test starts (the attack
# stage, the ServerApp, pre-flight checks; simulated clients already use client-threads =
# 1): the suite runs in several pytest-xdist workers on 2 cores, where more threads per
# process only make them wait for each other. Set before numpy or torch is imported.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

# A shell without job control starts a background command with Ctrl-C (SIGINT) ignored,
# and every process it starts inherits that: a Python child then never turns SIGINT into
# KeyboardInterrupt. The tests that press Ctrl-C on a run (their own process or a `fedpriv`
# child) need what a terminal gives, however the suite itself was started.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> Path:
    """Write an IDX file (MNIST's format) for a uint8 array."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape)
    data = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def write_mnist_like(raw: Path, n_train: int, n_test: int, seed: int = 0,
                     compress: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for name, arr in arrays.items():
        write_idx(raw / name, arr, compress)
    return arrays


def write_cifar_batch(path: Path, images_nchw: np.ndarray, labels: np.ndarray,
                      label_key: str) -> None:
    """Write one CIFAR python pickle: 'data' rows are R(1024) G(1024) B(1024)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"data": images_nchw.reshape(len(images_nchw), -1).astype(np.uint8),
             label_key: [int(v) for v in labels], "batch_label": "test batch"}
    with open(path, "wb") as f:
        pickle.dump(entry, f)


def write_cifar_meta(path: Path, key: str, classes: int) -> None:
    """CIFAR's meta pickle (class names), which torchvision reads too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({key: [f"class{i}" for i in range(classes)]}, f)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory):
    """Every test (and every process a test starts) uses a temporary cache, never the
    user's: a stale entry there must not be able to make a test pass."""
    saved = os.environ.get("FEDPRIV_CACHE")
    os.environ["FEDPRIV_CACHE"] = str(tmp_path_factory.mktemp("fedpriv-cache"))
    yield
    if saved is None:
        os.environ.pop("FEDPRIV_CACHE", None)
    else:
        os.environ["FEDPRIV_CACHE"] = saved


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `fedpriv ARGS` as a user would, in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "experiments.cli", *args], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def only_run(results: Path) -> Path:
    """The one run directory a single run wrote under ``results``."""
    runs = [p for p in results.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def fresh_epsilon(history, delta: float, kind: str = "rdp",
                  relation: str = "add-remove") -> float:
    """Epsilon of a fresh accountant given a whole history of (noise multiplier, sample
    rate, steps) entries: the reference the ledgers must match. ``pld``: dp-accounting's
    PLD accountant, each entry one self-composed event (built here, apart from fedpriv's
    code); ``rdp``/``prv``: Opacus'."""
    if kind == "pld":
        import dp_accounting as dpa
        from dp_accounting.pld import PLDAccountant

        rel = (dpa.NeighboringRelation.ADD_OR_REMOVE_ONE if relation == "add-remove"
               else dpa.NeighboringRelation.REPLACE_ONE)
        acc = PLDAccountant(rel)
        acc.compose(dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)) if q < 1
            else dpa.GaussianDpEvent(s), n) for s, q, n in history]))
        return acc.get_epsilon(delta)
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = RDPAccountant() if kind == "rdp" else PRVAccountant()
    acc.history = list(history)
    return acc.get_epsilon(delta)


@pytest.fixture
def results(tmp_path: Path) -> Path:
    path = tmp_path / "results"
    return path


def ledger_json(run_dir: Path) -> list[dict]:
    """A run's ledger as the JSON objects of metrics.jsonl (dashed keys)."""
    from tasks.results.ledger import read_ledger

    return [r.to_json() for r in read_ledger(run_dir)]


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test starts with the handlers the one before it found: a test that runs the
    CLI in-process (which installs its SIGTERM handler) cannot change how the next one
    reacts to Ctrl-C or SIGTERM."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The end-to-end runs first: spread over the workers (scripts/test.sh runs pytest-xdist)
    the long ones start at once and the quick ones fill the gaps, instead of one long run
    left alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
