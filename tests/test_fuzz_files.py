"""A seeded fuzz of damaged files through every command that reads one: ``run --resume``,
``attack``, ``deploy superlink|supernode|register|run`` (``--resume`` too) and the Python
API (``fedpriv.load``, ``fedpriv.resume``).

Each file a command reads is damaged in every way a disk, an editor or a careless copy
can damage it (emptied, truncated at a seeded offset, overwritten with seeded bytes,
zeroed, prefixed with bytes that are not UTF-8, replaced by a folder, deleted, or a JSON
file holding the wrong type). The command runs in-process through the real entry point,
up to the point where it would start a process or train (a guard raises there). A damage
that leaves the file unreadable must end in exit code 2 with a one-paragraph message,
never a traceback, and no other file of the folder may change; a damage the command can
read past (a truncation that is still valid, say) may go on, but never as a traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import experiments.api
import experiments.deploy.connection
import experiments.deploy.superlink
import experiments.deploy.supernode
import experiments.leakage.attack
from experiments.cli import main as cli
from tasks.config import ConfigError

from .test_fuzz import guarded  # noqa: F401  (fixture)
from .test_leakage import observed_run
from .test_resume import BASE, LostReplies, _context

SEED = 20261125


class Reached(Exception):
    """The command got past every check of its inputs (the guard where work would start)."""


def _reached(*a, **k):
    raise Reached


# --- the damages ---------------------------------------------------------------------------

def _empty(p: Path, rng: random.Random) -> None:
    p.write_bytes(b"")


def _truncated(p: Path, rng: random.Random) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: rng.randrange(1, len(data))] if len(data) > 1 else b"")


def _garbage(p: Path, rng: random.Random) -> None:
    p.write_bytes(bytes(rng.randrange(256) for _ in range(max(64, min(p.stat().st_size, 4096)))))


def _zeroed(p: Path, rng: random.Random) -> None:
    p.write_bytes(b"\x00" * max(1, p.stat().st_size))


def _not_utf8(p: Path, rng: random.Random) -> None:
    p.write_bytes(b"\xff\xfe\xc3\x28" + p.read_bytes())


def _folder(p: Path, rng: random.Random) -> None:
    p.unlink()
    p.mkdir()


def _missing(p: Path, rng: random.Random) -> None:
    p.unlink()


def _wrong_json(p: Path, rng: random.Random) -> None:
    p.write_text(rng.choice(["[]", "null", "3", '"text"', "[{}]", "true"]))


UNREADABLE: dict[str, Callable[[Path, random.Random], None]] = {
    "empty": _empty, "garbage": _garbage, "zeroed": _zeroed, "not-utf8": _not_utf8,
    "folder": _folder, "missing": _missing}
MAYBE: dict[str, Callable[[Path, random.Random], None]] = {"truncated": _truncated}


def _damages(name: str) -> dict[str, Callable[[Path, random.Random], None]]:
    out = {**UNREADABLE, **MAYBE}
    if name.endswith(".json"):
        out["wrong-json"] = _wrong_json
    return out


def _may_pass(name: str, how: str, optional: tuple[str, ...], pem: bool) -> bool:
    """Damages a reader may rightly read past: a cut that still parses; bytes before a
    PEM block (PEM readers skip them, as OpenSSL does); a file the command can do
    without (``optional``) being absent, or, for a ledger, empty."""
    return how in MAYBE or (how == "not-utf8" and pem) or (
        name in optional and (how == "missing" or (how == "empty" and name.endswith(".jsonl"))))


# --- the folders and files the commands read ------------------------------------------------

@contextlib.contextmanager
def _server_identity():
    """The identity Flower's runtime gives a ServerApp process (as the _task_identity
    fixture, for module-scoped runs)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory) -> Path:
    """A local-DP run that crashed in round 3 (checkpoint of round 2), in-process."""
    from server.app import run_one
    from tasks.config import validate

    path = tmp_path_factory.mktemp("fuzz") / "crashed"
    cfg = validate({**BASE, "dp": "local", "run-id": "fuzz-run", "run-dir": str(path)})
    with _server_identity(), pytest.raises(ConnectionError):
        run_one(LostReplies(cfg, 3), _context(cfg), cfg)
    return path


@pytest.fixture(scope="module")
def attacked_run(tmp_path_factory) -> Path:
    """A finished run whose server kept one observation, with a leakage ledger."""
    path = tmp_path_factory.mktemp("fuzz") / "observed"
    with _server_identity():
        observed_run(path, {"leakage-rounds": "1", "observed-examples": 2, "attacks": "labels"})
    (path / "leakage.jsonl").write_text(json.dumps(
        {"round": 1, "client": 0, "attack": "labels", "accuracy": 1.0}) + "\n")
    return path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Path:
    """Real certificates, SuperNode keys and a host's .npz, as the deploy commands make."""
    path = tmp_path_factory.mktemp("fuzz") / "deploy"
    assert cli.main(["deploy", "certs", str(path / "certs"), "--host", "127.0.0.1"]) == 0
    assert cli.main(["deploy", "keys", str(path / "keys"), "--nodes", "1"]) == 0
    rng = np.random.default_rng(0)
    np.savez(path / "data.npz", x=rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
             y=np.arange(20) % 10)
    return path


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _outcome(capsys, call: Callable[[], int]) -> tuple[str, str]:
    """refused (exit 2, one paragraph), reached (past every check) or what went wrong."""
    try:
        code = call()
    except Reached:
        capsys.readouterr()
        return "reached", ""
    except ConfigError as exc:  # the Python API raises what the CLI prints
        capsys.readouterr()
        return ("refused", str(exc))
    except Exception as exc:  # noqa: BLE001 - the finding itself
        capsys.readouterr()
        return "traceback", f"{type(exc).__name__}: {exc}"
    out, err = capsys.readouterr()
    if "Traceback" in out + err:
        return "traceback", err
    if code == 2 and err.startswith("fedpriv: error: "):
        return "refused", err.removeprefix("fedpriv: error: ")
    return f"exit {code}", out + err


def _fuzz(capsys, tmp_path: Path, source: Path, files: list[str],
          command: Callable[[Path], Callable[[], int]], seed: int,
          optional: tuple[str, ...] = ()) -> list[str]:
    """Damage each of ``files`` of a copy of ``source`` in every way; the findings."""
    rng = random.Random(seed)
    findings, cases = [], 0
    for name in files:
        for how, damage in _damages(name).items():
            copy = tmp_path / f"case{cases}"
            cases += 1
            shutil.copytree(source, copy, symlinks=True)
            target = copy / name
            damage(target, rng)
            before = {k: v for k, v in _snapshot(copy).items() if k != name}
            outcome, text = _outcome(capsys, command(copy))
            case = f"{name} {how}: {outcome} {text[:300]!r}"
            if outcome == "traceback" or outcome.startswith("exit"):
                findings.append(case)
            elif outcome == "reached" and not _may_pass(
                    name, how, optional, (source / name).read_bytes().startswith(b"-----BEGIN")):
                findings.append(case + " (an unreadable file was accepted)")
            elif outcome == "refused":
                if "\n\n" in text.strip() or not text.strip():
                    findings.append(case + " (not one paragraph)")
                after = {k: v for k, v in _snapshot(copy).items() if k != name}
                if after != before:
                    findings.append(case + " (a refusal changed other files)")
            shutil.rmtree(copy, ignore_errors=True)
    assert cases >= 6 * len(files)
    return findings


_resume = experiments.api.resume  # the real one (test_fuzz's guard replaces it)
RESUME_FILES = ["run.json", "config.toml", "metrics.jsonl", "checkpoint/server.npz"]


@pytest.fixture
def before_work(monkeypatch, guarded):  # noqa: F811
    """The guard: every command stops where it would start a process or train."""
    monkeypatch.setattr(experiments.api, "resume", _resume)
    monkeypatch.setattr(experiments.api, "_checked", _reached)
    monkeypatch.setattr(experiments.leakage.attack.ServerTask, "load", _reached)
    monkeypatch.setattr(experiments.deploy.superlink, "serve_superlink", _reached)
    monkeypatch.setattr(experiments.deploy.supernode, "serve_supernode", _reached)
    for module in (experiments.deploy.connection, experiments.deploy.superlink,
                   experiments.deploy.supernode):
        monkeypatch.setattr(module, "flower_executable", _reached)
    monkeypatch.setattr(experiments.deploy.connection, "refuse_public_port", lambda link: None)


def test_damaged_run_folders_are_refused_by_resume_deploy_resume_and_the_api(
        capsys, tmp_path, crashed_run, before_work):
    import fedpriv

    commands = {
        "run --resume": lambda d: (lambda: cli.main(["run", "--resume", str(d)])),
        "deploy run --resume": lambda d: (lambda: cli.main(
            ["deploy", "run", "--superlink", "127.0.0.1:9093", "--insecure", "--resume",
             str(d)])),
        "fedpriv.resume": lambda d: (lambda: fedpriv.resume(d, echo=lambda line: None)),
    }
    findings = []
    for i, (name, command) in enumerate(commands.items()):
        findings += [f"{name}: {f}" for f in _fuzz(capsys, tmp_path / str(i), crashed_run,
                                                     RESUME_FILES, command, SEED + i)]
    assert not findings, "\n".join(findings)


def test_damaged_run_folders_are_refused_by_load(capsys, tmp_path, crashed_run, before_work):
    import fedpriv

    def load(d):
        def call():
            fedpriv.load(d)
            raise Reached
        return call

    # a run that crashed early has no run.json outcome and no ledger yet: load reads it
    findings = _fuzz(capsys, tmp_path, crashed_run, ["run.json", "config.toml",
                                                      "metrics.jsonl"], load, SEED + 10,
                     optional=("run.json", "metrics.jsonl"))
    assert not findings, "\n".join(findings)


def test_damaged_observations_are_refused_by_attack(capsys, tmp_path, attacked_run,
                                                     before_work):
    files = ["config.toml", "run.json", "leakage.jsonl", "observations/round-1-client-0.json",
             "observations/round-1-client-0.npz"]
    findings = _fuzz(capsys, tmp_path, attacked_run, files, lambda d: (
        lambda: cli.main(["attack", str(d), "--attack", "labels"])), SEED + 20,
        optional=("run.json", "leakage.jsonl"))  # a first attack has no ledger yet
    assert not findings, "\n".join(findings)


def test_damaged_certificates_keys_and_data_are_refused_by_deploy(capsys, tmp_path, deployment,
                                                                  before_work):
    def superlink(d):
        return lambda: cli.main(["deploy", "superlink", "--certs", str(d / "certs"), "--state",
                                 str(d / "state")])

    def supernode(d):
        return lambda: cli.main(["deploy", "supernode", "--superlink", "127.0.0.1:9092", "--ca",
                                 str(d / "certs" / "ca.crt"), "--key",
                                 str(d / "keys" / "supernode-0"), "--partition-id", "0",
                                 "--num-partitions", "2", "--data-path", str(d / "data.npz")])

    def register(d):
        return lambda: cli.main(["deploy", "register", str(d / "keys" / "supernode-0.pub"),
                                 "--superlink", "127.0.0.1:9093", "--ca",
                                 str(d / "certs" / "ca.crt")])

    def submit(d):
        return lambda: cli.main(["deploy", "run", "--superlink", "127.0.0.1:9093", "--ca",
                                 str(d / "certs" / "ca.crt"), "--set", "num-clients=2"])

    findings = []
    for i, (command, files) in enumerate((
            (superlink, ["certs/ca.crt", "certs/server.pem", "certs/server.key"]),
            (supernode, ["certs/ca.crt", "keys/supernode-0", "data.npz"]),
            (register, ["certs/ca.crt", "keys/supernode-0.pub"]),
            (submit, ["certs/ca.crt"]))):
        findings += [f"{command.__name__}: {f}" for f in _fuzz(
            capsys, tmp_path / str(i), deployment, files, command, SEED + 30 + i)]
    assert not findings, "\n".join(findings)


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory, attacked_run) -> Path:
    """A finished sweep's folder of one cell, its files written by the sweep's own writer."""
    from experiments.sweep.spec import Cell, SweepSpec
    from experiments.sweep.table import write_table
    from tasks.results.ledger import outcome, read_ledger

    out = tmp_path_factory.mktemp("fuzz") / "sweep"
    shutil.copytree(attacked_run, out / "01")
    spec = SweepSpec("fuzz", out / "fuzz.toml", {}, {"seed": [1]})
    (out / "sweep.json").write_text(json.dumps(
        {"name": spec.name, "file": str(spec.path), "fixed": {}, "grid": spec.grid,
         "cells": [], "seeds": []}))
    cell = Cell(1, {"seed": 1}, None, "finished", None, out / "01",
                result=outcome(read_ledger(out / "01")))
    write_table(out, spec, [cell])
    return out


def test_damaged_sweep_folders_are_refused_by_replot(capsys, tmp_path, finished_sweep,
                                                     before_work):
    findings = _fuzz(capsys, tmp_path, finished_sweep,
                     ["sweep.json", "sweep.csv", "01/run.json", "01/metrics.jsonl"],
                     lambda d: (lambda: cli.main(["sweep", str(d), "--replot"]) or _reached()),
                     SEED + 40, optional=("01/run.json", "01/metrics.jsonl"))  # failed early
    assert not findings, "\n".join(findings)
