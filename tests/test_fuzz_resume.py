"""Damaged and unusual inputs of ``fedpriv run --resume``, ``fedpriv attack`` and ``fedpriv
deploy supernode``, refused before any work (exit code 2, one paragraph naming the file,
what is wrong and what to do, no traceback), and a seeded fuzz of them in the style of
tests/test_fuzz_files.py.

The commands run in-process through the real entry point; a guard raises where they would
start a process, reopen a run or attack (``Reached``). A full disk and a read-only folder
are made in-process: every file opened for writing under the folder gets /dev/full (each
write fails with ENOSPC, as on a full disk) or EROFS, as a read-only mount answers.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import random
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from PIL import Image

import experiments.api
import experiments.deploy.supernode
import experiments.leakage.attack
from clients import local_dp, state_store
from experiments.cli import main as cli
from experiments.deploy.supernode import node_config_value, supernode_command
from server import client_state
from server.checkpoint import FOLDER, SERVER_FILE, Checkpoint, refuse_resume_key
from tasks.config import ConfigError, validate
from tasks.results.ledger import read_ledger

from .test_fuzz import guarded  # noqa: F401  (fixture)
from .test_fuzz_files import (
    Reached,
    _outcome,
    _reached,
    _server_identity,
    _snapshot,
    before_work,  # noqa: F401  (fixture)
)
from .test_leakage import observed_run
from .test_resume import BASE, LostReplies, _context

SEED = 20261128
FULL = "/dev/full"  # every write to it fails with ENOSPC, as on a full disk
ODD = "rün ü é/crashed run ñ"  # a path with spaces and non-ASCII characters


# --- folders the commands read ---------------------------------------------------------------

@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    """A local-DP run of 2 clients that crashed in round 2 after both clients trained it
    (checkpoint of round 1; each client's state file holds its DP-SGD ledger)."""
    from server.app import run_one

    path = tmp_path_factory.mktemp("resume") / "crashed"
    cfg = validate({**BASE, "num-clients": 2, "num-server-rounds": 2, "fraction-train": 1.0,
                    "dp": "local", "run-id": "fuzz-resume", "run-dir": str(path)})
    with _server_identity(), pytest.raises(ConnectionError):
        run_one(LostReplies(cfg, 2), _context(cfg), cfg)
    assert Checkpoint.load(path).round == 1
    assert len(_states(path)) == 2
    return path


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Path:
    """A finished run whose server kept one observation (label attacks only: fast)."""
    path = tmp_path_factory.mktemp("attack") / "observed"
    with _server_identity():
        observed_run(path, {"leakage-rounds": "1", "observed-examples": 2, "attacks": "labels"})
    return path


def _states(run: Path) -> list[Path]:
    return sorted((run / FOLDER / "clients").rglob("partition-*.state"))


def _copy(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target, symlinks=True)
    return target


# --- damages -----------------------------------------------------------------------------------

def _rewrite_model(run: Path, change: Callable[[dict[str, np.ndarray]], None]) -> None:
    cp = Checkpoint.load(run)
    arrays = {k: cp.model[k].numpy().copy() for k in cp.model.keys()}
    change(arrays)
    cp.model = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    cp.save(run)


def _wrong_shape(arrays: dict[str, np.ndarray]) -> None:
    name = next(iter(arrays))
    arrays[name] = np.zeros((3, 3), np.float32)


def _nan(arrays: dict[str, np.ndarray]) -> None:
    for a in arrays.values():
        a[...] = np.nan


def _owned_by(state: Path, run_id: str) -> None:
    """The state file as another run's would be: same records, another owner."""
    records = state_store.load_state(state)
    del records[state_store.OWNER]
    state.write_bytes(state_store._owned(state_store._lasting(records), run_id))


# --- finding 1: an unusable checkpoint or client state, before any round -----------------

def _resume(d: Path) -> Callable[[], int]:
    return lambda: cli.main(["run", "--resume", str(d)])


@pytest.mark.parametrize("damage, names", [
    (lambda r: _rewrite_model(r, _wrong_shape), "does not fit the run's model"),
    (lambda r: _rewrite_model(r, _nan), "NaN or infinite weights"),
    (lambda r: [s.write_bytes(b"\x07not a state file\xff" * 8) for s in _states(r)],
     "partition-0.state is unreadable"),
    (lambda r: shutil.rmtree(r / FOLDER / "clients"), "partition-0.state is missing)"),
    (lambda r: [_owned_by(s, "run-zz") for s in _states(r)], "belongs to run run-zz"),
], ids=["model-wrong-shape", "model-nan", "state-garbage", "state-deleted", "state-other-run"])
def test_an_unusable_checkpoint_or_client_state_is_refused_before_any_round(
        capsys, tmp_path, crashed, before_work, damage, names):  # noqa: F811
    """Each used to start the run: its clients failed with tracebacks, or the run failed
    and then advised --resume again. Now: exit 2 before anything starts, the file named,
    the advice to restore it or start anew, and no file of the run changed."""
    run = _copy(crashed, tmp_path / "run")
    damage(run)
    before = _snapshot(run)
    outcome, text = _outcome(capsys, _resume(run))
    assert outcome == "refused", (outcome, text)
    assert names in text and "\n\n" not in text.strip()
    assert "start a new run" in text.lower() or "as a new run" in text
    assert "fedpriv run --resume" not in text  # resuming again would fail the same way
    assert _snapshot(run) == before


def test_a_resumed_run_is_checked_in_the_runtime_child_that_runs_it(tmp_path, crashed,
                                                                    monkeypatch):
    """As a new run's: a resumed in-process run's pre-flight check runs in the runtime's
    child (torch and Opacus imported once), no child of its own, and the run finishes."""
    from experiments.preflight import isolated

    def own_child(given: object, env: object) -> tuple[dict, int]:
        raise AssertionError("the pre-flight check started a child of its own")

    monkeypatch.setattr(isolated, "_child", own_child)
    run = _copy(crashed, tmp_path / "run")
    res = experiments.api.resume(run, echo=None)
    assert res.ok and len(read_ledger(run)) == 2, res.error


# --- finding 2: resume = true set on a new run ------------------------------------------------

def test_resume_true_on_a_new_run_is_refused_with_what_to_do(tmp_path, crashed, capsys):
    """``--set resume=true`` used to start a new run that failed on its missing checkpoint
    (or, with run-dir naming a crashed run, one that failed on the recorded outcome): the
    CLI refuses it before any work, as does the function it calls."""
    refuse_resume_key(validate({}))  # a plain new run: nothing to say
    with pytest.raises(ConfigError, match="this is a new run .*nothing to resume"):
        refuse_resume_key(validate({"resume": True}))
    run = _copy(crashed, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"continued with `fedpriv run --resume .*/run`"):
        refuse_resume_key(validate({"resume": True, "run-dir": str(run)}))
    (tmp_path / "new").mkdir()
    with pytest.raises(ConfigError, match="cannot be continued .*not a fedpriv run folder"):
        refuse_resume_key(validate({"resume": True, "run-dir": str(tmp_path / "new")}))
    for sets in (["resume=true"], ["resume=true", f"run-dir={run}"]):
        before = sorted(p.name for p in run.iterdir())
        code = cli.main(["run", *[a for s in sets for a in ("--set", s)], "--set",
                         f"results-dir={tmp_path / 'results'}"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("fedpriv: error: resume = true"), err
        assert not (tmp_path / "results").exists()
        assert sorted(p.name for p in run.iterdir()) == before  # nothing written there


# --- finding 3: a full disk on --resume, a read-only folder on attack ---------------------------

def _under(path: object, folder: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).absolute().is_relative_to(folder)
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def failing_writes(monkeypatch: pytest.MonkeyPatch, folder: Path, code: int) -> Iterator[None]:
    """Every file opened for writing under ``folder`` fails as on a full disk (``code`` =
    ENOSPC: the handle is /dev/full, so each write fails) or a read-only mount (EROFS,
    EACCES: the open itself fails, and so does mkdir)."""
    folder = folder.absolute()
    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def refuse(path: object) -> OSError:
        return OSError(code, os.strerror(code), os.fsdecode(path))

    def opened(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and _under(file, folder) and \
                any(c in mode for c in "wax+"):
            if code != errno.ENOSPC:
                raise refuse(file)
            return real_open(FULL, mode.replace("x", "w").replace("a", "w"), *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    def os_opened(path, flags, mode=0o777, *, dir_fd=None):
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND)
        if writes and dir_fd is None and _under(path, folder):
            if code != errno.ENOSPC:
                raise refuse(path)
            return real_os_open(FULL, os.O_WRONLY)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def made(path, mode=0o777, *, dir_fd=None):
        if code != errno.ENOSPC and _under(path, folder):
            raise refuse(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(builtins, "open", opened)
    monkeypatch.setattr(io, "open", opened)
    monkeypatch.setattr(os, "open", os_opened)
    monkeypatch.setattr(os, "mkdir", made)
    try:
        yield
    finally:
        monkeypatch.setattr(builtins, "open", real_open)
        monkeypatch.setattr(io, "open", real_open)
        monkeypatch.setattr(os, "open", real_os_open)
        monkeypatch.setattr(os, "mkdir", real_mkdir)


@pytest.mark.skipif(not os.path.exists(FULL), reason="needs Linux's /dev/full")
def test_resume_on_a_full_disk_says_the_disk_is_full_and_keeps_every_round(
        capsys, tmp_path, crashed, monkeypatch, before_work):  # noqa: F811
    """It used to end in an uncaught WriteFailed (run.json could not be reopened). The
    pre-flight check passes here (its own probe writes to results-dir, elsewhere)."""
    monkeypatch.setattr(experiments.api, "_checked", lambda cfg, echo: SimpleNamespace(
        cuda=False, dataset="", model="", parameters=0, sizes=[1], privacy="",
        label_counts=None))
    monkeypatch.setattr(experiments.api, "_launch", _reached)
    run = _copy(crashed, tmp_path / "run")
    before = _snapshot(run)
    with failing_writes(monkeypatch, run, errno.ENOSPC):
        outcome, text = _outcome(capsys, _resume(run))
    assert outcome == "refused", (outcome, text)
    assert "No space left on device (the disk is full: free some space)" in text
    assert "every finished round is kept" in text and "\n\n" not in text.strip()
    assert _snapshot(run) == before
    assert [r.round for r in read_ledger(run)] == [1]


def test_attack_on_a_read_only_run_folder_is_refused_before_any_attack(
        capsys, tmp_path, observed, monkeypatch, before_work):  # noqa: F811
    """It used to attack, then fail saving the first figure with matplotlib's traceback
    (the guard raises where the attacks' work would start)."""
    run = _copy(observed, tmp_path / "run")
    before = _snapshot(run)
    with failing_writes(monkeypatch, run, errno.EROFS):
        outcome, text = _outcome(capsys, lambda: cli.main(["attack", str(run), "--attack",
                                                           "labels"]))
    assert outcome == "refused", (outcome, text)
    assert f"the run folder {run} is not writable" in text and "Read-only file system" in text
    assert "copy the run folder" in text and "\n\n" not in text.strip()
    assert _snapshot(run) == before


# --- finding 4: a SuperNode's own data, checked when it starts ----------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _supernode(data: Path) -> Callable[[], int]:
    return lambda: cli.main(["deploy", "supernode", "--superlink", "127.0.0.1:9092",
                             "--insecure", "--partition-id", "0", "--num-partitions", "2",
                             "--port", str(_free_port()), "--data-path", str(data)])


def _digits(n: int = 6) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, 28, 28), dtype=np.uint8)


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path


def _folder(root: Path, images: dict[str, np.ndarray]) -> Path:
    for name, pixels in images.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(root / name)
    return root


def _truncated_png(root: Path) -> Path:
    x = _digits(3)
    _folder(root, {f"{i}/{i}.png": x[i] for i in range(3)})
    data = (root / "1" / "1.png").read_bytes()
    (root / "1" / "1.png").write_bytes(data[: len(data) // 2])
    return root


@pytest.mark.parametrize("make, names", [
    (lambda p: _npz(p / "own.npz", x=_digits(), y=np.full(6, 99)),
     "labels must be class indices 0..9; found int64 from 99 to 99"),
    (lambda p: _npz(p / "own.npz", x=np.zeros((6, 28, 28, 3)), y=np.zeros(6, np.int64)),
     "x has shape (6, 28, 28, 3); it needs (N, 28, 28)"),
    (_truncated_png, "1.png cannot be read as an image (image file is truncated"),
], ids=["labels-99", "float-images-wrong-shape", "truncated-png"])
def test_a_supernode_refuses_own_data_that_fits_no_dataset_when_it_starts(
        capsys, tmp_path, before_work, make, names):  # noqa: F811
    """The node used to start and wait, and fail the run's first message; the host learns
    it now, at `fedpriv deploy supernode` (exit 2), before the node connects."""
    outcome, text = _outcome(capsys, _supernode(make(tmp_path / ODD)))
    assert outcome == "refused", (outcome, text)
    assert names in text and "A host's own data is" in text and "\n\n" not in text.strip()


def test_a_supernode_starts_with_own_data_that_fits_and_says_which_datasets(
        capsys, tmp_path, before_work):  # noqa: F811
    data = _npz(tmp_path / ODD / "own data.npz", x=_digits(), y=np.arange(6))
    with pytest.raises(Reached):
        _supernode(data)()
    assert "fits mnist, fashion-mnist" in capsys.readouterr().out


# --- finding 5: the fuzz ---------------------------------------------------------------

def _meta_damage(key: str, value: object) -> Callable[[Path, random.Random], None]:
    def damage(run: Path, rng: random.Random) -> None:
        path = run / FOLDER / SERVER_FILE
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays["meta"].tobytes().decode())
        meta[key] = value
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        np.savez(path, **arrays)
    return damage


def _npz_entry(change: Callable[[dict[str, np.ndarray], random.Random], None]
               ) -> Callable[[Path, random.Random], None]:
    def damage(run: Path, rng: random.Random) -> None:
        path = run / FOLDER / SERVER_FILE
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        change(arrays, rng)
        np.savez(path, **arrays)
    return damage


def _model_entry(arrays: dict[str, np.ndarray], rng: random.Random) -> str:
    return rng.choice(sorted(k for k in arrays if k.startswith("model.")))


def _cut(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(1, len(data))])


def _garbage(path: Path, rng: random.Random) -> None:
    path.write_bytes(bytes(rng.randrange(256) for _ in range(256)))


def _info(key: str, value: object) -> Callable[[Path, random.Random], None]:
    def damage(run: Path, rng: random.Random) -> None:
        info = json.loads((run / "run.json").read_text())
        info[key] = value
        (run / "run.json").write_text(json.dumps(info))
    return damage


def _ledger_line(line: str) -> Callable[[Path, random.Random], None]:
    def damage(run: Path, rng: random.Random) -> None:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        lines.insert(rng.randrange(len(lines) + 1), line)
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return damage


def _on_states(damage: Callable[[Path, random.Random], None]
               ) -> Callable[[Path, random.Random], None]:
    return lambda run, rng: damage(rng.choice(_states(run)), rng)


def _ledger_of(steps: list) -> Callable[[Path, random.Random], None]:
    """A readable state file of this run whose DP-SGD ledger holds ``steps``."""
    def damage(state: Path, rng: random.Random) -> None:
        records = RecordDict({local_dp.STATE_KEY: ConfigRecord({"history-steps": steps})})
        state.write_bytes(state_store._owned(state_store._lasting(records), "fuzz-resume"))
    return damage


def _state_folder(run: Path, rng: random.Random) -> None:
    state = rng.choice(_states(run))
    state.unlink()
    state.mkdir()


WRONG = [[], {}, 3, 2.5, None, True, "text", [1, "a"]]
RESUME_DAMAGES: dict[str, Callable[[Path, random.Random], None]] = {
    **{f"server.npz cut {i}": (lambda r, g: _cut(r / FOLDER / SERVER_FILE, g)) for i in range(4)},
    "server.npz garbage": lambda r, g: _garbage(r / FOLDER / SERVER_FILE, g),
    "server.npz no meta": _npz_entry(lambda a, g: a.pop("meta")),
    "server.npz a model tensor missing": _npz_entry(lambda a, g: a.pop(_model_entry(a, g))),
    "server.npz a model tensor reshaped": _npz_entry(
        lambda a, g: a.update({(k := _model_entry(a, g)): a[k].reshape(-1)[:, None]})),
    "server.npz a model tensor of text": _npz_entry(
        lambda a, g: a.update({_model_entry(a, g): np.array(["a", "b"])})),
    "server.npz a model tensor with inf": _npz_entry(
        lambda a, g: a.update({(k := _model_entry(a, g)): np.where(
            np.arange(a[k].size).reshape(a[k].shape) == 0, np.inf, a[k])})),
    **{f"server.npz meta {key} = {value!r}": _meta_damage(key, value)
       for key in ("round", "model-keys", "runner", "privacy", "info", "config")
       for value in WRONG if not (key == "config" and value in ({},))
       and not (key in ("runner", "privacy", "info") and value == {})},
    "server.npz meta privacy steps garbage": _meta_damage("privacy", {"steps": {"x": "y"}}),
    **{f"run.json {key} = {value!r}": _info(key, value)
       for key in ("status", "run-id", "client-state", "resumed", "error")
       for value in ([], {}, 3, [1])},
    **{f"metrics.jsonl line {line!r}": _ledger_line(line)
       for line in ("{not json", "[]", "null", '{"round": "x"}', '{"round": 1, "test": 3}',
                    '"text"', "\x00\x00")},
    "state cut": _on_states(_cut),
    "state garbage": _on_states(_garbage),
    "state empty": _on_states(lambda p, g: p.write_bytes(b"")),
    "state another run's": _on_states(lambda p, g: _owned_by(p, "another-run")),
    "state a folder": _state_folder,
    "state ledger of text": _on_states(_ledger_of(["x"])),
    "state ledger of fewer steps": _on_states(_ledger_of([1])),
    "state deleted": _on_states(lambda p, g: p.unlink()),
}
HARMLESS = {"run.json resumed = []"}  # damages a resume may rightly read past (no resumes)


def test_damaged_resume_inputs_in_any_path_are_refused_in_one_paragraph(
        capsys, tmp_path, crashed, before_work):  # noqa: F811
    """Every damage of a crashed run's files (checkpoint npz cut, garbage, of other shapes
    or types; run.json of wrong types; a bad ledger line; another run's, cut, empty or
    missing client state), in a path with spaces and non-ASCII characters, through
    ``run --resume``, ``deploy run --resume`` and ``fedpriv.resume``: exit 2 (the API:
    ConfigError), one paragraph, no traceback, no other file changed. The undamaged copy
    gets through every check."""
    import fedpriv

    commands = {
        "run --resume": _resume,
        "deploy run --resume": lambda d: (lambda: cli.main(
            ["deploy", "run", "--superlink", "127.0.0.1:9093", "--insecure", "--resume",
             str(d)])),
        "fedpriv.resume": lambda d: (lambda: fedpriv.resume(d, echo=None)),
    }
    rng = random.Random(SEED)
    findings, cases = [], 0
    for name, command in commands.items():
        clean = _copy(crashed, tmp_path / f"clean {cases}" / ODD)
        outcome, text = _outcome(capsys, command(clean))
        if outcome != "reached":
            findings.append(f"{name}: the undamaged run: {outcome} {text[:300]!r}")
        for how, damage in RESUME_DAMAGES.items():
            run = _copy(crashed, tmp_path / f"case {cases}" / ODD)
            cases += 1
            damage(run, rng)
            before = _snapshot(run)
            outcome, text = _outcome(capsys, command(run))
            case = f"{name}: {how}: {outcome} {text[:300]!r}"
            if outcome == "refused":
                if "\n\n" in text.strip() or not text.strip():
                    findings.append(case + " (not one paragraph)")
                if _snapshot(run) != before:
                    findings.append(case + " (a refusal changed the run's files)")
            elif not (outcome == "reached" and how in HARMLESS):
                findings.append(case)
            shutil.rmtree(run.parent)
    assert cases > 150
    assert not findings, "\n".join(findings)


def test_damaged_attack_inputs_in_a_path_with_spaces_and_non_ascii_are_refused(
        capsys, tmp_path, observed, before_work):  # noqa: F811
    """``fedpriv attack`` in such a path: the undamaged run gets through every check; a
    damaged ledger, run.json, config.toml or observation is refused in one paragraph."""
    run = _copy(observed, tmp_path / ODD)
    attack = lambda: cli.main(["attack", str(run), "--attack", "labels"])  # noqa: E731
    assert _outcome(capsys, attack)[0] == "reached"
    rng = random.Random(SEED + 1)
    findings = []
    for name in ("run.json", "config.toml", "observations/round-1-client-0.json",
                 "observations/round-1-client-0.npz", "leakage.jsonl"):
        for how, damage in (("cut", _cut), ("garbage", _garbage)):
            copy = _copy(observed, tmp_path / f"{name.replace('/', '-')} {how}" / ODD)
            target = copy / name
            if not target.exists():
                target.write_text('{"round": 1, "client": 0, "attack": "labels"}\n')
            damage(target, rng)
            outcome, text = _outcome(capsys, lambda c=copy: cli.main(
                ["attack", str(c), "--attack", "labels"]))
            if outcome not in ("refused",) and not (outcome == "reached" and how == "cut"):
                findings.append(f"{name} {how}: {outcome} {text[:300]!r}")
            elif outcome == "refused" and "\n\n" in text.strip():
                findings.append(f"{name} {how}: not one paragraph")
    assert not findings, "\n".join(findings)


def _x(n: int = 6) -> np.ndarray:
    return _digits(n)


DATA_CASES: dict[str, tuple[Callable[[Path], Path], bool]] = {  # name: (make, fits a dataset)
    "mnist-like": (lambda p: _npz(p / "a b.npz", x=_x(), y=np.arange(6)), True),
    "cifar100 labels": (lambda p: _npz(p / "c.npz", x=np.zeros((4, 32, 32, 3), np.uint8),
                                       y=np.array([0, 50, 99, 3])), True),
    "tabular": (lambda p: _npz(p / "t.npz", x=np.zeros((4, 30), np.float32),
                               y=np.array([0, 1, 0, 1])), True),
    # 62: above every 28x28 dataset's classes (femnist has 62)
    "labels 62": (lambda p: _npz(p / "l.npz", x=_x(), y=np.full(6, 62)), False),
    "labels float": (lambda p: _npz(p / "l.npz", x=_x(), y=np.zeros(6)), False),
    "labels 2-d": (lambda p: _npz(p / "l.npz", x=_x(), y=np.zeros((6, 1), np.int64)), False),
    "labels negative": (lambda p: _npz(p / "l.npz", x=_x(), y=-np.ones(6, np.int64)), False),
    "labels huge": (lambda p: _npz(p / "l.npz", x=_x(), y=np.full(6, 2**62)), False),
    "fewer labels": (lambda p: _npz(p / "l.npz", x=_x(), y=np.zeros(5, np.int64)), False),
    "no rows": (lambda p: _npz(p / "e.npz", x=np.zeros((0, 28, 28), np.uint8),
                               y=np.zeros(0, np.int64)), False),
    "x bool": (lambda p: _npz(p / "b.npz", x=_x() > 3, y=np.zeros(6, np.int64)), False),
    "x int64 pixels": (lambda p: _npz(p / "i.npz", x=_x().astype(np.int64),
                                      y=np.zeros(6, np.int64)), False),
    "x 1-d": (lambda p: _npz(p / "v.npz", x=np.zeros(6, np.uint8), y=np.zeros(6, np.int64)),
              False),
    "x float 28x28": (lambda p: _npz(p / "f.npz", x=_x().astype(np.float32),
                                     y=np.zeros(6, np.int64)), False),
    "tabular nan": (lambda p: _npz(p / "t.npz", x=np.full((4, 30), np.nan, np.float32),
                                   y=np.zeros(4, np.int64)), False),
    "tabular of ints": (lambda p: _npz(p / "t.npz", x=np.zeros((4, 30), np.int64),
                                       y=np.zeros(4, np.int64)), False),
    "object arrays": (lambda p: _npz(p / "o.npz", x=np.array([[1], "a"], dtype=object),
                                     y=np.zeros(2, np.int64)), False),
    "npz cut": (lambda p: [(q := _npz(p / "n.npz", x=_x(), y=np.arange(6))),
                           q.write_bytes(q.read_bytes()[:300])][0], False),
    "png folder": (lambda p: _folder(p / "imgs", {f"{i}/{i}.png": _x(3)[i] for i in range(3)}),
                   True),
    "png truncated": (_truncated_png, False),
    "png empty file": (lambda p: [_folder(p / "imgs", {"0/a.png": _x(1)[0]}),
                                  (p / "imgs" / "0" / "b.png").write_bytes(b"")][0], False),
    "png of 30x30": (lambda p: _folder(p / "imgs", {"0/a.png": np.zeros((30, 30), np.uint8)}),
                     False),
    "png class 62": (lambda p: _folder(p / "imgs", {"62/a.png": _x(1)[0]}), False),
    "png sizes mixed": (lambda p: _folder(p / "imgs", {"0/a.png": _x(1)[0],
                                                       "1/b.png": np.zeros((32, 32), np.uint8)}),
                        False),
}


def test_damaged_supernode_data_in_any_path_is_refused_when_the_node_starts(
        capsys, tmp_path, before_work):  # noqa: F811
    """Every malformed ``--data-path`` (an .npz of the wrong shapes, kinds or labels; an
    ImageFolder with a truncated, empty or odd-sized image), in a path with spaces and
    non-ASCII characters: exit 2 in one paragraph when it fits no dataset, else the node
    starts (the guard) and says which datasets it fits."""
    findings = []
    for i, (name, (make, fits)) in enumerate(DATA_CASES.items()):
        data = make(tmp_path / f"{i} {ODD}")
        outcome, text = _outcome(capsys, _supernode(data))
        want = "reached" if fits else "refused"
        if outcome != want:
            findings.append(f"{name}: {outcome} (want {want}) {text[:300]!r}")
        elif outcome == "refused" and ("\n\n" in text.strip() or "data-path" not in text):
            findings.append(f"{name}: not one paragraph naming data-path: {text[:300]!r}")
    assert not findings, "\n".join(findings)


@pytest.mark.parametrize("path", ["/srv/a b/ü é.npz", '/srv/a"b.npz', "/srv/a\\b.npz",
                                  "/srv/it's.npz", "/srv/x=y.npz"])
def test_a_host_path_reaches_the_supernode_unchanged(path):
    """The node config is a list of TOML values that Flower parses back: a path with
    spaces, non-ASCII, a double quote, a backslash or an '=' must arrive as given (a
    double quote or a backslash used to break it)."""
    from flwr.common.config import parse_config_args

    from experiments.deploy.connection import Connection

    cmd = supernode_command(Connection("127.0.0.1:9092", None),
                            {"partition-id": 0, "data-path": path, "download": True}, None)
    parsed = parse_config_args([cmd[cmd.index("--node-config") + 1]])
    assert parsed == {"partition-id": 0, "data-path": path, "download": True}


def test_a_path_the_node_config_cannot_carry_is_refused_in_one_paragraph():
    with pytest.raises(ConfigError, match="cannot carry this path"):
        node_config_value("data-path", "/srv/a\"b'c.npz")
    with pytest.raises(ConfigError, match="cannot carry this path"):
        node_config_value("state-dir", "/srv/a\nb")


def test_the_servers_view_of_the_client_state_format_is_the_clients():
    """server.client_state reads the files clients.state_store writes (the server may not
    import clients): the same owner record, ledger record and file names."""
    assert client_state.OWNER == state_store.OWNER
    assert client_state.DP_LEDGER == local_dp.STATE_KEY
    path = state_store.state_file({"state-dir": "/s", "partition-id": 3}, {"run-id": "r 1"})
    assert client_state.STATE_FILE.fullmatch(path.name)
    cfg = validate({"run-id": "r 1"})
    assert path.parent.name == client_state.state_folder(Path("/x"), cfg).name
