"""`fedpriv deploy supernode` restarted right after a crash: the SuperLink refuses it while
its previous session still counts as online (Flower 1.41: up to 60 s after the last
heartbeat), so it retries until admitted. Fast tests fake Flower's output; the slow one
kills a SuperNode's processes with SIGKILL during a run on loopback (TLS, SuperNode authentication)
and checks that the restarted node, with its old node id, trains again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from experiments.deploy import supernode as deploy
from experiments.deploy.clientapp_worker import SERVED
from experiments.deploy.connection import Connection
from experiments.deploy.supernode import serve_supernode
from tasks.results.folder import read_run_info

from .conftest import ledger_json, only_run
from .test_deploy import (
    _fedpriv,
    _free_port,
    _processes_with,
    _stop_all,
    _wait_for,
    secured_superlink,
)

STILL_ONLINE = "still counts this node's previous session as online"
# what flower-supernode 1.41 prints when the SuperLink refuses to activate it
REFUSAL = ["ERROR :     Exit Code: 305", "Failed to initialize the connection to the SuperLink.",
           "[code: 2004] Failed to activate SuperNode."]
JOIN = ["INFO :      Starting Flower SuperNode", "INFO :      SuperNode ID: 42"]


def _fake_flower(monkeypatch, outputs: list[list[str]]) -> list[list[str]]:
    """flower-supernode replaced by ``outputs`` (one per start; the last repeats)."""
    calls: list[list[str]] = []

    def stream_child(cmd, on_line, env=None) -> int:
        out = outputs[min(len(calls), len(outputs) - 1)]
        calls.append(cmd)
        for line in out:
            on_line(line)
        return 49 if out is REFUSAL else 0

    monkeypatch.setattr(deploy, "stream_child", stream_child)
    return calls


def _serve(tmp_path: Path, key: bool = True, **kwargs) -> tuple[int, list[str]]:
    (tmp_path / "node").write_text("key")
    lines: list[str] = []
    code = serve_supernode(Connection("127.0.0.1:9092", None), {"partition-id": 0},
                           tmp_path / "node" if key else None, 9094, lines.append, **kwargs)
    return code, lines


def test_a_refused_restart_is_retried_quietly_until_admitted(tmp_path, monkeypatch):
    calls = _fake_flower(monkeypatch, [REFUSAL, REFUSAL, JOIN])
    code, lines = _serve(tmp_path, rejoin_wait=10, retry_every=0.01)
    assert code == 0 and len(calls) == 3
    assert sum(STILL_ONLINE in line for line in lines) == 1
    assert sum(line == REFUSAL[-1] for line in lines) == 1  # refused retries print nothing
    assert any("admitted this SuperNode after" in line and "(attempt 3)" in line
               for line in lines)
    assert lines[-2:] == JOIN


def test_a_refusal_that_outlasts_a_session_ends_with_the_register_advice(tmp_path,
                                                                         monkeypatch):
    calls = _fake_flower(monkeypatch, [REFUSAL])
    code, lines = _serve(tmp_path, rejoin_wait=0.3, retry_every=0.05)
    assert code != 0 and len(calls) > 2
    assert sum("or its key is not registered" in line for line in lines) == 1
    assert "refused this SuperNode" in lines[-1] and "fedpriv deploy register" in lines[-1]


def test_without_a_key_a_refusal_is_not_retried(tmp_path, monkeypatch):
    calls = _fake_flower(monkeypatch, [REFUSAL])
    code, lines = _serve(tmp_path, key=False, rejoin_wait=10, retry_every=0.01)
    assert code != 0 and len(calls) == 1
    assert not any(STILL_ONLINE in line for line in lines)
    assert "register its key" in lines[-1]


def test_ctrl_c_during_the_wait_ends_it_at_once(tmp_path, monkeypatch):
    _fake_flower(monkeypatch, [REFUSAL])
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _serve(tmp_path, rejoin_wait=120, retry_every=60)
    finally:
        timer.cancel()
    # at once: not after the 60 s sleep until the next try (generous for a loaded machine)
    assert time.monotonic() - t0 < 30


def _worker(node: subprocess.Popen) -> psutil.Process:
    """The ClientApp worker below a `fedpriv deploy supernode` (the process that trains)."""
    for proc in psutil.Process(node.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "experiments.deploy.clientapp_worker" in " ".join(proc.cmdline()):
                return proc
    raise AssertionError("no ClientApp worker below the SuperNode")


def _node_id(log: Path) -> str:
    ids = [line.rsplit(":", 1)[1].strip() for line in log.read_text().splitlines()
           if "SuperNode ID:" in line]
    assert ids, log.read_text()[-2000:]
    return ids[-1]


@pytest.mark.slow
def test_a_supernode_killed_and_restarted_at_once_rejoins_and_trains_again(tmp_path):
    marker = uuid.uuid4().hex
    started: list[subprocess.Popen] = []
    link: list[str] = []

    def supernode(key: int, partition: int, log: str, *extra: str) -> subprocess.Popen:
        started.append(_fedpriv(
            "deploy", "supernode", *link, "--key", str(tmp_path / "keys" / f"supernode-{key}"),
            "--partition-id", str(partition), "--num-partitions", "2",
            "--port", str(_free_port()), *extra, marker=marker, log=tmp_path / log))
        return started[-1]

    paused: list[psutil.Process] = []
    try:
        gateway, op = secured_superlink(tmp_path, marker, started, keys=3, register=2)
        link.extend(gateway)
        node0 = supernode(0, 0, "node-0.log")
        node1 = supernode(1, 1, "node-1.log")
        results = tmp_path / "results"
        # round-timeout: longer than node 0 is held back below (up to 240 s)
        job = _fedpriv("deploy", "run", *op, "--set", "num-clients=2", "--set",
                       "num-server-rounds=3", "--set", "round-timeout=600", "--set",
                       f"results-dir={results}", marker=marker)
        started.append(job)
        lines = []
        for line in job.stdout:
            lines.append(line)
            if line.strip().startswith("0 |"):
                break
        # round 1 begins: node 1's host dies. Its whole `fedpriv deploy supernode` tree gets
        # SIGKILL, so no process says goodbye (SIGKILL of fedpriv alone gives Flower's
        # SuperNode a SIGTERM, on which it often deactivates itself). Restarted at once:
        before = _node_id(tmp_path / "node-1.log")
        root = psutil.Process(node1.pid)
        for proc in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        node1.wait(timeout=30)
        supernode(1, 1, "node-1-again.log")
        # The run waits for the node, not the clock: once node 0 has served round 1 (task 1
        # was the partition query), its ClientApp worker is paused between tasks, so the
        # next round holds until the restarted node is admitted; then it goes on
        _wait_for(tmp_path / "node-0.log", f"{SERVED} 2 ", timeout=240)
        paused.append(_worker(node0))
        paused[0].suspend()
        # an unregistered key is refused alike; SIGTERM during its retries ends it at once
        stranger = supernode(2, 0, "stranger.log", "--rejoin-wait", "300")
        _wait_for(tmp_path / "stranger.log", "retrying every", timeout=240)
        t0 = time.monotonic()
        stranger.send_signal(signal.SIGTERM)
        # "at once": not after the 300 s it would go on retrying; the bound is generous for
        # a loaded machine (the flower-supernode attempt under way is stopped first)
        assert stranger.wait(timeout=120) == 143
        assert time.monotonic() - t0 < 60, time.monotonic() - t0
        assert "or its key is not registered" in (tmp_path / "stranger.log").read_text()
        _wait_for(tmp_path / "node-1-again.log", "admitted this SuperNode after", timeout=240)
        paused.pop().resume()

        lines += job.communicate(timeout=600)[0]
        text = "".join(lines)
        assert job.returncode == 0, text
        again = (tmp_path / "node-1-again.log").read_text()
        assert STILL_ONLINE in again, again[-3000:]
        assert again.index(STILL_ONLINE) < again.index("admitted this SuperNode after")
        assert _node_id(tmp_path / "node-1-again.log") == before  # authenticated: same id
        clients = json.loads((only_run(results) / "partitions.json").read_text())["clients"]
        assert {c["partition-id"]: str(c["node-id"]) for c in clients}[1] == before

        ledger = ledger_json(only_run(results))
        assert [r["round"] for r in ledger] == list(range(1, 4))
        trained = [sorted(c["partition-id"] for c in r["clients"]) for r in ledger]
        failed = [r["round"] for r in ledger if any(f["partition-id"] == 1
                                                    for f in r["failures"])]
        # its lost session fails round 1 (unless the node was back within the fraction of a
        # second before the server asked again); then partition 1 trains again. The
        # SuperLink admits the restarted node only once it marks the old session offline,
        # when round 1 learns of the failure, and the node retries every 3 s: round 2 may
        # start without it (node 0 alone, held until the node was admitted), round 3 cannot
        assert set(failed) <= {1} and all(0 in t for t in trained), (trained, failed)
        assert trained[-1] == [0, 1], (trained, failed)
        assert read_run_info(only_run(results))["status"] == "finished"
    finally:
        for proc in paused:  # a failure above left node 0's worker paused
            with contextlib.suppress(psutil.Error):
                proc.resume()
        _stop_all(started, marker)
    assert _processes_with(marker) == []
