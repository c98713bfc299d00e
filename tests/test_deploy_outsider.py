"""Only the operator drives a deployment. The public port is a fleet-only gateway
(experiments/deploy/fleet_gateway.py) in front of a SuperLink bound to loopback; an outsider with
the deployment's ca.crt and keys of its own, from a fresh FLWR_HOME, can neither register
a node, run an app, list runs, read a log nor unregister a node through it, and each
refusal is logged on the operator's side. The same calls succeed on the loopback port,
so the probes are real. Fast tests drive the gateway in-process against a fake SuperLink;
the slow one runs real Flower processes on loopback, 127.0.0.2 standing for the public
interface."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest

from experiments.deploy.connection import Connection, refuse_public_port
from experiments.deploy.credentials import write_certificates, write_node_keys
from experiments.deploy.fleet_gateway import REFUSED, create_app
from experiments.deploy.superlink import (
    SERVING,
    gateway_command,
    superexec_command,
    superlink_command,
    write_secret,
)
from experiments.runtime.procs import Foreground
from experiments.runtime.superlink import flower_env, flower_executable
from tasks.config import ConfigError

from .conftest import REPO
from .test_cli import _processes_with
from .test_deploy import _fedpriv, _free_ports, _stop_all, _wait_for

# --- the gateway in-process, against a fake SuperLink --------------------------------------


def _gateway(max_body: int = 1 << 20) -> tuple[httpx.AsyncClient, list[str], list[httpx.Request]]:
    """A client of the gateway app, the gateway's log, and what reached the fake SuperLink."""
    seen: list[httpx.Request] = []
    log: list[str] = []

    async def superlink(request: httpx.Request) -> httpx.Response:
        await request.aread()
        seen.append(request)

        async def stream():  # as the network delivers it: a stream, not bytes in hand
            yield b"reply:"
            yield request.content

        return httpx.Response(200, content=stream(),
                              headers={"content-type": "application/protobuf",
                                       "server": "uvicorn", "x-flwr": "1"})

    app = create_app("https://127.0.0.1:1", True, max_body=max_body, log=log.append,
                     transport=httpx.MockTransport(superlink))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.0.0.9", 555)),
                               base_url="https://gateway")
    return client, log, seen


async def _with_lifespan(app_client: httpx.AsyncClient, calls):
    app = app_client._transport.app  # type: ignore[attr-defined]
    async with app.router.lifespan_context(app), app_client:
        return [await c(app_client) for c in calls]


def test_the_gateway_forwards_fleet_calls_with_their_signature_headers_and_body():
    client, log, seen = _gateway()
    signed = {"content-type": "application/protobuf", "flwr-public-key": "cGs=",
              "flwr-signature": "c2ln", "flwr-timestamp": "2026-11-25T10:00:00+00:00",
              "x-flwr-client": "SuperNode/1.41.0", "connection": "keep-alive"}
    body = bytes(range(256)) * 4096  # 1 MiB less nothing: binary, as protobuf is
    out = asyncio.run(_with_lifespan(client, [
        lambda c: c.post("/v1/fleet/push-object", content=body, headers=signed),
        lambda c: c.get("/health"),
    ]))
    assert out[0].status_code == 200 and out[0].content == b"reply:" + body
    assert out[0].headers["x-flwr"] == "1" and "server" not in out[0].headers
    assert out[1].status_code == 200
    assert [(r.method, r.url.path) for r in seen] == [("POST", "/v1/fleet/push-object"),
                                                       ("GET", "/health")]
    for name in ("flwr-public-key", "flwr-signature", "flwr-timestamp", "x-flwr-client",
                 "content-type"):
        assert seen[0].headers[name] == signed[name]
    assert seen[0].headers["host"] == "127.0.0.1:1"  # the upstream's, not the caller's
    assert log == []


async def _raw(app, raw_path: bytes) -> int:
    """POST to the ASGI app with ``raw_path`` exactly as a client could send it."""
    status: list[int] = []

    async def receive():
        return {"type": "http.request", "body": b"x", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "https", "root_path": "", "query_string": b"",
             "path": unquote(raw_path.decode()), "raw_path": raw_path,
             "headers": [(b"host", b"gateway")], "client": ("10.0.0.9", 555),
             "server": ("gateway", 443)}
    await app(scope, receive, send)
    return status[0]


async def _chunks(chunk: bytes, n: int):
    for _ in range(n):
        yield chunk


def test_the_gateway_refuses_everything_but_the_fleet_api_and_logs_each_refusal():
    client, log, seen = _gateway(max_body=1000)
    attempts = [
        ("POST", "/v1/control/register-node", 403), ("POST", "/v1/control/start-run", 403),
        ("POST", "/v1/control/list-runs", 403), ("POST", "/v1/control/stream-logs", 403),
        ("POST", "/v1/control/unregister-node", 403), ("POST", "/v1/runtime/acquire-task", 403),
        ("POST", "/v1/runtime/responses", 403), ("GET", "/docs", 404),
        ("GET", "/openapi.json", 404), ("POST", "/v1/fleet/pull-messages?x=1", 404),
        ("GET", "/v1/fleet/pull-messages", 405), ("POST", "/V1/FLEET/pull-messages", 404),
    ]

    def call(method: str, path: str):
        return lambda c: c.request(method, path, content=b"x")

    out = asyncio.run(_with_lifespan(client, [call(m, p) for m, p, _ in attempts] + [
        lambda c: c.post("/v1/fleet/push-object", content=b"x" * 1001),  # over the bound
        lambda c: c.post("/v1/fleet/push-object", content=_chunks(b"x" * 600, 2)),  # chunked
    ]))
    assert [r.status_code for r in out] == [code for *_, code in attempts] + [413, 413]
    # paths that try to leave the Fleet prefix once forwarded (httpx would normalize them)
    app = client._transport.app  # type: ignore[attr-defined]
    raw = [b"/v1/fleet/../control/list-runs", b"/v1/fleet/%2e%2e/control/list-runs",
           b"/v1/fleet/./pull-messages", b"/v1/fleet//control/list-runs",
           b"/v1/fleet/pull-messages/../../control/start-run"]
    assert [asyncio.run(_raw(app, path)) for path in raw] == [404] * len(raw)
    assert seen == []  # nothing reached the SuperLink
    assert "only on the SuperLink host's loopback" in out[0].text.replace("\n", " ") or \
        "served only on the SuperLink host's loopback address" in out[0].text
    assert len(log) == len(out) + len(raw)
    line = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d gateway refused "
                      r"(\d{3}) 10\.0\.0\.9:555 ([A-Z]+) (\S+)$")
    parsed = [line.match(text) for text in log]
    assert all(parsed), log
    assert parsed[0].groups() == ("403", "POST", "/v1/control/register-node")  # type: ignore[union-attr]


def test_deploy_commands_keep_the_superlink_on_loopback_with_a_runtime_secret(tmp_path):
    certs = write_certificates(tmp_path / "certs", ["server.lab"])
    secret = write_secret(tmp_path)
    assert oct(secret.stat().st_mode & 0o777) == "0o600" and len(secret.read_bytes()) == 64
    first = secret.read_bytes()
    assert write_secret(tmp_path).read_bytes() != first  # fresh for every start
    link = superlink_command(certs, tmp_path, "127.0.0.1", 9093, secret=secret)
    assert link[link.index("--host") + 1] == "127.0.0.1"
    assert link[link.index("--isolation") + 1] == "process"
    assert link[link.index("--superexec-auth-secret-file") + 1] == str(secret)
    execs = superexec_command(certs, 9093, secret, 4242)
    assert execs[execs.index("--runtime-api-address") + 1] == "127.0.0.1:9093"
    assert execs[execs.index("--superexec-auth-secret-file") + 1] == str(secret)
    gateway = gateway_command(certs, "0.0.0.0", 9092, 9093)
    assert gateway[gateway.index("--listen") + 1] == "0.0.0.0:9092"
    assert gateway[gateway.index("--upstream") + 1] == "127.0.0.1:9093"


def test_superlink_refuses_a_port_in_use_in_one_paragraph(tmp_path):
    port, internal = _free_ports(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", internal))
        busy.listen()
        res = subprocess.run([sys.executable, "-m", "experiments.cli", "deploy", "superlink",
                              "--insecure", "--state", str(tmp_path / "state"), "--port",
                              str(port), "--internal-port", str(internal)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res
    assert res.stderr.strip() == (f"fedpriv: error: 127.0.0.1:{internal} is in use (another "
                                  "SuperLink, or a previous one still stopping?); choose "
                                  "another --internal-port.")
    same = subprocess.run([sys.executable, "-m", "experiments.cli", "deploy", "superlink",
                           "--insecure", "--state", str(tmp_path / "state"), "--port",
                           str(port), "--internal-port", str(port)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert same.returncode == 2 and "must differ from --port" in same.stderr
    assert "Traceback" not in res.stderr + same.stderr


def test_the_superlinks_processes_end_together_when_one_exits():
    """`deploy superlink`'s three processes: one exits, the others are stopped by PID."""
    lines: list[str] = []
    with Foreground(lines.append) as children:
        stays = children.start([sys.executable, "-c", "import time; print('up', flush=True); "
                                                      "time.sleep(600)"])
        assert children.pump(lambda: "up" in lines, timeout=240)
        quits = children.start([sys.executable, "-c", "print('bye'); raise SystemExit(3)"])
        assert not children.pump()  # returns when a child has exited
        assert children.exited() is quits and quits.returncode == 3
        t0 = time.monotonic()
    # stopped by its PID (SIGTERM, then SIGKILL after a 5 s grace), not left to end its
    # 600 s sleep: the bound is generous for a loaded machine and far below that
    assert stays.poll() is not None and time.monotonic() - t0 < 60
    assert lines == ["up", "bye"]


# --- real processes: an outsider against a running deployment ------------------------------

PROBE = '''\
"""An outsider's app: it records where it ran (the ServerApp on the SuperLink's host, the
ClientApp on each SuperNode), as a remote-code-execution probe."""
from pathlib import Path
from urllib.parse import unquote

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    out = Path(str(context.run_config["marker-dir"]))
    (out / "server-ran").write_text("the outsider's ServerApp ran")
    nodes = list(grid.get_node_ids())
    asks = [Message(RecordDict({"q": ConfigRecord({"x": 1})}), dst_node_id=n,
                    message_type="query") for n in nodes]
    list(grid.send_and_receive(asks, timeout=120))


@client.query()
def query(msg: Message, context: Context) -> Message:
    out = Path(str(context.run_config["marker-dir"]))
    (out / f"client-ran-{context.node_id}").write_text(str(dict(context.node_config)))
    return Message(RecordDict({"a": ConfigRecord({"ok": 1})}), reply_to=msg)
'''


def _probe_app(folder: Path, source: str = PROBE, publisher: str = "outsider",
               config: str = "") -> Path:
    """A Flower app of another digest than fedpriv's: ``source`` as ``probe.py``, with a
    ``marker-dir`` run-config key (and ``config``, more TOML lines)."""
    folder.mkdir()
    (folder / "probe.py").write_text(source)
    (folder / "pyproject.toml").write_text(
        '[project]\nname = "probe"\nversion = "1.0.0"\n\n[tool.flwr.app]\n'
        f'publisher = "{publisher}"\n\n[tool.flwr.app.components]\n'
        'serverapp = "probe:server"\nclientapp = "probe:client"\n\n'
        f'[tool.flwr.app.config]\nmarker-dir = ""\n{config}')
    return folder


class Outsider:
    """``flwr`` from a fresh FLWR_HOME that knows the deployment's ca.crt and nothing else;
    ``pub`` is the public address, ``lo`` the SuperLink's loopback port."""

    def __init__(self, home: Path, ca: Path, public: str, loopback: str, marker: str) -> None:
        home.mkdir()
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "pub"\n\n' + Connection(public, ca).toml("pub") + "\n"
            + Connection(loopback, ca).toml("lo"))
        self.env = {**flower_env(home), "FEDPRIV_TEST_MARKER": marker}

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([flower_executable("flwr"), *args], env=self.env,
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)


def _fleet_self_register(address: str, ca: Path, key: Path) -> int:
    """A SuperNode's own Fleet call ``RegisterNode`` for ``key``, signed with it, as Flower's
    client sends it; the HTTP status of the refusal (0 if it was accepted)."""
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.proto.fleet_pb2 import RegisterNodeFleetRequest
    from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    private = load_ssh_private_key(key.read_bytes(), None)
    with FleetHttpClient.from_server_address(
            address, False, ca.read_bytes(), interceptors=[
                RuntimeVersionHttpInterceptor(component_name="SuperNode"),
                NodeAuthHttpInterceptor(private, private.public_key())]) as client:
        try:
            client.RegisterNode(RegisterNodeFleetRequest(
                public_key=public_key_to_bytes(private.public_key())))
        except httpx.HTTPStatusError as exc:
            return exc.response.status_code
    return 0


def _ids(text: str) -> list[int]:
    """Node or run ids in the first column of a `flwr ... ls` table."""
    return [int(m) for m in re.findall(r"^[│┃|]\s*(\d+)\s*[│┃|]", text, flags=re.M)]


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


@pytest.mark.slow
def test_an_outsider_with_only_the_ca_can_do_nothing_through_the_public_port(tmp_path):
    marker = uuid.uuid4().hex
    started: list[subprocess.Popen] = []
    certs = write_certificates(tmp_path / "certs", ["server.lab", "127.0.0.2"])
    write_node_keys(tmp_path / "keys", 1)
    own = write_node_keys(tmp_path / "outsider-keys", 1)[0]  # the outsider's own key pair
    port, internal = _free_ports(2)
    public, loopback = f"127.0.0.2:{port}", f"127.0.0.1:{internal}"
    op = ["--superlink", loopback, "--ca", str(certs.ca)]
    run = [sys.executable, "-m", "experiments.cli", "deploy"]
    log = tmp_path / "superlink.log"
    marks = tmp_path / "marks"
    marks.mkdir()
    probe = _probe_app(tmp_path / "probe")
    outsider = Outsider(tmp_path / "outsider-home", certs.ca, public, loopback, marker)
    try:
        started.append(_fedpriv("deploy", "superlink", "--certs", str(certs.ca.parent),
                                "--state", str(tmp_path / "state"), "--host", "127.0.0.2",
                                "--port", str(port), "--internal-port", str(internal),
                                # a peer without a client certificate cannot even finish the
                                # handshake (tests/test_deploy_gateway.py); off here, so the
                                # outsider's calls reach the gateway's checks behind it
                                "--no-client-certs", marker=marker, log=log))
        _wait_for(log, SERVING)
        reg = subprocess.run([*run, "register", str(tmp_path / "keys" / "supernode-0.pub"),
                              *op], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert reg.returncode == 0, reg
        started.append(_fedpriv(
            "deploy", "supernode", "--superlink", public, "--ca", str(certs.ca),
            "--key", str(tmp_path / "keys" / "supernode-0"), "--partition-id", "0",
            "--num-partitions", "1", "--port", str(_free_ports(1)[0]), marker=marker,
            log=tmp_path / "supernode.log"))

        def nodes() -> str:
            return outsider("supernode", "ls", "lo").stdout

        assert _wait_until(lambda: "online" in nodes(), 240), nodes()
        registered = _ids(nodes())
        assert len(registered) == 1

        # the SuperLink itself is not reachable from the public interface at all
        with pytest.raises(ConnectionRefusedError), socket.create_connection(
                ("127.0.0.2", internal), timeout=5):
            pass

        # through the public port: every operator call is refused and changes nothing
        attempts = {
            "register-node": outsider("supernode", "register", str(own.with_suffix(".pub")),
                                      "pub"),
            "start-run": outsider("run", str(probe), "pub", "--run-config",
                                  f"marker-dir='{marks}'"),
            "list-runs": outsider("ls", "pub"),
            "unregister-node": outsider("supernode", "unregister", str(registered[0]), "pub"),
            "list-nodes": outsider("supernode", "ls", "pub"),
        }
        for name, res in attempts.items():
            assert res.returncode != 0, (name, res.stdout, res.stderr)
            assert "403" in res.stdout + res.stderr, (name, res.stdout, res.stderr)
        # nor can it register itself through the Fleet API the gateway does forward
        # (Flower: 412, "SuperNode authentication is enabled. All SuperNodes must be
        # registered via the CLI.")
        assert _fleet_self_register(public, certs.ca, own) == 412
        assert _ids(nodes()) == registered  # not registered, not unregistered
        assert _ids(outsider("ls", "lo").stdout) == []  # no run was created
        assert list(marks.iterdir()) == []  # and nothing ran

        # a local SuperExec without the Runtime API secret polls ten times as often as the
        # SuperLink's own, and is refused the task (Flower logs it on the operator's side)
        eager = {**outsider.env, "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}
        started.append(subprocess.Popen(
            [flower_executable("flower-superexec"), "--runtime-api-address", loopback,
             "--root-certificates", str(certs.ca)], env=eager, stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        # the same probes on the loopback port work: they are real
        again = outsider("run", str(probe), "lo", "--run-config", f"marker-dir='{marks}'")
        assert again.returncode == 0, again.stdout + again.stderr
        assert _wait_until((marks / "server-ran").exists, 240), (list(marks.iterdir()),
                                                                  log.read_text()[-3000:])
        # run by the SuperLink's own SuperExec; its ClientApp reached the SuperNode, which
        # runs only client code its host pinned: refused there, none of it executed
        node_log = tmp_path / "supernode.log"
        assert _wait_until(lambda: "refused app outsider/probe" in node_log.read_text(), 240), \
            node_log.read_text()[-3000:]
        assert not (marks / f"client-ran-{registered[0]}").exists()
        # (it polls on until stopped; under load its first refusal can come after the run)
        assert _wait_until(lambda: "SuperExec authentication failed" in log.read_text(), 240), \
            log.read_text()[-3000:]
        runs = _ids(outsider("ls", "lo").stdout)
        assert len(runs) == 1
        attempts["stream-logs"] = outsider("log", str(runs[0]), "pub", "--show")
        assert attempts["stream-logs"].returncode != 0
        assert "403" in attempts["stream-logs"].stdout + attempts["stream-logs"].stderr
        shown = outsider("log", str(runs[0]), "lo", "--show")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        mine = outsider("supernode", "register", str(own.with_suffix(".pub")), "lo")
        assert mine.returncode == 0 and "registered successfully" in mine.stdout, mine
        (added,) = set(_ids(nodes())) - set(registered)
        gone = outsider("supernode", "unregister", str(added), "lo")
        assert gone.returncode == 0, gone.stdout + gone.stderr
        assert _ids(nodes()) == registered

        # each refusal is one line in the operator's log: time, client, method, path
        text = log.read_text()
        for name in attempts:
            path = "/v1/control/" + name
            assert re.search(rf"^\S+ {REFUSED} 403 [\d.]+:\d+ POST {path}$", text, re.M), \
                (path, text[-3000:])
        # the operator's commands pointed at the public port say where to go instead
        with pytest.raises(ConfigError, match="public port"):
            refuse_public_port(Connection(public, certs.ca))
        refuse_public_port(Connection(loopback, certs.ca))  # the right one passes
    finally:
        _stop_all(started, marker)
    assert _processes_with(marker) == []
