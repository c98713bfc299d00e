"""`fedpriv deploy`: certificates and keys that real TLS and Flower accept, and (slow) a
multi-host test bed on loopback: a SuperLink with TLS and SuperNode authentication, three
SuperNodes as separate processes, one killed during a round, an unregistered SuperNode
and a wrong CA refused. Every process the tests start is stopped by PID."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    load_ssh_private_key,
    load_ssh_public_key,
)

from experiments.deploy.connection import Connection
from experiments.deploy.credentials import certificate_hosts, write_certificates, write_node_keys
from experiments.deploy.superlink import SERVING, superlink_command
from experiments.deploy.supernode import supernode_command
from tasks.config import ConfigError
from tasks.results.folder import read_run_info

from .conftest import REPO, ledger_json, only_run
from .test_cli import _processes_with


def _handshake(certs, ca: Path, server_name: str) -> None:
    """A real TLS handshake: the SuperLink's certificate, verified against ``ca``."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs.cert, certs.key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    a, b = socket.socketpair()

    def serve():
        # the client's side decides; a refused handshake ends the server's side too
        with contextlib.suppress(ssl.SSLError, OSError), \
                server_ctx.wrap_socket(a, server_side=True) as s:
            s.recv(1)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=server_name) as c:
            c.send(b"x")
    finally:
        t.join(5)


def test_certificates_pass_a_real_tls_handshake_for_each_name_and_only_with_their_ca(tmp_path):
    certs = write_certificates(tmp_path / "certs", ["server.lab", "10.0.0.5"])
    assert set(certificate_hosts(certs.cert)) == {"server.lab", "10.0.0.5", "127.0.0.1",
                                                   "localhost"}
    for name in ("server.lab", "10.0.0.5", "127.0.0.1", "localhost"):
        _handshake(certs, certs.ca, name)
    with pytest.raises(ssl.SSLCertVerificationError):  # a name it was not made for
        _handshake(certs, certs.ca, "other.lab")
    other = write_certificates(tmp_path / "other", ["server.lab"])
    with pytest.raises(ssl.SSLCertVerificationError):  # another deployment's CA
        _handshake(certs, other.ca, "server.lab")
    assert oct(certs.key.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ConfigError, match="not a host name"):
        write_certificates(tmp_path / "bad", ["http://server.lab"])


def test_node_keys_are_p384_openssh_pairs(tmp_path):
    paths = write_node_keys(tmp_path, 2)
    for path in paths:
        private = load_ssh_private_key(path.read_bytes(), None)
        public = load_ssh_public_key(path.with_suffix(".pub").read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert private.curve.name == "secp384r1"
        assert private.public_key().public_numbers() == public.public_numbers()
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert paths[0].read_bytes() != paths[1].read_bytes()


def test_commands_are_secure_by_default_and_refuse_bad_addresses(tmp_path):
    certs = write_certificates(tmp_path / "certs", ["server.lab"])
    cmd = superlink_command(certs, tmp_path / "state", "0.0.0.0", 9092)
    assert "--enable-supernode-auth" in cmd and "--insecure" not in cmd
    assert cmd[cmd.index("--database") + 1] == str(tmp_path / "state" / "state.db")
    with pytest.raises(ConfigError, match="needs TLS"):
        superlink_command(None, tmp_path / "state", "127.0.0.1", 9092)
    link = Connection("server.lab:9092", certs.ca)
    node = supernode_command(link, {"partition-id": 1, "num-partitions": 3}, None)
    assert node[node.index("--root-certificates") + 1] == str(certs.ca)
    assert node[node.index("--node-config") + 1] == "partition-id=1 num-partitions=3"
    for bad in ("server.lab", "server.lab:99999", ":9092"):
        with pytest.raises(ConfigError, match="is not HOST:PORT"):
            Connection(bad, certs.ca)
    with pytest.raises(ConfigError, match="does not exist"):
        Connection("server.lab:9092", tmp_path / "missing.crt")


def _fedpriv(*args: str, marker: str, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([sys.executable, "-m", "experiments.cli", *args], cwd=REPO,
                            stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "FEDPRIV_TEST_MARKER": marker})


def _checkpointed(run_dir: Path) -> int:
    """The round of ``run_dir``'s server checkpoint; 0 while there is none (or it is being
    replaced: it is written atomically, so a read sees a whole file or none)."""
    from server.checkpoint import Checkpoint

    try:
        return Checkpoint.load(run_dir).round
    except ConfigError:
        return 0


def _wait_for(path: Path, text: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s:\n"
                         f"{path.read_text(errors='replace')[-2000:] if path.exists() else ''}")


@pytest.mark.slow
def test_three_hosts_with_tls_and_authentication_survive_a_killed_supernode(tmp_path):
    marker = uuid.uuid4().hex
    started: list[subprocess.Popen] = []
    run = [sys.executable, "-m", "experiments.cli", "deploy"]
    subprocess.run([*run, "certs", str(tmp_path / "certs"), "--host", "server.lab"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([*run, "keys", str(tmp_path / "keys"), "--nodes", "4",
                    "--certs", str(tmp_path / "certs")], cwd=REPO,
                   check=True, capture_output=True)
    ca = str(tmp_path / "certs" / "ca.crt")
    port, internal = _free_ports(2)
    link = ["--superlink", f"127.0.0.1:{port}", "--ca", ca]  # the fleet gateway: SuperNodes
    op = ["--superlink", f"127.0.0.1:{internal}", "--ca", ca]  # the operator, on loopback
    try:
        started.append(_fedpriv("deploy", "superlink", "--certs", str(tmp_path / "certs"),
                                "--state", str(tmp_path / "state"), "--port", str(port),
                                "--internal-port", str(internal),
                                marker=marker, log=tmp_path / "superlink.log"))
        _wait_for(tmp_path / "superlink.log", SERVING)
        keys = [str(tmp_path / "keys" / f"supernode-{i}.pub") for i in range(3)]
        reg = subprocess.run([*run, "register", *keys, *op], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert reg.returncode == 0 and reg.stdout.count("registered successfully") == 3, reg
        for i in range(3):
            started.append(_fedpriv(
                "deploy", "supernode", *link, "--key", str(tmp_path / "keys" / f"supernode-{i}"),
                "--partition-id", str(i), "--num-partitions", "3", "--port", str(_free_port()),
                marker=marker, log=tmp_path / f"supernode-{i}.log"))
        # a SuperNode whose key was never registered is refused (Flower's code 305)
        stranger = subprocess.run(
            [*run, "supernode", *link, "--key", str(tmp_path / "keys" / "supernode-3"),
             "--partition-id", "0", "--num-partitions", "3", "--port", str(_free_port()),
             "--rejoin-wait", "0"],
            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert stranger.returncode != 0, stranger.stdout[-2000:]
        assert "refused this SuperNode" in stranger.stdout
        # another deployment's CA cannot talk to this SuperLink
        other = tmp_path / "other"
        subprocess.run([*run, "certs", str(other), "--host", "server.lab"], cwd=REPO,
                       check=True, capture_output=True)
        wrong = subprocess.run([*run, "register", "--ls", "--superlink",
                                f"127.0.0.1:{internal}", "--ca", str(other / "ca.crt")],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
        assert wrong.returncode == 2 and "the TLS handshake failed" in wrong.stderr, wrong
        # the public port refuses operator commands, with the way to the right one
        public = subprocess.run([*run, "register", "--ls", *link], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert public.returncode == 2 and "the deployment's public port" in public.stderr, public
        listed = subprocess.run([*run, "register", "--ls", *op], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        deadline = time.monotonic() + 180
        while listed.stdout.count("online") < 3 and time.monotonic() < deadline:
            time.sleep(2)
            listed = subprocess.run([*run, "register", "--ls", *op], cwd=REPO,
                                    capture_output=True, text=True, timeout=120)
        assert listed.stdout.count("online") == 3, listed.stdout

        results = tmp_path / "results"
        job = _fedpriv("deploy", "run", *op, "--set", "num-clients=3", "--set",
                       "num-server-rounds=3", "--set", f"results-dir={results}",
                       marker=marker)
        started.append(job)
        lines = []
        for line in job.stdout:
            lines.append(line)
            if line.strip().startswith("1 |"):
                break
        # round 2 has begun: SuperNode 2's Flower process dies without a goodbye (its
        # ClientApp worker gets the parent-death signal)
        node2 = [p for p in psutil.Process(started[3].pid).children(recursive=True)
                 if {"flower-supernode", "experiments.deploy.warm_node"} & set(_cmdline(p))
                 or any(a.endswith("/flower-supernode") for a in _cmdline(p))]
        assert node2
        os.kill(node2[0].pid, signal.SIGKILL)
        lines += job.communicate(timeout=600)[0]
        text = "".join(lines)
        assert job.returncode == 0, text
        ledger = ledger_json(only_run(results))
        assert [r["round"] for r in ledger] == [1, 2, 3]
        assert sorted(c["partition-id"] for c in ledger[0]["clients"]) == [0, 1, 2]
        for r in ledger[1:]:  # the others trained; client 2's failure is recorded
            assert sorted(c["partition-id"] for c in r["clients"]) == [0, 1], r
            assert [f["partition-id"] for f in r["failures"]] in ([2], []), r["failures"]
        assert any(f["partition-id"] == 2 for r in ledger[1:] for f in r["failures"])
        assert "client error(s), e.g. client 2" in text
        assert read_run_info(only_run(results))["status"] == "finished"
    finally:
        _stop_all(started, marker)
    assert _processes_with(marker) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


@pytest.mark.slow
def test_the_simulation_runs_on_an_existing_ray_cluster(tmp_path):
    """A Ray head started here (loopback, by PID), and `fedpriv run --set ray-address=...`:
    Flower's Ray backend attaches to it and the clients' actors run in its workers."""
    marker = uuid.uuid4().hex
    port = _free_port()
    session = Path(tempfile.mkdtemp(prefix="fpray-"))  # short: Ray's socket paths are limited
    env = {**os.environ, "FEDPRIV_TEST_MARKER": marker, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    try:
        head = subprocess.run(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--port", str(port),
             "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--include-dashboard",
             "false", "--temp-dir", str(session), "--disable-usage-stats"],
            env=env, capture_output=True, text=True, timeout=120)
        assert head.returncode == 0, head.stdout + head.stderr
        results = tmp_path / "results"
        res = subprocess.run(
            [sys.executable, "-m", "experiments.cli", "run", "--set", "num-clients=3", "--set",
             "num-server-rounds=2", "--set", f"ray-address=127.0.0.1:{port}", "--set",
             f"results-dir={results}"], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert f"run on the Ray cluster at 127.0.0.1:{port}" in res.stdout
        assert read_run_info(only_run(results))["status"] == "finished"
        # the clients ran in the cluster's workers (the cluster's own session logs)
        logs = [p.read_text(errors="replace") for p in session.glob("session_*/logs/worker-*")]
        assert any("ClientAppActor" in text for text in logs), len(logs)
    finally:
        procs = []
        for pid in _processes_with(marker):
            try:
                procs.append(psutil.Process(pid))
                procs[-1].terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            p.kill()
        shutil.rmtree(session, ignore_errors=True)
    assert _processes_with(marker) == []


@pytest.mark.slow
def test_kill_9_of_fedpriv_deploy_leaves_no_flower_process(tmp_path):
    """`fedpriv deploy superlink` and `supernode` killed with SIGKILL: their Flower
    processes (SuperLink, SuperNode and the SuperExecs below them) stop too."""
    marker = uuid.uuid4().hex
    port, internal = _free_ports(2)
    link = _fedpriv("deploy", "superlink", "--insecure", "--state", str(tmp_path / "state"),
                    "--port", str(port), "--internal-port", str(internal), marker=marker,
                    log=tmp_path / "superlink.log")
    _wait_for(tmp_path / "superlink.log", SERVING)
    node = _fedpriv("deploy", "supernode", "--superlink", f"127.0.0.1:{port}", "--insecure",
                    "--partition-id", "0", "--num-partitions", "1", "--port", str(_free_port()),
                    marker=marker, log=tmp_path / "supernode.log")
    _wait_for(tmp_path / "supernode.log", "Starting Flower SuperNode")
    flower = [p for p in _processes_with(marker) if p not in (link.pid, node.pid)]
    # at least flower-superlink, flower-superexec, the gateway, the SuperNode and its
    # ClientApp worker
    assert len(flower) >= 5, flower  # the worker starts before Flower's first line
    for proc in (node, link):
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 120
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with(marker) == []


def secured_superlink(tmp_path: Path, marker: str, started: list[subprocess.Popen],
                      keys: int, register: int) -> tuple[list[str], list[str]]:
    """A CA and certificates, ``keys`` SuperNode key pairs, a SuperLink with TLS and node
    authentication on loopback (appended to ``started``) and the first ``register`` keys
    registered: (the SuperNodes' connection arguments, the operator's)."""
    run = [sys.executable, "-m", "experiments.cli", "deploy"]
    subprocess.run([*run, "certs", str(tmp_path / "certs"), "--host", "server.lab"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([*run, "keys", str(tmp_path / "keys"), "--nodes", str(keys),
                    "--certs", str(tmp_path / "certs")], cwd=REPO,
                   check=True, capture_output=True)
    port, internal = _free_ports(2)
    ca = str(tmp_path / "certs" / "ca.crt")
    link = ["--superlink", f"127.0.0.1:{port}", "--ca", ca]  # the gateway, for SuperNodes
    op = ["--superlink", f"127.0.0.1:{internal}", "--ca", ca]  # the operator's loopback
    started.append(_fedpriv("deploy", "superlink", "--certs", str(tmp_path / "certs"),
                            "--state", str(tmp_path / "state"), "--port", str(port),
                            "--internal-port", str(internal),
                            marker=marker, log=tmp_path / "superlink.log"))
    _wait_for(tmp_path / "superlink.log", SERVING)
    pubs = [str(tmp_path / "keys" / f"supernode-{i}.pub") for i in range(register)]
    reg = subprocess.run([*run, "register", *pubs, *op], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert reg.returncode == 0 and reg.stdout.count("registered successfully") == register, reg
    return link, op


def _stop_all(started: list[subprocess.Popen], marker: str) -> None:
    for proc in reversed(started):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    deadline = time.monotonic() + 120
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)


def _online(link: list[str], count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = subprocess.run([sys.executable, "-m", "experiments.cli", "deploy", "register",
                                 "--ls", *link], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
        if listed.stdout.count("online") >= count or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert listed.stdout.count("online") == count, listed.stdout + listed.stderr


@pytest.mark.slow
def test_a_restarted_superlink_keeps_registrations_and_the_run_resumes_without_reset(tmp_path):
    """kill -9 of the SuperLink once round 2 of a local-DP run is checkpointed: the run fails; the
    SuperLink restarted on its database still knows both SuperNodes' keys; they reconnect
    by themselves; `fedpriv deploy run --resume` finishes the run from the round-2
    checkpoint, and each client's own ledger (on its host, in its state-dir) counts each
    round once. Host 1 trains on its own .npz file (data-path)."""
    import numpy as np

    from clients.state_store import load_state
    from tasks.datasets import load_dataset

    marker = uuid.uuid4().hex
    started: list[subprocess.Popen] = []
    run = [sys.executable, "-m", "experiments.cli", "deploy"]
    subprocess.run([*run, "certs", str(tmp_path / "certs"), "--host", "server.lab"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([*run, "keys", str(tmp_path / "keys"), "--nodes", "2",
                    "--certs", str(tmp_path / "certs")], cwd=REPO,
                   check=True, capture_output=True)
    digits = load_dataset("mnist")
    rows = np.random.default_rng(1).permutation(len(digits.y_train))[:400]
    np.savez(tmp_path / "host-1.npz", x=digits.x_train[rows], y=digits.y_train[rows])
    port, internal = _free_ports(2)
    ca = str(tmp_path / "certs" / "ca.crt")
    link = ["--superlink", f"127.0.0.1:{port}", "--ca", ca]
    op = ["--superlink", f"127.0.0.1:{internal}", "--ca", ca]
    serve = ["deploy", "superlink", "--certs", str(tmp_path / "certs"), "--state",
             str(tmp_path / "state"), "--port", str(port), "--internal-port", str(internal)]
    try:
        started.append(_fedpriv(*serve, marker=marker, log=tmp_path / "superlink.log"))
        _wait_for(tmp_path / "superlink.log", SERVING)
        reg = subprocess.run([*run, "register", *[str(tmp_path / "keys" / f"supernode-{i}.pub")
                                                  for i in range(2)], *op],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert reg.returncode == 0, reg
        for i in range(2):
            own = ["--data-path", str(tmp_path / "host-1.npz")] if i == 1 else []
            started.append(_fedpriv(
                "deploy", "supernode", *link, "--key", str(tmp_path / "keys" / f"supernode-{i}"),
                "--partition-id", str(i), "--num-partitions", "2", "--port", str(_free_port()),
                "--state-dir", str(tmp_path / f"host-{i}"), *own,
                marker=marker, log=tmp_path / f"supernode-{i}.log"))
        _online(op, 2)
        results = tmp_path / "results"
        job = _fedpriv("deploy", "run", *op, "--set", "num-clients=2", "--set",
                       "num-server-rounds=4", "--set", "dp=local", "--set",
                       "noise-multiplier=1.0", "--set", "dp-public-records=500", "--set",
                       f"results-dir={results}",
                       marker=marker)
        started.append(job)
        lines = []
        for line in job.stdout:
            lines.append(line)
            if line.strip().startswith("2 |"):
                break
        # The table's row is printed before the round's checkpoint is written: wait for
        # the checkpoint itself (the event), not for a time, before the kill.
        folder = only_run(results)
        deadline = time.monotonic() + 180
        while _checkpointed(folder) < 2:
            assert time.monotonic() < deadline, "round 2 never checkpointed: " + "".join(lines)
            time.sleep(0.05)
        superlink = [p for p in psutil.Process(started[0].pid).children(recursive=True)
                     if "flower-superlink" in " ".join(_cmdline(p))]
        assert superlink
        os.kill(superlink[0].pid, signal.SIGKILL)  # the server host loses its SuperLink
        lines += job.communicate(timeout=300)[0]
        assert job.returncode != 0, "".join(lines)
        assert read_run_info(folder)["status"] in ("failed", "crashed")
        # round 3 may have been checkpointed too on a machine that ran it before the kill
        last = _checkpointed(folder)
        assert last in (2, 3), last
        started[0].wait(timeout=60)  # fedpriv deploy superlink ends with its SuperLink

        started.append(_fedpriv(*serve, marker=marker, log=tmp_path / "superlink-2.log"))
        _wait_for(tmp_path / "superlink-2.log", SERVING)
        _online(op, 2, timeout=240)  # the keys were kept in state.db; the nodes came back
        again = subprocess.run([*run, "run", *op, "--resume", str(folder)], cwd=REPO,
                               capture_output=True, text=True, timeout=600,
                               env={**os.environ, "FEDPRIV_TEST_MARKER": marker})
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert f"round {last} of 4 checkpointed" in again.stdout
        info = read_run_info(folder)
        assert info["status"] == "finished" and info["resumed"][0]["from-round"] == last
        ledger = ledger_json(folder)
        assert [r["round"] for r in ledger] == [1, 2, 3, 4]
        sizes = {c["partition-id"]: c["num-examples"] for c in ledger[-1]["clients"]}
        # host 1 serves its own file (400 rows): under local DP its schedule and FedAvg
        # weight are the public size every host was given, not its row count
        assert sizes == {0: 500, 1: 500}
        eps = [{c["partition-id"]: c["epsilon"] for c in r["clients"]} for r in ledger]
        assert all(eps[k][p] > eps[k - 1][p] for k in (1, 2, 3) for p in (0, 1)), eps
        for i in range(2):  # each host's own ledger: every round released once
            state = load_state(tmp_path / f"host-{i}" / info["run-id"] / f"partition-{i}.state")
            assert sorted(state.config_records["dp-sgd"]["released-rounds"]) == [1, 2, 3, 4]
    finally:
        _stop_all(started, marker)
    assert _processes_with(marker) == []


def test_deploy_run_to_an_unreachable_superlink_says_so_and_writes_nothing(tmp_path):
    port = _free_port()
    res = subprocess.run([sys.executable, "-m", "experiments.cli", "deploy", "run",
                          "--superlink", f"127.0.0.1:{port}", "--insecure",
                          "--set", f"results-dir={tmp_path / 'results'}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "cannot reach the SuperLink: nothing answered" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "results").exists()
