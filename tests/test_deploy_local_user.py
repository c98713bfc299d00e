"""A data holder's host against its other local users, and against the operator's code.

The SuperNode's Runtime API (where the ClientApp worker claims tasks) is plain HTTP on
loopback. `fedpriv deploy supernode` gives each start a fresh secret (0600, in a 0700
folder) that the SuperNode demands for ``AcquireTask``; every other Runtime call needs
the task token that call hands out. And it runs only client code the host pinned: the
worker checks the digest of each app bundle (FAB) before installing anything from it.

The fast tests check the pieces; the slow one runs a real SuperLink and three real
``fedpriv deploy supernode`` processes on loopback, with a second, unprivileged local
user (made here; root only) as the attacker, and a probe app of another digest.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from experiments.deploy import app_pin, warm_node
from experiments.deploy.connection import Connection
from experiments.deploy.superlink import SERVING
from experiments.deploy.supernode import supernode_command
from experiments.runtime.procs import wait_until
from experiments.runtime.superlink import flower_env, flower_executable
from tasks.config import ConfigError

from .conftest import REPO
from .test_cli import _processes_with
from .test_deploy import _fedpriv, _free_ports, _online, _stop_all, _wait_for
from .test_deploy_outsider import _probe_app

# --- the pieces -----------------------------------------------------------------------------


def test_the_app_digest_is_flowers_fab_hash_of_the_staged_app_and_stable():
    from flwr.cli.build import build_fab_from_disk

    from experiments.runtime.app_bundle import stage_app

    digest = app_pin.app_digest()
    assert app_pin.DIGEST.match(digest)
    assert app_pin.app_digest() == digest  # FAB_DATE fixed, files sorted: reproducible
    assert app_pin.fab_digest(build_fab_from_disk(stage_app())) == digest
    res = subprocess.run([sys.executable, "-m", "experiments.cli", "deploy", "app-digest"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == digest, res


def test_bad_pins_and_a_pin_the_executor_cannot_keep_are_refused_before_anything_starts(
        tmp_path, monkeypatch, capsys):
    import experiments.deploy.supernode as supernode
    from experiments.cli.main import main

    def started(*a: Any, **k: Any) -> int:
        raise AssertionError("a bad input reached a Flower process")

    monkeypatch.setattr(supernode, "serve_supernode", started)
    node = ["deploy", "supernode", "--superlink", "127.0.0.1:9092", "--insecure",
            "--partition-id", "0", "--num-partitions", "1"]
    pins = tmp_path / "pins"
    pins.write_text(f"# reviewed\n{'a' * 64}  # v1\n\nnot-a-digest\n")
    for extra, why in ((["--allow-app", "abc"], "'abc' is not an app digest"),
                       (["--allow-app", "g" * 64], "is not an app digest"),
                       (["--allow-app-file", str(pins)], "line 4: 'not-a-digest'"),
                       (["--allow-app-file", str(tmp_path / "none")], "cannot be read"),
                       (["--clientapp-per-message"], "cannot check which app it runs")):
        assert main([*node, *extra]) == 2
        said = capsys.readouterr().err.strip()
        assert why in said and said.count("\n") == 0 and "Traceback" not in said, said
    assert app_pin.read_digest_file(_lines(tmp_path / "ok", f"{'A' * 64}\n# c\n")) == \
        ["a" * 64]
    with pytest.raises(ConfigError, match="is not an app digest"):
        app_pin.check_digest("12", "--allow-app")


def _lines(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_node_command_pins_and_protects_by_default_and_per_message_needs_any_app():
    link = Connection("127.0.0.1:9092", None)
    cmd = supernode_command(link, {"partition-id": 0}, None, allow_apps=["b" * 64])
    own = cmd[:cmd.index("--")]
    assert own[own.index("--allow-app") + 1] == "b" * 64
    assert "--allow-any-app" not in own and "--unprotected-runtime-api" not in own
    stock = supernode_command(link, {"partition-id": 0}, None, warm=False, allow_apps=None)
    assert stock[stock.index("--executor") + 1] == "superexec" and "--allow-any-app" in stock
    with pytest.raises(SystemExit):  # Flower's executor cannot check digests
        warm_node.parse(["--executor", "superexec", "--", "--insecure"])
    with pytest.raises(SystemExit):
        warm_node.parse(["--allow-app", "xyz", "--", "--insecure"])
    with pytest.raises(SystemExit):  # a client certificate needs the node's key
        warm_node.parse(["--client-cert", "c.crt", "--", "--insecure"])
    flower = ["--insecure", "--port", "9095", "--isolation", "process"]
    execs = warm_node.superexec_command(flower, 7, Path("/s/runtime.secret"))
    assert Path(execs[0]).name == "flower-superexec"
    assert execs[execs.index("--superexec-auth-secret-file") + 1] == "/s/runtime.secret"
    assert execs[execs.index("--runtime-api-address") + 1] == "127.0.0.1:9095"
    assert execs[execs.index("--parent-pid") + 1] == "7"


def test_each_start_gets_a_fresh_private_secret():
    paths = [warm_node.write_runtime_secret() for _ in range(2)]
    try:
        assert paths[0].read_bytes() != paths[1].read_bytes()
        for p in paths:
            assert stat.S_IMODE(p.stat().st_mode) == 0o600 and len(p.read_bytes()) == 64
            assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700
    finally:
        for p in paths:
            shutil.rmtree(p.parent)


def test_an_unpinned_fab_is_refused_before_anything_of_it_is_installed(tmp_path):
    from types import SimpleNamespace

    from experiments.deploy.clientapp_worker import AppRefused, Worker

    apps = tmp_path / "apps"
    apps.mkdir()
    worker = Worker("127.0.0.1:1", True, None, allowed=frozenset({"c" * 64}), apps_dir=apps)
    fab = SimpleNamespace(content=b"PK-not-even-a-zip", hash_str="c" * 64)  # a lying label
    run = SimpleNamespace(fab_id="op/evil", fab_version="1.0")
    with pytest.raises(AppRefused) as err:
        worker.load(run, fab)
    assert err.value.digest == app_pin.fab_digest(fab.content)
    assert list(apps.iterdir()) == []
    line = app_pin.refusal("op/evil", "1.0", err.value.digest)
    assert f"--allow-app {err.value.digest}" in line and "op/evil 1.0" in line


def test_the_state_dir_is_made_private(tmp_path):
    import argparse

    from experiments.cli.deploy import _node_config

    folder = tmp_path / "state"
    folder.mkdir(mode=0o755)
    args = argparse.Namespace(partition_id=0, num_partitions=1, data_path=None,
                              state_dir=folder, accept_trap_weights=False, download=False,
                              data_dir=None, backbone_weights=None)
    assert _node_config(args)["state-dir"] == str(folder.resolve())
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


class _Squatter(http.server.ThreadingHTTPServer):
    """Another local process' server on a loopback port: it answers every request with
    200, as a SuperLink's /health does, and keeps what it was sent."""

    def __init__(self, port: int = 0) -> None:
        seen: list[str] = []

        class Answer(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append(f"{self.command} {self.path}")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", port), Answer)
        self.seen = seen
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_a_port_another_process_took_first_is_not_taken_for_fedprivs_own(monkeypatch,
                                                                          tmp_path):
    """Adversary: another local process (another user's, or another run's SuperLink) that
    binds the port fedpriv chose for its SuperLink or a SuperNode's Runtime API between
    free_port() and the Flower process' own bind. Its answer on the port must not be
    taken for the SuperLink's (the run, its app and config would go to it), nor a node
    left without its Runtime API: each is started again on another port."""
    from experiments.runtime import procs, superlink

    squatter = _Squatter()
    taken = squatter.server_address[1]
    chosen = iter([taken, taken])  # the SuperLink's first port, then node 0's
    free = superlink.free_port
    monkeypatch.setattr(superlink, "free_port", lambda: next(chosen, None) or free())
    try:
        with superlink.LocalSuperLink(cwd=tmp_path, supernodes=1) as link:
            assert link.port != taken and link.node_ports[0] != taken
            assert procs.listens_on(link.proc.pid, link.port) and link.proc.poll() is None
            node = link.nodes[0]
            assert procs.listens_on(node.pid, link.node_ports[0]) and node.poll() is None
            assert not procs.listens_on(link.proc.pid, taken)
    finally:
        squatter.shutdown()
    assert squatter.seen == []  # never asked anything, let alone sent a run


def test_a_deployments_internal_port_taken_after_the_check_gets_nothing(monkeypatch,
                                                                         tmp_path):
    """Adversary: a local process that binds the deployment SuperLink's internal port
    after `fedpriv deploy superlink` checked it free. Its answer must not be taken for
    the SuperLink's: the SuperExec would send it the Runtime API secret and the gateway
    the nodes' Fleet calls. The start fails instead, saying so."""
    from experiments.deploy import superlink as deploy_superlink

    squatter = _Squatter()
    internal = squatter.server_address[1]
    monkeypatch.setattr(deploy_superlink, "port_free", lambda *a: None)
    said: list[str] = []
    try:
        code = deploy_superlink.serve_superlink(
            None, tmp_path / "state", "127.0.0.1", _free_ports(1)[0], auth=False, nodes=1,
            echo=said.append, internal_port=internal, startup_timeout=60)
    finally:
        squatter.shutdown()
    assert code != 0, said
    assert any(f"did not start on 127.0.0.1:{internal}" in line for line in said), said
    assert any("address already in use" in line for line in said), said
    assert squatter.seen == []


def test_the_clientapp_worker_talks_only_to_a_runtime_api_its_node_holds(tmp_path):
    """Adversary: a local process holding a SuperNode's Runtime API port before the node
    binds it (the node starts its ClientApp worker first). The worker must send it
    nothing, neither the node's secret nor an ask for a task, until the node (the
    worker's parent PID; here this test) holds the port itself; then it talks to it."""
    other, port, log = _other_server(tmp_path / "other")
    secret = tmp_path / "secret"
    secret.write_text("s" * 64)
    apps = tmp_path / "apps"
    worker = subprocess.Popen(
        [sys.executable, "-m", "experiments.deploy.clientapp_worker", "--insecure",
         "--runtime-api-address", f"127.0.0.1:{port}", "--parent-pid", str(os.getpid()),
         "--superexec-auth-secret-file", str(secret), "--allow-any-app",
         "--apps-dir", str(apps)], cwd=REPO, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node = None
    try:
        assert wait_until(apps.is_dir, 120)  # past its start, about to serve
        time.sleep(1.5)  # it asks every 0.05 s once serving
        other.terminate()
        other.wait(timeout=10)
        assert worker.poll() is None
        assert "HTTP/1.1" not in log.read_text()
        node = _Squatter(port)  # the port is now this process', the worker's parent
        assert wait_until(lambda: node.seen, 60), "the worker never asked its own node"
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        if other.poll() is None:
            other.kill()
        if node is not None:
            node.shutdown()


def _other_server(folder: Path) -> tuple[subprocess.Popen, int, Path]:
    """Another local process serving HTTP on a loopback port: (process, port, its log of
    requests)."""
    folder.mkdir()
    log = folder / "requests.log"
    proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "--bind",
                             "127.0.0.1", "0"], cwd=folder, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True)
    return proc, int(proc.stdout.readline().split(" port ")[1].split()[0]), log


def test_flowers_superexec_is_started_only_once_its_node_holds_the_runtime_api(tmp_path):
    """The same adversary against a node that runs Flower's stock executor
    (`--executor superexec`), which sends the secret to the Runtime API at once: the warm
    node starts it only once the node's own process holds the port."""
    other, port, log = _other_server(tmp_path / "other")
    secret = tmp_path / "secret"
    secret.write_text("s" * 64)
    args, flower = warm_node.parse(["--executor", "superexec", "--allow-any-app", "--",
                                    "--insecure", "--superlink", "127.0.0.1:1",
                                    "--port", str(port)])
    keeper = warm_node.executor(args, [*flower, warm_node.SECRET_FLAG, str(secret)],
                                secret, None, None)
    keeper.start()
    node = None
    try:
        time.sleep(8)  # Flower's SuperExec would have asked by now
        assert "HTTP/1.1" not in log.read_text()  # neither the secret nor a call
        assert keeper.proc is None
        other.terminate()
        other.wait(timeout=10)
        node = _Squatter(port)  # the port is now this process', the node's
        assert wait_until(lambda: node.seen, 120), "SuperExec never asked its own node"
        assert keeper.proc is not None
    finally:
        keeper.stop()
        if other.poll() is None:
            other.kill()
        if node is not None:
            node.shutdown()


# --- real processes: a local user and a foreign app against running SuperNodes ----------------

PROBE = '''\
"""Another app (another digest): it records where its ClientApp ran and what node config
it saw, writes a file in the node's state-dir, and tries to change the node config."""
import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    out = Path(str(context.run_config["marker-dir"]))
    rounds = []
    nodes = list(grid.get_node_ids())
    for rnd, timeout in ((1, float(context.run_config["first-timeout"])), (2, 60.0)):
        t0 = time.monotonic()
        asks = [Message(RecordDict({"q": ConfigRecord({"round": rnd})}), dst_node_id=n,
                        message_type="query") for n in nodes]
        replies = list(grid.send_and_receive(asks, timeout=timeout))
        nodes = [r.metadata.src_node_id for r in replies]  # round 2: those that answered
        rounds.append({"round": rnd, "seconds": time.monotonic() - t0, "replies": [
            {"node": r.metadata.src_node_id, "error": r.error.reason if r.has_error() else ""}
            for r in replies]})
    (out / "server-done.json").write_text(json.dumps(rounds))
    if any(r["error"] for rnd in rounds for r in rnd["replies"]):
        raise RuntimeError("a SuperNode refused this app")


@client.query()
def query(msg: Message, context: Context) -> Message:
    out = Path(str(context.run_config["marker-dir"]))
    rnd = msg.content["q"]["round"]
    seen = dict(context.node_config)
    host = Path(str(seen.get("state-dir") or "nowhere")).name
    (out / f"client-ran-{host}-{rnd}").write_text(json.dumps(seen))
    if seen.get("state-dir"):
        (Path(str(seen["state-dir"])) / f"probe-{rnd}").write_text("written by the ClientApp")
    context.node_config.pop("state-dir", None)  # what a task must not be able to change
    context.node_config["accept-trap-weights"] = True
    return Message(RecordDict({"a": ConfigRecord({"ok": 1})}), reply_to=msg)
'''


@contextlib.contextmanager
def _local_user():
    """A fresh unprivileged system user: (uid, gid); removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("making a second local user (the attacker) needs root: CI runs as root")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not installed: no second local user to attack with")
    name = f"fedpriv-probe-{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    name], check=True, capture_output=True, timeout=60)
    try:
        user = pwd.getpwnam(name)
        yield user.pw_uid, user.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


def _as_user(uid: int, gid: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child that has become ``uid`` (it cannot exec this venv's
    Python, which lives in root's home: so everything it needs is imported before)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root for good, then attack
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            out = {"raised": f"{type(exc).__name__}: {exc}"}
        with contextlib.suppress(BaseException):
            os.write(w, json.dumps(out, default=str).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data or b'{"raised": "nothing came back"}')


def _acquire(address: str, seconds: float) -> dict:
    """What a local user without the secret gets from a SuperNode's Runtime API within
    ``seconds``: a task's token and the node config of the Context it pulls with it, or
    the last refusal."""
    from flwr.common.serde import context_from_proto
    from flwr.proto.runtime_pb2 import AcquireTaskRequest, PullTaskInputRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.runtime import RuntimeHttpClient

    def client(token: str | None = None) -> RuntimeHttpClient:
        extra = [RuntimeTokenHttpInterceptor(token)] if token else []
        return RuntimeHttpClient.from_server_address(
            server_address=address, insecure=True, root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec"), *extra])

    refused = ""
    deadline = time.monotonic() + seconds
    with client() as c:
        while time.monotonic() < deadline:
            try:
                res = c.AcquireTask(AcquireTaskRequest(supported_task_types=[
                    TaskType.CLIENT_APP]))
            except Exception as exc:  # noqa: BLE001 (the refusal is the result)
                refused = f"{type(exc).__name__}: {exc}"
                time.sleep(0.1)
                continue
            if res.token:
                with client(res.token) as t:
                    got = t.PullTaskInput(PullTaskInputRequest())
                return {"token": bool(res.token),
                        "node_config": dict(context_from_proto(got.context).node_config)}
            time.sleep(0.02)
    return {"token": False, "refused": refused}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()[:20]
    except OSError as exc:
        return f"{type(exc).__name__}"


def _node_processes(node: subprocess.Popen) -> tuple[psutil.Process, list[str]]:
    """The ClientApp worker below a `fedpriv deploy supernode` and its command line."""
    for p in psutil.Process(node.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "experiments.deploy.clientapp_worker" in " ".join(p.cmdline()):
                return p, p.cmdline()
    raise AssertionError("no ClientApp worker below the SuperNode")


def _secret_of(worker_cmd: list[str]) -> str:
    return worker_cmd[worker_cmd.index("--superexec-auth-secret-file") + 1]


def _unprotected(*args: str, marker: str, log: Path) -> subprocess.Popen:
    """`fedpriv deploy supernode` with the test hook that leaves its Runtime API open."""
    code = ("import sys; import experiments.deploy.supernode as s; "
            "s.PROTECT_RUNTIME_API = False; from experiments.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            text=True, env={**os.environ, "FEDPRIV_TEST_MARKER": marker})


@pytest.mark.slow
def test_a_local_user_gets_no_task_and_only_pinned_client_code_runs(tmp_path):
    """Three SuperNodes: A pinned by default, B also allowing the probe app, C the same as
    B but with its Runtime API left open (the test hook): the mutation check that the
    attack is real. The real fedpriv app runs on A and B (the digest the worker computes
    is app_digest()); then, with the nodes' workers paused so the attacker has no race to
    lose, the local user gets C's task and Context, and nothing from A or B; the probe app
    is refused on A (its digest logged, an Error reply in the next round within seconds,
    the run failed) and runs on B, where its change to the node config does not last and
    its file in the state-dir is 0600 in a 0700 folder, unreadable to the local user."""
    with _local_user() as (uid, gid):
        marker = uuid.uuid4().hex
        started: list[subprocess.Popen] = []
        world = Path(tempfile.mkdtemp(prefix="fedpriv-lu-"))  # traversable by the attacker:
        os.chmod(world, 0o755)  # only the node's own modes keep it out
        marks = world / "marks"
        marks.mkdir(mode=0o777)
        os.chmod(marks, 0o777)
        # round 1 ends by its timeout (C's task is taken, never answered): long enough for
        # B, paused meanwhile, to answer after the attack on a loaded machine
        probe = _probe_app(tmp_path / "probe", PROBE, "other", "first-timeout = 30.0\n")
        from flwr.cli.build import build_fab_from_disk

        probe_digest = app_pin.fab_digest(build_fab_from_disk(probe))
        own_digest = app_pin.app_digest()
        port, internal, *api = _free_ports(5)
        link = ["--superlink", f"127.0.0.1:{port}", "--insecure"]
        logs = {n: tmp_path / f"supernode-{n}.log" for n in "ABC"}
        secret = ""
        try:
            started.append(_fedpriv("deploy", "superlink", "--insecure", "--state",
                                    str(tmp_path / "state"), "--port", str(port),
                                    "--internal-port", str(internal), marker=marker,
                                    log=tmp_path / "superlink.log"))
            _wait_for(tmp_path / "superlink.log", SERVING)
            node = {n: [*link, "--partition-id", str(min(i, 1)), "--num-partitions", "2",
                        "--port", str(api[i]), "--state-dir", str(world / f"host-{n}")]
                    for i, n in enumerate("ABC")}
            started.append(_fedpriv("deploy", "supernode", *node["A"], marker=marker,
                                    log=logs["A"]))
            started.append(_fedpriv("deploy", "supernode", *node["B"], "--allow-app",
                                    probe_digest, marker=marker, log=logs["B"]))
            _online(["--superlink", f"127.0.0.1:{internal}", "--insecure"], 2, 240)
            assert f"pinned to app {own_digest[:12]}" in logs["A"].read_text()
            assert f"{own_digest[:12]}, {probe_digest[:12]}" in logs["B"].read_text()

            # the real fedpriv app runs on nodes pinned by default
            results = tmp_path / "results"
            res = subprocess.run(
                [sys.executable, "-m", "experiments.cli", "deploy", "run", "--superlink",
                 f"127.0.0.1:{internal}", "--insecure", "--set", "num-clients=2", "--set",
                 "num-server-rounds=1", "--set", f"results-dir={results}"], cwd=REPO,
                capture_output=True, text=True, timeout=300,
                env={**os.environ, "FEDPRIV_TEST_MARKER": marker})
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            assert f"FAB sha256 {own_digest}" in logs["A"].read_text()  # as received

            started.append(_unprotected("deploy", "supernode", *node["C"], "--allow-app",
                                        probe_digest, marker=marker, log=logs["C"]))
            _online(["--superlink", f"127.0.0.1:{internal}", "--insecure"], 3, 240)
            workers = {n: _node_processes(started[i]) for i, n in ((1, "A"), (2, "B"),
                                                                   (3, "C"))}
            assert "--superexec-auth-secret-file" not in workers["C"][1]
            for proc, _ in workers.values():  # the node's own claimant sits still
                proc.send_signal(signal.SIGSTOP)
            # warm up the attack's code paths here (refused, takes nothing) before it runs
            # as a user that can no longer read this Python's files
            _acquire(f"127.0.0.1:{api[0]}", 0.3)
            home = tmp_path / "flwr-home"
            home.mkdir()
            (home / "config.toml").write_text(
                '[superlink]\ndefault = "lo"\n\n'
                + Connection(f"127.0.0.1:{internal}", None).toml("lo"))
            submit = subprocess.run(
                [flower_executable("flwr"), "run", str(probe), "lo", "--run-config",
                 f"marker-dir='{marks}'"], env={**flower_env(home), "FEDPRIV_TEST_MARKER":
                                                marker},
                capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
            assert submit.returncode == 0, submit.stdout + submit.stderr
            stolen = _as_user(uid, gid, lambda: _acquire(f"127.0.0.1:{api[2]}", 180))
            tried = {n: _as_user(uid, gid, lambda a=a: _acquire(f"127.0.0.1:{a}", 3))
                     for n, a in (("A", api[0]), ("B", api[1]))}
            for proc, _ in workers.values():
                proc.send_signal(signal.SIGCONT)
            # without the secret, the local user took C's task and read its Context
            assert stolen.get("ok", {}).get("token"), stolen
            assert stolen["ok"]["node_config"]["state-dir"] == str(world / "host-C")
            # with it, nothing: refused by the SuperNode
            for n, got in tried.items():
                assert got.get("ok", {}).get("token") is False, (n, got)
                assert "SuperExec authentication failed" in got["ok"]["refused"] or \
                    "403" in got["ok"]["refused"] or "401" in got["ok"]["refused"], (n, got)

            done = marks / "server-done.json"
            deadline = time.monotonic() + 240
            while not done.exists():
                assert time.monotonic() < deadline, logs["B"].read_text()[-3000:]
                time.sleep(0.5)
            rounds = json.loads(done.read_text())
            # A refused the probe: nothing of it ran there, its digest in A's log
            assert not list(marks.glob("client-ran-host-A-*"))
            refusal = [line for line in logs["A"].read_text().splitlines()
                       if "refused app other/probe 1.0.0" in line]
            # one line for the app, not one per message
            assert len(refusal) == 1 and f"--allow-app {probe_digest}" in refusal[0], refusal
            second = rounds[1]
            errors = [r["error"] for r in second["replies"] if r["error"]]
            assert len(errors) == 1 and "not pinned" in errors[0], rounds
            # an answer, not the round's 60 s timeout (generous for a loaded machine)
            assert second["seconds"] < 30, rounds
            # B ran it; the node config it tried to change came back unchanged
            first, again = (json.loads((marks / f"client-ran-host-B-{k}").read_text())
                            for k in (1, 2))
            assert first == again and again["state-dir"] == str(world / "host-B")
            assert "accept-trap-weights" not in again
            # what the ClientApp wrote in the state-dir is the host user's only
            state = world / "host-B"
            assert stat.S_IMODE(state.stat().st_mode) == 0o700
            assert stat.S_IMODE((state / "probe-1").stat().st_mode) == 0o600
            secret = _secret_of(workers["A"][1])
            assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(Path(secret).parent).st_mode) == 0o700
            peeks = _as_user(uid, gid, lambda: [_read(secret), _read(str(state / "probe-1")),
                                                _read(str(Path(secret).parent))])
            assert peeks.get("ok") == ["PermissionError"] * 3, peeks
            def runs() -> list[dict]:  # as Flower reports them
                listed = subprocess.run([flower_executable("flwr"), "ls", "lo", "--format",
                                         "json"], env=flower_env(home), capture_output=True,
                                        text=True, timeout=120, stdin=subprocess.DEVNULL)
                return json.loads(listed.stdout).get("runs", [])

            def probe_status() -> str:
                return " ".join(r["status"] for r in runs() if r["fab-id"] == "other/probe")

            deadline = time.monotonic() + 240
            while "failed" not in probe_status() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert "failed" in probe_status(), probe_status()
            # the SuperLink's hash of the fedpriv run's FAB is the digest the host pins
            assert [r["fab-hash"] for r in runs() if r["fab-id"] == "fedpriv/fedpriv"] == \
                [own_digest]
        finally:
            _stop_all(started, marker)
            shutil.rmtree(world, ignore_errors=True)
        assert _processes_with(marker) == []
        assert secret and not Path(secret).exists()  # removed when its node exited
