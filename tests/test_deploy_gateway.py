"""The fleet gateway against outsiders (experiments/deploy/fleet_gateway.py): a flood of
idle connections does not lock out a certificate-holding SuperNode, unsigned, badly
signed or replayed bodies never reach the SuperLink, every refusal is logged with the real
peer, and forwarding claims from outside never reach upstream. The gateway runs as its
own process with real certificates; upstream is a small recording HTTP server (it counts
every body byte it receives). 127.0.0.2 stands for the outsider's address, 127.0.0.1 for
the honest node's."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import inspect
import re
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import time
from base64 import b64encode
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from experiments.deploy import fleet_gateway as gw
from experiments.deploy.credentials import Certificates, write_certificates
from experiments.deploy.fleet_gateway import (
    CLOSED,
    READY,
    REFUSED,
    UPSTREAM_REFUSED,
    ReplayCache,
    create_app,
)

from .conftest import REPO
from .test_deploy import _free_ports

OUTSIDER = "127.0.0.2"  # the flood's source address
NODE = "127.0.0.1"  # the honest SuperNode's source address

# --- helpers: keys, certificates, signatures ------------------------------------------------


def _client_certificate(certs: Certificates, folder: Path, name: str,
                        key: ec.EllipticCurvePrivateKey | None = None
                        ) -> tuple[Path, Path, ec.EllipticCurvePrivateKey]:
    """A TLS client certificate (EKU clientAuth) for an EC P-384 key, signed by the
    deployment's CA; (certificate, key file, private key)."""
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(
        (certs.ca.parent / "ca-private" / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = key or ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path, key


def _signed(key: ec.EllipticCurvePrivateKey) -> dict[str, str]:
    """The node-auth headers exactly as Flower's SuperNode adds them to a Fleet call."""
    from flwr.supercore.protobuf.client import ProtobufRequestContext
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    request = httpx.Request("POST", "https://superlink/v1/fleet/pull-messages")
    context = ProtobufRequestContext(rpc_method="PullMessages", message=None,  # type: ignore[arg-type]
                                     request=request)
    NodeAuthHttpInterceptor(key, key.public_key()).intercept(
        context, lambda _: httpx.Response(200))
    return {name: request.headers[name] for name in gw.SIGNATURE_HEADERS}


def _signed_at(key: ec.EllipticCurvePrivateKey, when: dt.datetime,
               signer: ec.EllipticCurvePrivateKey | None = None) -> dict[str, str]:
    """Node-auth headers for ``key`` with a chosen timestamp (signed by ``signer``)."""
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

    stamp = when.isoformat()
    return {gw.FLEET_HTTP_PUBLIC_KEY_HEADER: b64encode(public_key_to_bytes(key.public_key()))
            .decode(), gw.TIMESTAMP_HEADER: stamp,
            gw.FLEET_HTTP_SIGNATURE_HEADER: b64encode(sign_message(
                signer or key, stamp.encode())).decode()}


P384_ORDER = int("ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf"
                 "581a0db248b0a77aecec196accc52973", 16)


def _malleated(headers: dict[str, str]) -> dict[str, str]:
    """The same signature as another valid byte string: ECDSA's (r, s) -> (r, n - s)."""
    from base64 import b64decode

    from cryptography.hazmat.primitives.asymmetric.utils import (
        decode_dss_signature,
        encode_dss_signature,
    )

    r, s = decode_dss_signature(b64decode(headers[gw.FLEET_HTTP_SIGNATURE_HEADER]))
    twin = b64encode(encode_dss_signature(r, P384_ORDER - s)).decode()
    assert twin != headers[gw.FLEET_HTTP_SIGNATURE_HEADER]
    return {**headers, gw.FLEET_HTTP_SIGNATURE_HEADER: twin}


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


# --- helpers: a recording upstream and the gateway as a process -----------------------------


class Upstream:
    """A tiny HTTP/1.1 server on loopback standing for the SuperLink: it records each request
    (method, path, headers) and counts every body byte as it arrives; it answers 401 to
    ``/v1/fleet/unauthorized`` and 200 to anything else; over TLS with ``certs`` (a TLS
    gateway speaks TLS upstream too)."""

    def __init__(self, certs: Certificates | None = None) -> None:
        self.received = 0
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        owner = self

        context = None
        if certs is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(certs.cert), str(certs.key))

        class Handler(socketserver.StreamRequestHandler):
            def setup(self) -> None:
                if context is not None:
                    self.request = context.wrap_socket(self.request, server_side=True)
                super().setup()

            def handle(self) -> None:
                while owner._one(self.rfile, self.wfile):
                    pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _count(self, rfile, n: int) -> None:
        while n > 0:
            data = rfile.read(min(n, 65536))
            if not data:
                raise ConnectionError
            self.received += len(data)
            n -= len(data)

    def _one(self, rfile, wfile) -> bool:
        line = rfile.readline(65536)
        if not line.strip():
            return False
        headers: dict[str, list[str]] = {}
        while (field := rfile.readline(65536)) not in (b"\r\n", b"\n", b""):
            name, _, value = field.decode("latin-1").partition(":")
            headers.setdefault(name.strip().lower(), []).append(value.strip())
        method, path, _ = line.decode("latin-1").split(" ", 2)
        self.requests.append((method, path, headers))
        try:
            if "chunked" in ",".join(headers.get("transfer-encoding", [])):
                while size := int(rfile.readline().split(b";")[0], 16):
                    self._count(rfile, size)
                    rfile.readline()
                while rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
            else:
                self._count(rfile, int(headers.get("content-length", ["0"])[0]))
        except (ConnectionError, ValueError):
            return False
        status = 401 if path == "/v1/fleet/unauthorized" else 200
        wfile.write(f"HTTP/1.1 {status} X\r\ncontent-type: text/plain\r\n"
                    "content-length: 2\r\n\r\nok".encode())
        wfile.flush()
        return True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Gateway:
    """``python -m experiments.deploy.fleet_gateway`` on 127.0.0.1 as its own process, its
    output (stdout and stderr) collected line by line; stopped by its PID."""

    def __init__(self, upstream: Upstream, *flags: str) -> None:
        self.port = _free_ports(1)[0]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.deploy.fleet_gateway", "--listen",
             f"127.0.0.1:{self.port}", "--upstream", f"127.0.0.1:{upstream.port}", *flags],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL)
        threading.Thread(target=self._read, daemon=True).start()
        assert self.wait_for(READY), self.lines

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 180) -> bool:
        """Whether a line matching ``pattern`` (a regex) appears within ``timeout`` s (it
        returns as soon as one does: the bound only ends a wait for a line that never
        comes, generously, for a loaded machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in self.lines):
                return True
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader finish
                return any(re.search(pattern, line) for line in self.lines)
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def _running(flags: tuple[str, ...] | list[str] = (), certs: Certificates | None = None
             ) -> Iterator[tuple[Gateway, Upstream]]:
    """A gateway with ``flags`` in front of a recording upstream (TLS with ``certs``)."""
    upstream = Upstream(certs)
    gateway = None
    try:
        gateway = Gateway(upstream, *flags)
        yield gateway, upstream
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.close()


def _tls(certs: Certificates, *flags: str) -> dict:
    """``_running``'s arguments for a TLS gateway with ``flags``."""
    return {"flags": ["--cert", str(certs.cert), "--key", str(certs.key), "--ca",
                      str(certs.ca), *flags], "certs": certs}


def _client_context(certs: Certificates, cert: Path | None = None, key: Path | None = None,
                    verify: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if not verify:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def _node_client(port: int, context: ssl.SSLContext | None) -> httpx.Client:
    """An HTTP client from the honest node's address (127.0.0.1)."""
    scheme = "https" if context else "http"
    return httpx.Client(base_url=f"{scheme}://127.0.0.1:{port}", timeout=20,
                        transport=httpx.HTTPTransport(verify=context or False,
                                                      local_address=NODE))


def _connect(port: int, context: ssl.SSLContext | None = None, source: str = OUTSIDER,
             timeout: float = 10) -> socket.socket:
    """A connection from ``source`` (TLS handshake done when ``context`` is given)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                    source_address=(source, 0))
    if context is None:
        return sock
    try:
        return context.wrap_socket(sock, server_hostname="127.0.0.1")
    except BaseException:
        sock.close()
        raise


def _exchange(sock: socket.socket, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data``, then read until the gateway closes (or ``timeout``)."""
    sock.settimeout(timeout)
    out = b""
    try:
        sock.sendall(data)
        while chunk := sock.recv(65536):
            out += chunk
            if b"\r\n\r\n" in out and b"connection: close" not in out.lower():
                break
    except (OSError, ssl.SSLError):
        pass
    return out


def _status(answer: bytes) -> int:
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    return int(match.group(1)) if match else 0


def _flood(port: int, n: int, context: ssl.SSLContext | None) -> list[socket.socket]:
    """``n`` idle connections from the outsider's address (TLS ones in parallel)."""
    if context is None:
        return [_connect(port) for _ in range(n)]
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(lambda _: _connect(port, context), range(n)))


def _post(path: str, body: bytes, headers: dict[str, str], length: int | None = None) -> bytes:
    """A raw HTTP/1.1 POST head (``length`` may declare more than ``body`` holds)."""
    fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/protobuf\r\n"
            f"content-length: {len(body) if length is None else length}\r\n{fields}\r\n"
            ).encode() + body


def _closed(sock: socket.socket, timeout: float = 5) -> bool:
    """Whether the other side has closed ``sock`` (EOF or reset) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


# --- the subclass still fits the installed uvicorn; the window is Flower's ------------------


def test_the_gateway_protocol_fits_the_installed_uvicorn_and_flowers_window():
    from flwr.common import constant
    from flwr.supercore import constant as supercore
    from flwr.superlink.routers.fleet import node_auth
    from uvicorn.protocols.http.h11_impl import H11Protocol

    assert gw.TIMESTAMP_HEADER == constant.TIMESTAMP_HEADER
    assert gw.TIMESTAMP_TOLERANCE == constant.TIMESTAMP_TOLERANCE
    assert gw.SYSTEM_TIME_TOLERANCE == constant.SYSTEM_TIME_TOLERANCE
    assert gw.FLEET_HTTP_PUBLIC_KEY_HEADER == supercore.FLEET_HTTP_PUBLIC_KEY_HEADER
    assert gw.FLEET_HTTP_SIGNATURE_HEADER == supercore.FLEET_HTTP_SIGNATURE_HEADER
    # the SuperLink's own check is still the open window the replay cache covers
    check = inspect.getsource(node_auth.authenticate_node)
    assert "-SYSTEM_TIME_TOLERANCE" in check and "TIMESTAMP_TOLERANCE + SYSTEM_TIME_TOLERANCE" \
        in check and 'timestamp.encode("ascii")' in check
    assert gw.REPLAY_WINDOW >= gw.MAX_AGE - gw.MIN_AGE == 310
    # what GatewayProtocol overrides or relies on in uvicorn's H11Protocol
    for name in ("connection_made", "connection_lost", "data_received", "handle_events",
                 "send_400_response", "on_response_complete"):
        assert callable(getattr(H11Protocol, name)), name
    events = inspect.getsource(H11Protocol.handle_events)
    assert f'"{gw.CONCURRENCY_WARNING}"' in events and "self.logger.warning(message)" in events
    assert "self.send_400_response(msg)" in events and "self.cycle = RequestResponseCycle(" \
        in events
    assert "self.logger = " in inspect.getsource(H11Protocol.__init__)
    init = inspect.signature(H11Protocol.__init__)
    assert list(init.parameters)[:4] == ["self", "config", "server_state", "app_state"]
    assert "self.conn.their_state" in inspect.getsource(H11Protocol.on_response_complete)
    protocol = gw.gateway_protocol(print, gw.Peers())
    assert issubclass(protocol, H11Protocol)
    config = uvicorn.Config(create_app("http://127.0.0.1:1", False), http=protocol,
                            ssl_cert_reqs=ssl.CERT_REQUIRED)
    config.load()
    assert config.http_protocol_class is protocol
    assert uvicorn.__version__.startswith("0.")  # a major release: read h11_impl.py again


# --- the signature rule in-process ----------------------------------------------------------


def test_the_signature_rule_in_process_fresh_valid_unused_and_by_the_certificates_key():
    log: list[str] = []
    seen: list[httpx.Request] = []
    mine, other = _new_key(), _new_key()
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    certificate = {("10.0.0.9", 555): public_key_to_bytes(mine.public_key())}

    async def superlink(request: httpx.Request) -> httpx.Response:
        await request.aread()
        seen.append(request)

        async def stream():  # as the network delivers it
            yield b"ok"

        return httpx.Response(200, content=stream())

    app = create_app("https://127.0.0.1:1", True, log=log.append, require_signature=True,
                     peer_key=lambda client: certificate.get(tuple(client) if client else ()),
                     transport=httpx.MockTransport(superlink))
    now = dt.datetime.now(dt.UTC)
    good = _signed(mine)
    bad = dict(good, **{gw.FLEET_HTTP_SIGNATURE_HEADER: _signed(mine)[
        gw.FLEET_HTTP_SIGNATURE_HEADER][:-8] + "AAAAAAA="})
    cases = [
        ({}, 401, "unsigned"),
        (_signed_at(mine, now, signer=other), 401, "bad signature"),
        (bad, 401, "bad signature"),
        (dict(good, **{gw.FLEET_HTTP_PUBLIC_KEY_HEADER: "not base64!"}), 401, "bad signature"),
        (_signed_at(mine, now - dt.timedelta(seconds=306)), 401, "stale timestamp"),
        (_signed_at(mine, now + dt.timedelta(seconds=30)), 401, "stale timestamp"),
        (_signed_at(mine, now.replace(tzinfo=None)), 401, "bad signature"),  # naive time
        (_signed(other), 401, "key is not the TLS client certificate's"),
        (good, 200, None),
        (good, 401, "replayed signature"),
        (_malleated(good), 401, "replayed signature"),  # (r, n - s): valid, other bytes
        (_signed_at(mine, now - dt.timedelta(seconds=300)), 200, None),  # old, still inside
    ]

    async def calls():
        transport = httpx.ASGITransport(app=app, client=("10.0.0.9", 555))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=transport, base_url="https://gateway") as c:
            out = [await c.post("/v1/fleet/push-object", content=b"x" * 1000, headers=h)
                   for h, *_ in cases]
            out.append(await c.get("/health"))  # needs no signature
            return out

    out = asyncio.run(calls())
    assert [r.status_code for r in out] == [code for _, code, _ in cases] + [200]
    assert len(seen) == 3 and [r.url.path for r in seen][-1] == "/health"
    assert out[0].headers["connection"] == "close"  # what the caller still sends is not read
    reasons = [re.search(r"\((.*)\)$", line) for line in log]
    assert [m.group(1) if m else None for m in reasons] == [why for _, code, why in cases
                                                             if code != 200]
    assert all(f"{REFUSED} 401 10.0.0.9:555 POST /v1/fleet/push-object" in line for line in log)


def test_the_replay_cache_forgets_after_the_window_and_never_evicts_early():
    clock = [0.0]
    cache = ReplayCache(capacity=3, window=310.0, clock=lambda: clock[0])
    assert [cache.add(b"k", f"t{i}") for i in range(3)] == [None] * 3
    assert cache.add(b"k", "t0") == "replay" and cache.add(b"k2", "t0") == "full"
    clock[0] = 309.9
    assert cache.add(b"k", "t1") == "replay"
    clock[0] = 310.0  # the window is over: Flower would refuse the timestamp anyway
    assert cache.add(b"k", "t1") is None and len(cache) == 1


# --- real processes --------------------------------------------------------------------------


def test_a_flood_of_idle_connections_does_not_lock_out_a_certificate_holder(tmp_path):
    certs = write_certificates(tmp_path / "certs", ["server.lab"])
    node_cert, node_key_file, node_key = _client_certificate(certs, tmp_path / "node", "node-0")
    flood_cert, flood_key_file, _ = _client_certificate(certs, tmp_path / "node", "node-1")
    # the held connections would time out after --header-timeout: the node must get
    # through long before that (the bound at the end), not once the flood has timed out
    with _running(**_tls(certs, "--client-ca", str(certs.ca), "--require-signature",
                         "--header-timeout", "300")) as (gateway, upstream):
        limits = Path(f"/proc/{gateway.proc.pid}/limits")
        if limits.exists():  # the soft limit on open files is raised to the hard one
            row = next(r for r in limits.read_text().splitlines() if "open files" in r)
            soft, hard = row.split()[3:5]
            assert soft == hard, row
        t0 = time.monotonic()
        flood = _flood(gateway.port, 600, None)  # TCP only: stuck before the handshake
        no_cert = _client_context(certs)
        refused_tls = 0
        for _ in range(20):  # TLS without a client certificate: refused in the handshake
            try:
                sock = _connect(gateway.port, no_cert)
            except (ssl.SSLError, OSError):
                refused_tls += 1
                continue
            flood.append(sock)
            answer = _exchange(sock, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", timeout=60)
            refused_tls += _status(answer) == 0
        assert refused_tls == 20
        # a certificate holder from the same address gets --max-per-peer connections, no more
        holder = _client_context(certs, flood_cert, flood_key_file)
        held = _flood(gateway.port, 40, holder)
        flood += held
        served = sum(_status(_exchange(s, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", 60))
                     == 200 for s in held)
        assert served == gw.MAX_PER_PEER
        # the honest node still gets through, health and a signed Fleet call
        with _node_client(gateway.port, _client_context(certs, node_cert, node_key_file)) as c:
            assert c.get("/health").status_code == 200
            answer = c.post("/v1/fleet/pull-messages", content=b"\x08\x01" * 100,
                            headers=_signed(node_key))
            assert answer.status_code == 200, answer.text
        assert upstream.received == 200
        assert [r[:2] for r in upstream.requests][-2:] == [("GET", "/health"),
                                                           ("POST", "/v1/fleet/pull-messages")]
        assert gateway.wait_for(rf"{CLOSED} {OUTSIDER}:\d+: over --max-per-peer 32 ")
        # generous for a loaded machine, and far below the 300 s header timeout
        assert time.monotonic() - t0 < 120, time.monotonic() - t0
        for sock in flood:
            sock.close()
    assert not [line for line in gateway.lines if "Traceback" in line]


def test_without_a_client_ca_or_a_per_peer_limit_the_same_flood_locks_everyone_out(tmp_path):
    """The mutation check: what the other test's defences stop does lock out a node."""
    certs = write_certificates(tmp_path / "certs", ["server.lab"])
    outsider = _client_context(certs, verify=False)
    old = ["--max-per-peer", "0", "--header-timeout", "0"]  # the gateway before this change
    for flags, expected in ((old, 503), (["--header-timeout", "60"], 200)):
        with _running(**_tls(certs, *flags)) as (gateway, _):
            flood = _flood(gateway.port, 600, outsider)  # handshakes done, then idle
            try:
                with _node_client(gateway.port, _client_context(certs)) as c:
                    answer = c.get("/health")
                assert answer.status_code == expected, (flags, answer.text)
                if expected == 503:
                    assert gateway.wait_for(rf"^\S+ {REFUSED} 503 127\.0\.0\.1:\d+ GET /health "
                                            r"\(over limit_concurrency\)$")
                else:
                    assert gateway.wait_for(rf"{CLOSED} {OUTSIDER}:\d+: over --max-per-peer")
            finally:
                for sock in flood:
                    sock.close()


def test_unsigned_badly_signed_or_replayed_bodies_never_reach_the_superlink(tmp_path):
    big = 64 * 1024 * 1024
    key = _new_key()
    with _running(["--insecure", "--require-signature"]) as (gateway, upstream):
        first = _signed(key)
        with _node_client(gateway.port, None) as c:  # one honest call, which goes through
            assert c.post("/v1/fleet/push-object", content=b"y" * 1000,
                          headers=first).status_code == 200
        assert upstream.received == 1000
        attempts = {
            "unsigned": {},
            "bad signature": _signed_at(key, dt.datetime.now(dt.UTC), signer=_new_key()),
            "replayed signature": first,
        }
        for why, headers in attempts.items():
            sock = _connect(gateway.port, source=NODE)
            t0 = time.monotonic()
            answer = _exchange(sock, _post("/v1/fleet/push-object", b"z" * 262144, headers,
                                           length=big), timeout=60)
            assert _status(answer) == 401, (why, answer[:300])
            sent = 262144  # the gateway answered and closed: the rest cannot be pushed
            sock.settimeout(120)  # where it stopped reading but kept the connection open
            try:
                for _ in range(big // 262144):
                    sock.sendall(b"z" * 262144)
                    sent += 262144
            except OSError:
                pass
            sock.close()
            assert sent < 32 * 1024 * 1024, (why, sent)
            # closed at once, not held open until the pushes time out (120 s); generous
            # for a loaded machine
            assert time.monotonic() - t0 < 60, (why, time.monotonic() - t0)
            assert gateway.wait_for(rf"{REFUSED} 401 127\.0\.0\.1:\d+ POST /v1/fleet/push-object"
                                    rf" \({why}\)$")
        # the same with httpx streaming the whole 64 MiB: refused, or cut off, never forwarded
        key2 = _new_key()

        def body() -> Iterator[bytes]:
            for _ in range(64):
                yield b"w" * (1024 * 1024)

        with _node_client(gateway.port, None) as c:
            try:
                status = c.post("/v1/fleet/push-object", content=body(),
                                headers=_signed_at(key2, dt.datetime.now(dt.UTC),
                                                   signer=key)).status_code
            except httpx.TransportError:
                status = 0
        assert status in (401, 0)
        time.sleep(0.3)
        assert upstream.received == 1000  # not one byte of any refused body arrived
        assert [r[:2] for r in upstream.requests] == [("POST", "/v1/fleet/push-object")]


def test_every_refusal_is_logged_with_the_real_peer_and_forwarding_claims_stay_outside():
    key = _new_key()
    with _running(["--insecure", "--require-signature", "--max-per-peer", "3",
                   "--header-timeout", "1"]) as (gateway, upstream):
        port = gateway.port

        def one(data: bytes) -> tuple[int, str]:
            sock = _connect(port, source=NODE)
            peer = f"127.0.0.1:{sock.getsockname()[1]}"
            answer = _exchange(sock, data)
            sock.close()
            return _status(answer), peer

        expected: list[tuple[str, str]] = []  # (regex for the line, its peer)
        for method, path, code in (("TRACE", "/", 404), ("TRACE", "/health", 405),
                                   ("PROPFIND", "/v1/fleet/pull-messages", 405),
                                   ("OPTIONS", "*", 404), ("DELETE", "/v1/control/x", 403)):
            status, peer = one(f"{method} {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            assert status == code, (method, path, status)
            expected.append((rf"{REFUSED} {code} {peer} {method} {re.escape(path)}$", peer))
        status, peer = one(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\n"
                           b"upgrade: websocket\r\nsec-websocket-version: 13\r\n"
                           b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        assert status == 404  # no WebSocket upgrade: an ordinary refused request
        expected.append((rf"{REFUSED} 404 {peer} GET /$", peer))
        status, peer = one(b"GARBAGE\r\n\r\n")
        assert status == 400
        expected.append((rf"{REFUSED} 400 {peer} - - \(malformed request", peer))
        status, peer = one(_post("/v1/fleet/pull-messages", b"x", {}))
        assert status == 401
        expected.append((rf"{REFUSED} 401 {peer} POST /v1/fleet/pull-messages \(unsigned\)$",
                         peer))
        signed = _signed(key)
        claims = {"x-forwarded-for": "6.6.6.6", "forwarded": "for=6.6.6.6",
                  "x-real-ip": "6.6.6.6", "x-forwarded-host": "evil", "x-forwarded-proto": "h"}
        status, peer = one(_post("/v1/fleet/pull-messages", b"x", {**signed, **claims}))
        assert status == 200
        status, peer = one(_post("/v1/fleet/pull-messages", b"x", signed))
        assert status == 401
        expected.append((rf"{REFUSED} 401 {peer} POST /v1/fleet/pull-messages "
                         r"\(replayed signature\)$", peer))
        status, peer = one(_post("/v1/fleet/unauthorized", b"x", _signed(key)))
        assert status == 401  # the SuperLink's own refusal, passed on and logged
        expected.append((rf"{UPSTREAM_REFUSED} 401 {peer} POST /v1/fleet/unauthorized$", peer))
        # a slow head (and an idle connection) is closed after --header-timeout
        slow = _connect(port, source=NODE)
        slow.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nhost: x\r\n")
        idle = _connect(port, source=NODE)
        assert _closed(slow, 60) and _closed(idle, 60)
        for sock in (slow, idle):
            expected.append((rf"{CLOSED} 127\.0\.0\.1:{sock.getsockname()[1]}: no complete "
                             r"request head in 1 s$", ""))
            sock.close()
        # the fourth connection from one address is closed at once; the three before it
        # only later, by --header-timeout (the reason logged for each)
        held = [_connect(port, source=NODE) for _ in range(3)]
        extra = _connect(port, source=NODE)
        assert _closed(extra, 60)
        expected.append((rf"{CLOSED} 127\.0\.0\.1:{extra.getsockname()[1]}: over "
                         r"--max-per-peer 3 connections from 127\.0\.0\.1$", ""))
        for sock in held:
            assert _closed(sock, 60)
            expected.append((rf"{CLOSED} 127\.0\.0\.1:{sock.getsockname()[1]}: no complete "
                             r"request head in 1 s$", ""))
        for sock in [*held, extra]:
            sock.close()
        for pattern, _ in expected:
            assert gateway.wait_for(pattern), (pattern, gateway.lines)
        # what reached upstream: the real peer, none of the client's claims
        forwarded = upstream.requests[0][2]  # the call that claimed 6.6.6.6
        assert forwarded["x-forwarded-for"] == ["127.0.0.1"]
        for name in ("forwarded", "x-real-ip", "x-forwarded-host", "x-forwarded-proto"):
            assert name not in forwarded, name
        assert all(h.get("x-forwarded-for") == ["127.0.0.1"] for *_, h in upstream.requests)
        assert len(upstream.requests) == 2


def test_a_signature_by_another_key_than_the_client_certificates_is_refused(tmp_path):
    certs = write_certificates(tmp_path / "certs", ["server.lab"])
    cert, key_file, key = _client_certificate(certs, tmp_path / "node", "node-0")
    with _running(**_tls(certs, "--client-ca", str(certs.ca),
                         "--require-signature")) as (gateway, upstream):
        with _node_client(gateway.port, _client_context(certs, cert, key_file)) as c:
            other = c.post("/v1/fleet/pull-messages", content=b"x", headers=_signed(_new_key()))
            own = c.post("/v1/fleet/pull-messages", content=b"x", headers=_signed(key))
        assert (other.status_code, own.status_code) == (401, 200)
        assert gateway.wait_for(rf"{REFUSED} 401 127\.0\.0\.1:\d+ POST /v1/fleet/pull-messages "
                                r"\(key is not the TLS client certificate's\)$")
        assert len(upstream.requests) == 1


def test_the_gateway_refuses_client_ca_without_tls_and_an_impossible_per_peer_limit():
    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "experiments.deploy.fleet_gateway",
                               "--listen", "127.0.0.1:1", "--upstream", "127.0.0.1:2", *flags],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    no_tls = run("--insecure", "--client-ca", "ca.crt")
    assert no_tls.returncode == 2 and "--client-ca needs TLS" in no_tls.stderr
    too_many = run("--insecure", "--max-per-peer", "512")
    assert too_many.returncode == 2 and "--max-per-peer must be 0" in too_many.stderr


# --- only registered nodes' bodies, bodies that keep coming, bounded per node ---------------


def _registry(path: Path, *keys: ec.EllipticCurvePrivateKey, unregistered=()) -> Path:
    """A SQLite file with the SuperLink's ``node`` table as Flower 1.42 keeps it (the
    columns the gateway reads), ``keys`` registered and ``unregistered`` removed."""
    import sqlite3

    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE node (node_id INTEGER, status TEXT, public_key BLOB UNIQUE)")
        for i, key in enumerate(keys):
            db.execute("INSERT INTO node VALUES (?, 'online', ?)",
                       (i, public_key_to_bytes(key.public_key())))
        for i, key in enumerate(unregistered):
            db.execute("INSERT INTO node VALUES (?, 'unregistered', ?)",
                       (100 + i, public_key_to_bytes(key.public_key())))
        db.commit()
    return path


def test_only_a_registered_nodes_body_is_forwarded(tmp_path):
    """The outsider of a gateway run without client certificates signs with a key of its
    own: refused from the headers (401), its body never forwarded; a registered node's
    call passes; an unregistered (removed) node's does not."""
    node, gone, outsider = _new_key(), _new_key(), _new_key()
    registry = _registry(tmp_path / "state.db", node, unregistered=[gone])
    with _running(["--insecure", "--require-signature", "--registered-db", str(registry)]
                  ) as (gateway, upstream):
        with _node_client(gateway.port, None) as c:
            assert c.post("/v1/fleet/push-object", content=b"y" * 1000,
                          headers=_signed(node)).status_code == 200
            for who in (outsider, gone):
                assert c.post("/v1/fleet/push-object", content=b"z" * 100000,
                              headers=_signed(who)).status_code == 401
            # asking to join is Flower's to answer (its "not registered" refusal, which the
            # SuperNode reports), with a small body only
            assert c.post("/v1/fleet/activate-node", content=b"a" * 200,
                          headers=_signed(outsider)).status_code == 200
            assert c.post("/v1/fleet/activate-node", content=b"b" * 100000,
                          headers=_signed(outsider)).status_code == 413
        assert gateway.wait_for(r"\(key not registered\)$")
        time.sleep(0.3)
        assert upstream.received == 1200
    # the real SuperLink's schema, as `fedpriv deploy superlink` passes it, is covered by
    # tests/test_deploy.py: with a wrong query no node's call would pass


async def _streamed(data: bytes):
    """An answer body as the network delivers it (the gateway streams it back)."""
    yield data


def test_a_body_that_stops_coming_is_cut_and_one_node_cannot_hold_the_superlink():
    """A signed head whose body never arrives is answered 408 after the idle bound; one
    node's requests open upstream at once are capped; a key that cannot verify (X25519)
    is a 401, not a crash."""
    from cryptography.hazmat.primitives.asymmetric import x25519

    key, other = _new_key(), _new_key()
    app_log: list[str] = []

    class Stalled(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            async for _ in request.stream:  # type: ignore[union-attr]
                pass
            return httpx.Response(200, content=_streamed(b"ok"))

    app = create_app("http://superlink", False, log=app_log.append, transport=Stalled(),
                     require_signature=True, body_idle=0.3, body_deadline=60)

    async def stalled_body() -> dict:
        sent: list[dict] = []

        async def receive() -> dict:
            if not sent:
                sent.append({})
                return {"type": "http.request", "body": b"x" * 10, "more_body": True}
            await asyncio.sleep(300)  # the rest never comes
            return {"type": "http.disconnect"}

        answer: dict = {}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]

        headers = [(k.encode(), v.encode()) for k, v in _signed(key).items()]
        scope = {"type": "http", "method": "POST", "path": "/v1/fleet/push-object",
                 "raw_path": b"/v1/fleet/push-object", "query_string": b"",
                 "headers": [(b"content-length", b"1000"), *headers],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 9092),
                 "scheme": "http", "http_version": "1.1", "root_path": ""}
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), 120)
        return answer

    t0 = time.monotonic()
    assert asyncio.run(stalled_body()) == {"status": 408}
    # cut after the 0.3 s idle bound, not at the 60 s deadline (generous for a loaded machine)
    assert time.monotonic() - t0 < 30
    assert any("(body too slow)" in line for line in app_log), app_log

    # one node with IN_FLIGHT_PER_KEY requests open upstream: its next one is refused (429)
    async def crowded() -> list[int]:
        release = asyncio.Event()
        upstream: list[httpx.Request] = []  # the requests held open upstream

        async def until_held(n: int) -> None:
            deadline = time.monotonic() + 120
            while len(upstream) < n:
                assert time.monotonic() < deadline, len(upstream)
                await asyncio.sleep(0.01)

        class Held(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                upstream.append(request)
                await release.wait()
                return httpx.Response(200, content=_streamed(b"ok"))

        held = create_app("http://superlink", False, log=app_log.append, transport=Held(),
                          require_signature=True)
        async with held.router.lifespan_context(held), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=held), base_url="http://gw") as c:
            first = [asyncio.create_task(c.post("/v1/fleet/pull-messages",
                                                headers=_signed(key)))
                     for _ in range(gw.IN_FLIGHT_PER_KEY)]
            await until_held(gw.IN_FLIGHT_PER_KEY)
            over = await c.post("/v1/fleet/pull-messages", headers=_signed(key))
            bystander = asyncio.create_task(c.post("/v1/fleet/pull-messages",
                                                   headers=_signed(other)))
            await until_held(gw.IN_FLIGHT_PER_KEY + 1)  # another key's passes meanwhile
            release.set()
            done = await asyncio.gather(*first, bystander)
            public = x25519.X25519PrivateKey.generate().public_key()
            odd = {**_signed(key), gw.FLEET_HTTP_PUBLIC_KEY_HEADER: b64encode(
                public.public_bytes(serialization.Encoding.PEM,
                                    serialization.PublicFormat.SubjectPublicKeyInfo)).decode()}
            x = await c.post("/v1/fleet/pull-messages", headers=odd)
            return [over.status_code, *[r.status_code for r in done][-1:], x.status_code]

    assert asyncio.run(crowded()) == [429, 200, 401]


def test_a_tls_handshake_that_never_starts_is_dropped_within_seconds(tmp_path):
    """A connection that never sends its ClientHello holds a descriptor only for the
    handshake timeout (5 s, not asyncio's 60 s)."""
    certs = write_certificates(tmp_path / "certs", ["127.0.0.1"])
    with _running(**_tls(certs, "--client-ca", str(certs.ca))) as (gateway, _):
        silent = [_connect(gateway.port) for _ in range(20)]
        t0 = time.monotonic()
        assert all(_closed(s, 60) for s in silent)
        # after the 5 s handshake timeout, not asyncio's 60 s (generous for a loaded machine)
        assert time.monotonic() - t0 < 30, time.monotonic() - t0
        for s in silent:
            s.close()
