"""Warm SuperNodes (experiments.deploy.warm_node): one ClientApp worker per node instead of a
``flwr-clientapp`` process per message, and the SuperNode's fixed polls shortened.

The fast tests check that the Flower internals this relies on are still what the code
expects (an upgrade of Flower fails here, not silently in a slow run); the slow one runs
the same 3-round federation on real SuperNodes on loopback both ways and compares the
ledgers and the processes started.
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from experiments.deploy import fast_poll
from experiments.deploy.clientapp_worker import PULL_BACKOFF, pull_task_input
from experiments.deploy.warm_node import parse, worker_command
from experiments.runtime import procs

from .conftest import REPO, ledger_json, only_run


def test_the_supernode_poll_patch_fits_the_installed_flower():
    """The patch points in Flower's SuperNode loop are still there, and the patch applies
    (in a fresh interpreter: it changes the module for the whole process)."""
    assert fast_poll.check() is None
    code = ("from experiments.deploy import fast_poll as f; import flwr.supernode."
            "start_client_internal as s; assert f.install() is None; "
            "assert isinstance(s.time, f.PollClock); assert s.pull_objects.keywords == "
            "{'initial_backoff': f.OBJECT_BACKOFF, 'backoff_cap': f.OBJECT_BACKOFF_CAP}")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_poll_clock_shortens_only_flowers_two_waits():
    clock = fast_poll.PollClock(poll=0.1, reply_poll=0.05, idle_after=60)
    t = clock.last_message
    assert clock.wait(fast_poll.IDLE_SLEEP, t + 1) == 0.1  # busy: short idle poll
    assert clock.wait(fast_poll.IDLE_SLEEP, t + 61) == fast_poll.IDLE_SLEEP  # idle: Flower's
    assert clock.wait(fast_poll.REPLY_SLEEP, t + 61) == 0.05
    assert clock.wait(0.2, t) == 0.2  # any other sleep as asked
    pulls = []
    watched = clock.watch(lambda got: pulls.append(got) or got)
    watched(None)
    assert clock.last_message == t
    watched(7)  # a message came: busy again
    assert clock.last_message > t and pulls == [None, 7]
    forever = fast_poll.PollClock(poll=0.1, reply_poll=0.05, idle_after=math.inf)
    assert forever.wait(fast_poll.IDLE_SLEEP, forever.last_message + 1e6) == 0.1


def test_the_worker_mirrors_flowers_clientapp_process():
    """What clientapp_worker repeats from Flower 1.41's flwr-clientapp is still Flower's:
    the calls it makes, in that order, and the pull that takes a backoff."""
    from flwr.supernode.runtime import run_clientapp as rc

    body = inspect.getsource(rc.run_clientapp)
    steps = ["HeartbeatSender(", "pull_task_input(client)", "install_from_fab(",
             "get_load_client_app_fn(", "client_app(message=message, context=context)",
             "push_message(client, reply_message, context)", "flwr_exit("]
    at = [body.find(s) for s in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at, strict=True))
    # the task's status and Context go back in the exit handler, with one try
    on_exit = body[body.find("def on_exit"):body.find("register_signal_handlers(")]
    assert "max_tries = 1" in on_exit and "push_task_output(" in on_exit
    pull = inspect.getsource(rc.pull_task_input)
    for call in ("PullTaskInput(", "PullMessages(", "pull_and_inflate_object_from_tree(",
                 '__dict__["_message_id"]'):
        assert call in pull and call in inspect.getsource(pull_task_input), call
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    assert "initial_backoff" in inspect.signature(pull_and_inflate_object_from_tree).parameters
    assert PULL_BACKOFF < 1


def test_the_warm_node_runs_flowers_supernode_in_process_isolation():
    own, flower = parse(["--poll", "0.2", "--", "--insecure", "--superlink", "h:1",
                         "--isolation", "process", "--host", "127.0.0.1", "--port", "9099"])
    assert own.poll == 0.2 and flower.count("--isolation") == 1
    assert flower[-2:] == ["--isolation", "process"]
    with pytest.raises(SystemExit):
        parse(["--", "--isolation", "subprocess"])
    cmd = worker_command(flower, 0.05, 123)
    assert cmd[cmd.index("--runtime-api-address") + 1] == "127.0.0.1:9099"
    assert "--insecure" in cmd and cmd[cmd.index("--parent-pid") + 1] == "123"
    assert "--allow-any-app" in cmd  # no pins given: any app
    pinned = worker_command(flower, 0.05, 123, Path("/p/runtime.secret"), ["d" * 64],
                            Path("/p/apps"))
    assert pinned[pinned.index("--superexec-auth-secret-file") + 1] == "/p/runtime.secret"
    assert pinned[pinned.index("--allow-app") + 1] == "d" * 64
    assert "--allow-any-app" not in pinned and pinned[-2:] == ["--apps-dir", "/p/apps"]
    tls = worker_command(["--host", "0.0.0.0", "--port", "1", "--ssl-ca-certfile", "ca.crt"],
                         0.05, 1)
    assert tls[tls.index("--runtime-api-address") + 1] == "127.0.0.1:1"
    assert tls[tls.index("--root-certificates") + 1] == "ca.crt"


def _run_watched(results: Path, mode: str) -> tuple[list[dict], dict[tuple[int, float], str]]:
    """``fedpriv run --supernodes`` (3 clients, 3 rounds) with ``FEDPRIV_CLIENTAPPS=mode``;
    every process below it, seen by walking its tree every 0.1 s: (pid, start) -> cmdline.

    A child caught between fork and exec still shows its parent's command line (a library
    running ``uname`` would count as a second warm node), so such forks are left out."""
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--supernodes", "--set",
           "num-clients=3", "--set", "num-server-rounds=3", "--set", f"results-dir={results}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "FEDPRIV_CLIENTAPPS": mode})
    seen: dict[tuple[int, float], str] = {}
    parent: dict[tuple[int, float], int] = {}

    def watch() -> None:
        while proc.poll() is None:
            try:
                below = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                return
            for p in below:
                try:
                    # the latest that is not empty: a child seen between fork and exec
                    # has its parent's, a zombie none
                    # its start since boot: psutil's create_time adds a boot time that
                    # moves with the wall clock, which would count one worker twice
                    key = (p.pid, procs.started(p.pid))
                    line, ppid = " ".join(p.cmdline()), p.ppid()
                except psutil.Error:  # gone while read: none of it is kept
                    continue
                if line:
                    seen[key], parent[key] = line, ppid
            threading.Event().wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, _ = proc.communicate(timeout=900)
    watcher.join(timeout=10)
    assert proc.returncode == 0, out[-3000:]
    by_pid = {pid: line for (pid, _), line in seen.items()}
    forks = {key for key, line in seen.items() if by_pid.get(parent[key]) == line}
    return ledger_json(only_run(results)), {k: v for k, v in seen.items() if k not in forks}


@pytest.mark.slow
def test_warm_supernodes_give_the_same_ledger_without_a_process_per_message(tmp_path):
    warm, warm_procs = _run_watched(tmp_path / "warm", "warm")
    stock, stock_procs = _run_watched(tmp_path / "stock", "per-message")

    def rounds(ledger: list[dict]) -> list[tuple]:
        return [(r["round"], r["test"]["accuracy"], r["test"]["loss"], r["train"]["loss"])
                for r in ledger]

    assert len(warm) == 3 and rounds(warm) == rounds(stock)
    # Flower's SuperNode starts a flwr-clientapp per message: the watcher sees them ...
    assert sum("flwr-clientapp" in c for c in stock_procs.values()) >= 9, stock_procs
    # ... and a warm node none: one worker per node served all three rounds
    assert not [c for c in warm_procs.values() if "flwr-clientapp" in c], warm_procs
    workers = [c for c in warm_procs.values() if "experiments.deploy.clientapp_worker" in c]
    assert len(workers) == 3, warm_procs
    nodes = [c for c in warm_procs.values() if "experiments.deploy.warm_node" in c]
    assert len(nodes) == 3, warm_procs
