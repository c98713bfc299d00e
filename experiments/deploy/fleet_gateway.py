"""A fleet-only TLS gateway: the one public port of a deployment.

Flower 1.41's SuperLink serves its Fleet (SuperNodes), Control (``flwr run/ls/log``,
``flwr supernode register``) and Runtime (SuperExec, ServerApp) APIs from one HTTP
server, told apart only by path, and the open-source Control API needs no login. So
``fedpriv deploy superlink`` binds the SuperLink to loopback and puts this gateway on the
public address: it terminates TLS with the deployment's server certificate and forwards
to the SuperLink only ``POST /v1/fleet/<name>`` (every call a SuperNode makes; each is
signed per request by the node's key, which the SuperLink checks) and ``GET /health``.
Anything else is refused with a short explanation and one log line on the operator's
side. Built on uvicorn (HTTP/1.1 + TLS), Starlette (routing) and httpx (upstream), the
libraries Flower's own HTTP APIs use; bodies stream through with a size bound.

Against outsiders (each optional, so older callers keep working):

* ``--client-ca``: mutual TLS. A peer without a certificate from that CA never completes
  the handshake, so it never reaches the app nor uvicorn's ``limit_concurrency`` count.
* ``--require-signature``: every Fleet POST must carry Flower's node-auth headers
  (``flwr-public-key``, ``flwr-timestamp``, ``flwr-signature``: ECDSA SHA-256 over the
  ASCII timestamp) with a fresh timestamp and a valid signature, checked from the headers
  before any body byte is forwarded (the SuperLink itself reads the whole body first).
  A signature covers only its timestamp, and Flower's SuperLink
  (``flwr/superlink/routers/fleet/node_auth.py``) accepts it while its age is inside
  ``(-SYSTEM_TIME_TOLERANCE, TIMESTAMP_TOLERANCE + SYSTEM_TIME_TOLERANCE)`` = (-5 s,
  305 s): one captured header set would authorize any Fleet call for about five
  minutes. So the gateway keeps every accepted (public key, timestamp) for that window
  (310 s, bounded to ``--replay-cache`` entries) and refuses it a second time. With
  ``--client-ca`` too, the signing key must be the key of the peer's TLS certificate;
  with ``--registered-db`` (the SuperLink's SQLite state, read-only), a key the SuperLink
  registered, so an outsider's own key pair pushes no body. A body must keep coming
  (:data:`BODY_IDLE`, :data:`BODY_DEADLINE`) and one key has at most
  :data:`IN_FLIGHT_PER_KEY` requests open upstream and :data:`REPLAY_PER_KEY` signatures
  in the window, so one node cannot hold the SuperLink's connections or fill the cache.
* with TLS, a handshake must finish within :data:`HANDSHAKE_TIMEOUT` s (asyncio's
  default is 60 s); before it finishes a connection is not counted per address (asyncio
  makes the protocol only after the handshake), which a firewall's per-source limit covers.
* always: at most ``--max-per-peer`` connections from one address (so no single peer
  fills ``limit_concurrency``), a complete request head within ``--header-timeout``
  seconds, every method caught and every refusal (uvicorn's own 400 and 503 included)
  logged with the real peer; forwarding headers from outside (X-Forwarded-*, Forwarded,
  X-Real-IP) are dropped and X-Forwarded-For is set to the real peer, which the
  SuperLink's uvicorn trusts from loopback. Upstream 401/403 answers are logged too.
  Not logged: a TLS handshake that fails (no or a wrong client certificate), which
  asyncio ends before the HTTP protocol sees the connection.

``python -m experiments.deploy.fleet_gateway --listen HOST:PORT --upstream 127.0.0.1:PORT
(--cert server.pem --key server.key --ca ca.crt [--client-ca ca.crt] | --insecure)
[--require-signature [--registered-db STATE.DB]] [--max-per-peer N] [--header-timeout S]``
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import contextlib
import datetime as dt
import functools
import hashlib
import re
import socket
import ssl
import sys
import time
from base64 import b64decode
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import h11
import httpx
import uvicorn
from cryptography import x509
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr

FLEET_PREFIX = "/v1/fleet/"
# Fleet routes are lower-case words joined by '-' (register-node, pull-messages, ...):
# no dots, no '%', no second '/', so no path can leave the prefix once forwarded.
FLEET_PATH = re.compile(rb"/v1/fleet/[a-z][a-z0-9-]{0,63}")
MAX_BODY = 256 * 1024 * 1024  # Flower chunks arrays at 5 MiB and caps FABs at 10 MB
READY = "fleet gateway ready"
REFUSED = "gateway refused"  # an HTTP answer the gateway (or uvicorn under it) refused with
CLOSED = "gateway closed"  # a connection closed without an answer
UPSTREAM_REFUSED = "superlink refused"  # the SuperLink's own 401/403, with the real peer
LIMIT_CONCURRENCY = 512
MAX_PER_PEER = 32
HEADER_TIMEOUT = 10.0
# Flower's node-auth headers and window (flwr.common.constant, flwr.supercore.constant;
# copied so that importing READY or bind does not load Flower; a test checks they match):
# the SuperLink accepts a signature while its age is in (-5 s, 305 s)
# (flwr/superlink/routers/fleet/node_auth.py); an accepted one is remembered for the whole
# span that a copy of it could still be accepted: 310 s from the moment it is seen.
TIMESTAMP_HEADER = "flwr-timestamp"
FLEET_HTTP_PUBLIC_KEY_HEADER = "flwr-public-key"
FLEET_HTTP_SIGNATURE_HEADER = "flwr-signature"
TIMESTAMP_TOLERANCE = 300
SYSTEM_TIME_TOLERANCE = 5
MIN_AGE = -SYSTEM_TIME_TOLERANCE
MAX_AGE = TIMESTAMP_TOLERANCE + SYSTEM_TIME_TOLERANCE
REPLAY_WINDOW = float(MAX_AGE - MIN_AGE)
REPLAY_CACHE = 262144  # entries, about 150 bytes each
REPLAY_PER_KEY = 16384  # one key's calls in a window (about 53 a second, sustained)
IN_FLIGHT_PER_KEY = 32  # one key's requests open upstream at once
JOINING = frozenset({"/v1/fleet/register-node", "/v1/fleet/activate-node"})
JOINING_BODY = 64 * 1024  # bytes: a node's request to join holds its key and a few fields
UPSTREAM_CONNECTIONS = 512
BODY_IDLE = 30.0  # s a request body may pause between chunks
BODY_DEADLINE = 300.0  # s a whole request body may take
HANDSHAKE_TIMEOUT = 5.0  # s for a TLS handshake (asyncio's default: 60)
SIGNATURE_HEADERS = (FLEET_HTTP_PUBLIC_KEY_HEADER, TIMESTAMP_HEADER, FLEET_HTTP_SIGNATURE_HEADER)
# RFC 9110 hop-by-hop fields, the Host (httpx sets the upstream's), and what uvicorn adds
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                  "host"})
# what a client could claim about where a request came from (the gateway sets its own)
_CLAIMS = frozenset({"forwarded", "x-real-ip", "x-client-ip", "true-client-ip",
                     "cf-connecting-ip", "via"})
_NOT_BACK = _HOP | {"server", "date"}
METHODS_ALL = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")
OPERATOR_ONLY = ("this port serves only Flower's Fleet API (SuperNodes). The Control and "
                 "Runtime APIs (flwr run, ls, log, stop, supernode register/unregister) "
                 "are served only on the SuperLink host's loopback address: run operator "
                 "commands on that host.\n")
UNSIGNED = ("a Fleet call must carry a valid, fresh, not yet used SuperNode signature "
            "(flwr-public-key, flwr-timestamp, flwr-signature).\n")

Log = Callable[[str], None]
Peer = tuple[str, int]
PeerKey = Callable[[Peer | None], bytes | None]


class _TooLarge(Exception):
    """The request body passed the gateway's bound."""


class _TooSlow(Exception):
    """The request body stopped arriving, or took too long in all."""


def _printable(raw: bytes, limit: int = 200) -> str:
    text = raw[:limit].decode("ascii", "backslashreplace")
    return "".join(c if c.isprintable() else "?" for c in text)


def _stamp() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _peer(client: Peer | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


class ReplayCache:
    """Accepted (public key, timestamp) pairs for :data:`REPLAY_WINDOW` seconds, at most
    ``capacity`` of them: a second use inside the window is a replay."""

    def __init__(self, capacity: int = REPLAY_CACHE, window: float = REPLAY_WINDOW,
                 clock: Callable[[], float] = time.monotonic,
                 per_key: int = REPLAY_PER_KEY) -> None:
        self.capacity, self.window, self.clock = capacity, window, clock
        self.per_key = per_key  # so that one key cannot fill the cache for every node
        self._until: OrderedDict[bytes, tuple[float, bytes]] = OrderedDict()  # in order
        self._count: dict[bytes, int] = {}  # entries per key

    def __len__(self) -> int:
        return len(self._until)

    def add(self, key: bytes, timestamp: str) -> str | None:
        """Remember one use; None if fresh, else why it is refused ("replay", "full")."""
        now = self.clock()
        while self._until:
            digest, (until, owner) = next(iter(self._until.items()))
            if until > now:
                break
            del self._until[digest]
            left = self._count.get(owner, 1) - 1
            if left > 0:
                self._count[owner] = left
            else:
                self._count.pop(owner, None)
        digest = hashlib.sha256(len(key).to_bytes(4, "big") + key + timestamp.encode()).digest()
        if digest in self._until:
            return "replay"
        if len(self._until) >= self.capacity:  # never evict early: that would allow a replay
            return "full"
        if self._count.get(key, 0) >= self.per_key:
            return "key over its rate"
        self._until[digest] = (now + self.window, key)
        self._count[key] = self._count.get(key, 0) + 1
        return None


def check_signature(headers: Any, replay: ReplayCache, peer_key: bytes | None = None,
                    require_peer_key: bool = False,
                    now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
                    registered: Callable[[bytes], bool] | None = None) -> str | None:
    """Why a Fleet call's node-auth headers are refused (None: accepted and remembered):
    Flower's own check (flwr/superlink/routers/fleet/node_auth.py), made before any body
    byte is read, plus the replay cache, with mutual TLS the certificate's key, and with
    ``registered`` a key the SuperLink has registered."""
    # Flower's own helpers, lazily: importing flwr takes about half a second
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_public_key,
        public_key_to_bytes,
        verify_signature,
    )
    try:
        values = [headers.get(name) for name in SIGNATURE_HEADERS]
        if None in values:
            return "unsigned"
        encoded, timestamp, signature = values
        public = bytes_to_public_key(b64decode(encoded, validate=True))
        raw_signature = b64decode(signature, validate=True)
        age = (now() - dt.datetime.fromisoformat(timestamp)).total_seconds()
        if not MIN_AGE < age < MAX_AGE:
            return "stale timestamp"
        if not verify_signature(public, timestamp.encode("ascii"), raw_signature):
            return "bad signature"
    except (ValueError, TypeError, UnicodeError, binascii.Error, AttributeError):
        return "bad signature"  # AttributeError: a key that cannot verify (e.g. X25519)
    key = public_key_to_bytes(public)  # one form for every encoding of the same key
    if require_peer_key and key != peer_key:
        return "key is not the TLS client certificate's"
    if registered is not None and not registered(key):
        return "key not registered"
    verdict = replay.add(key, timestamp)
    return {"replay": "replayed signature", "full": "replay cache full"}.get(verdict or "")


class RegisteredKeys:
    """The node keys the SuperLink has registered, read (read-only) from its SQLite state
    (Flower 1.42's ``node`` table: ``public_key``, ``status``), so that a body is
    forwarded only for a node the operator admitted. A key found stays known for
    ``ttl`` seconds; an unknown one is looked up again at most every ``ttl`` seconds."""

    def __init__(self, database: str, ttl: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.database, self.ttl, self.clock = database, ttl, clock
        self._seen: dict[bytes, tuple[bool, float]] = {}

    def __call__(self, key: bytes) -> bool:
        now = self.clock()
        known = self._seen.get(key)
        if known is not None and known[1] > now:
            return known[0]
        answer = self._lookup(key)
        if len(self._seen) > 65536:
            self._seen.clear()
        self._seen[key] = (answer, now + self.ttl)
        return answer

    def _lookup(self, key: bytes) -> bool:
        import sqlite3

        try:
            with contextlib.closing(sqlite3.connect(f"file:{self.database}?mode=ro",
                                                    uri=True, timeout=2.0)) as db:
                row = db.execute("SELECT 1 FROM node WHERE public_key = ? AND "
                                 "(status IS NULL OR status != 'unregistered')",
                                 (key,)).fetchone()
        except sqlite3.Error:
            return False  # not readable yet: refuse, the node retries
        return row is not None


def create_app(upstream: str, verify: ssl.SSLContext | bool, *, max_body: int = MAX_BODY,
               log: Log = print, transport: httpx.AsyncBaseTransport | None = None,
               require_signature: bool = False, peer_key: PeerKey | None = None,
               replay_cache: int = REPLAY_CACHE,
               registered: Callable[[bytes], bool] | None = None,
               body_idle: float = BODY_IDLE, body_deadline: float = BODY_DEADLINE) -> Starlette:
    """The gateway's ASGI app forwarding Fleet calls to ``upstream`` (``scheme://host:port``);
    ``transport`` replaces the network in tests. ``require_signature`` refuses Fleet calls
    without a fresh, valid, unused node signature; ``peer_key`` (given a peer's
    ``(host, port)``, its TLS client certificate's public key as Flower's bytes) makes the
    signing key have to be that one; ``registered`` (a key -> bool) that it be a node the
    SuperLink registered. A body must keep arriving (``body_idle`` s between chunks,
    ``body_deadline`` s in all), and one key has at most :data:`IN_FLIGHT_PER_KEY`
    requests open upstream, so no one holds the SuperLink's connections."""
    timeout = httpx.Timeout(connect=5.0, read=120.0, write=60.0, pool=30.0)
    client: httpx.AsyncClient | None = None
    replay = ReplayCache(replay_cache)
    in_flight: dict[bytes, int] = {}

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        nonlocal client
        async with httpx.AsyncClient(base_url=upstream, verify=verify, timeout=timeout,
                                     transport=transport, follow_redirects=False,
                                     limits=httpx.Limits(
                                         max_connections=UPSTREAM_CONNECTIONS)) as c:
            client = c
            yield

    async def forward(request: Request) -> Response:
        route = _route(request, max_body)
        if not isinstance(route, str):
            return _refuse(request, *route, log)
        path = route
        signer = b""
        bound = max_body
        if require_signature and path != "/health":
            mine = peer_key(request.scope.get("client")) if peer_key else None
            # a node not yet admitted asks to be: Flower's SuperLink answers that itself
            # (its "not registered" refusal, which the SuperNode reports), so those two
            # calls pass without a registered key, with a small body
            joining = path in JOINING
            if joining:
                bound = min(max_body, JOINING_BODY)
                declared = request.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > bound:
                    return _refuse(request, 413, f"request body over {bound} bytes.\n", log)
            why = check_signature(request.headers, replay, mine, peer_key is not None,
                                  registered=None if joining else registered)
            if why is not None:
                status = {"replay cache full": 503, "key over its rate": 429}.get(why, 401)
                return _refuse(request, status, UNSIGNED, log, why)
            signer = request.headers[FLEET_HTTP_PUBLIC_KEY_HEADER].encode()
            if in_flight.get(signer, 0) >= IN_FLIGHT_PER_KEY:
                return _refuse(request, 429, f"over {IN_FLIGHT_PER_KEY} requests at once "
                               "from one node.\n", log, "too many in flight")
        in_flight[signer] = in_flight.get(signer, 0) + 1
        try:
            return await _send(request, path, bound)
        finally:
            left = in_flight.get(signer, 1) - 1
            if left > 0:
                in_flight[signer] = left
            else:
                in_flight.pop(signer, None)

    async def _send(request: Request, path: str, max_body: int) -> Response:
        """Forward one accepted request upstream (its body bounded to ``max_body``) and
        stream the answer back."""
        headers = [(k, v) for k, v in request.headers.items() if not _claim(k)]
        if request.client:
            headers.append(("x-forwarded-for", request.client.host))
        assert client is not None
        sent = client.build_request(request.method, path, headers=headers,
                                    content=_bounded(request, max_body, body_idle,
                                                     body_deadline)
                                    if request.method == "POST" else None)
        try:
            answer = await client.send(sent, stream=True)
        except _TooLarge:
            return _refuse(request, 413, f"request body over {max_body} bytes.\n", log)
        except _TooSlow as exc:
            return _refuse(request, 408, f"request body too slow ({exc}).\n", log,
                           "body too slow")
        except ClientDisconnect:
            log(f"{_stamp()} {CLOSED} {_peer(request.scope.get('client'))}: it went away "
                f"while sending {path}")
            return Response(status_code=400, headers={"connection": "close"})
        except httpx.HTTPError as exc:
            log(f"{_stamp()} gateway: the SuperLink did not answer {path}: "
                f"{type(exc).__name__}: {exc}")
            return PlainTextResponse("502: the SuperLink behind this gateway did not "
                                     "answer.\n", status_code=502)
        if answer.status_code in (401, 403):
            log(f"{_stamp()} {UPSTREAM_REFUSED} {answer.status_code} "
                f"{_peer(request.scope.get('client'))} {request.method} {path}")
        back = [(k, v) for k, v in answer.headers.multi_items() if k.lower() not in _NOT_BACK]
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                                 headers=dict(back), background=BackgroundTask(answer.aclose))

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        """Every HTTP request, whatever its method or path (even ``OPTIONS *``)."""
        request = Request(scope, receive)
        response = await forward(request)
        await response(scope, receive, send)

    app = Starlette(lifespan=lifespan)
    app.router.default = endpoint  # no routes: nothing is answered behind our back
    return app


def _claim(name: str) -> bool:
    """A header the gateway does not forward: hop-by-hop, or a claim about the client."""
    low = name.lower()
    return low in _HOP or low in _CLAIMS or low.startswith("x-forwarded-")


def _route(request: Request, max_body: int) -> str | tuple[int, str]:
    """The upstream path a request goes to (``/health`` or one Fleet route), or the
    (status, reason) it is refused with."""
    raw: bytes = request.scope.get("raw_path") or b""
    query = request.scope.get("query_string") or b""
    is_fleet = raw.startswith(FLEET_PREFIX.encode())
    if raw == b"/health" and not query:
        if request.method not in ("GET", "HEAD"):
            return 405, "/health takes GET only.\n"
        path = "/health"
    elif is_fleet and FLEET_PATH.fullmatch(raw) and not query:
        if request.method != "POST":
            return 405, "the Fleet API takes POST only.\n"
        path = raw.decode("ascii")
    elif raw.startswith((b"/v1/control", b"/v1/runtime")):
        return 403, OPERATOR_ONLY
    else:
        return 404, "not a Fleet API path; " + OPERATOR_ONLY
    declared = request.headers.get("content-length", "")
    if declared and (not declared.isdigit() or int(declared) > max_body):
        return 413, f"request body over {max_body} bytes.\n"
    return path


def _refuse(request: Request, status: int, body: str, log: Log, why: str = "") -> Response:
    """The refusal, with one log line on the operator's side; the connection closes after
    it, so a body the caller is still sending is not read on."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    log(f"{_stamp()} {REFUSED} {status} {_peer(request.scope.get('client'))} "
        f"{_printable(request.method.encode(), 16)} {_printable(raw)}"
        + (f" ({why})" if why else ""))
    return PlainTextResponse(f"{status}: {body}", status_code=status,
                             headers={"connection": "close"})


async def _bounded(request: Request, max_body: int, idle: float = BODY_IDLE,
                   deadline: float = BODY_DEADLINE) -> AsyncIterator[bytes]:
    """The request body as it streams in; :class:`_TooLarge` past ``max_body`` bytes,
    :class:`_TooSlow` when it pauses ``idle`` s or takes over ``deadline`` s in all."""
    seen = 0
    end = time.monotonic() + deadline
    chunks = request.stream().__aiter__()
    while True:
        wait = min(idle, end - time.monotonic())
        if wait <= 0:
            raise _TooSlow(f"not complete after {deadline:g} s")
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), wait)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _TooSlow(f"no byte for {wait:g} s") from None
        seen += len(chunk)
        if seen > max_body:
            raise _TooLarge
        yield chunk


# --- the connection level: uvicorn's h11 protocol, watched ----------------------------------

class Peers:
    """What the connection level knows and the app asks: open connections per address, and
    each TLS client certificate's public key (Flower's byte form) by ``(host, port)``."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self.keys: dict[Peer, bytes] = {}
        self.over: dict[str, int] = {}  # addresses now past the limit: connections closed

    def key(self, client: Peer | None) -> bytes | None:
        """The public key of ``client``'s TLS certificate, if it showed one."""
        return self.keys.get(tuple(client)) if client else None  # type: ignore[arg-type]


def _certificate_key(transport: asyncio.BaseTransport) -> bytes | None:
    """The peer's TLS client certificate's public key, in Flower's byte form."""
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes  # lazy, as above
    ssl_object = transport.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return None
    try:
        return public_key_to_bytes(x509.load_der_x509_certificate(der).public_key())  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return None


def gateway_protocol(log: Log, peers: Peers, *, max_per_peer: int = MAX_PER_PEER,
                     header_timeout: float = HEADER_TIMEOUT) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with the gateway's connection rules: at most
    ``max_per_peer`` connections per address (0: no limit), a complete request head
    within ``header_timeout`` seconds (0: none), the peer's certificate key recorded in
    ``peers``, and uvicorn's own 400 and 503 answers logged with the peer. Built on
    uvicorn 0.49's ``H11Protocol``; tests/test_deploy_gateway.py checks that it fits."""

    class GatewayProtocol(H11Protocol):
        _refused = False
        _address: str | None = None
        _head_timer: asyncio.TimerHandle | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.logger = _Watched(self.logger, self)  # type: ignore[assignment]

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            client = get_remote_addr(transport)
            address = client[0] if client else "?"
            if max_per_peer and peers.open.get(address, 0) >= max_per_peer:
                self._refused, self.transport = True, transport
                closed = peers.over.get(address, 0)
                peers.over[address] = closed + 1
                if not closed:  # once while the address stays over the limit
                    log(f"{_stamp()} {CLOSED} {_peer(client)}: over --max-per-peer "
                        f"{max_per_peer} connections from {address}")
                transport.abort()
                return
            self._address = address
            peers.open[address] = peers.open.get(address, 0) + 1
            key = _certificate_key(transport)
            if key is not None and client is not None:
                peers.keys[client] = key
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._disarm()
            if self._address is not None:
                left = peers.open.get(self._address, 1) - 1
                if left > 0:
                    peers.open[self._address] = left
                else:
                    peers.open.pop(self._address, None)
                if left < max_per_peer and self._address in peers.over:
                    closed = peers.over.pop(self._address)
                    if closed > 1:
                        log(f"{_stamp()} {CLOSED} {closed} connections from "
                            f"{self._address} over --max-per-peer {max_per_peer} in all")
                self._address = None
            if self.client is not None:
                peers.keys.pop(self.client, None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # a new request starts: its head has header_timeout to arrive
            super().data_received(data)

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request head was read
                self._disarm()

        def send_400_response(self, msg: str) -> None:
            log(f"{_stamp()} {REFUSED} 400 {_peer(self.client)} - - (malformed request: "
                f"{msg.rstrip('.')})")
            self._disarm()
            super().send_400_response(msg)

        def _arm(self) -> None:
            if header_timeout > 0 and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                log(f"{_stamp()} {CLOSED} {_peer(self.client)}: no complete request head "
                    f"in {header_timeout:g} s")
                self.transport.close()

        def concurrency_refused(self) -> None:
            """uvicorn answers 503 itself past ``limit_concurrency``: log it."""
            scope = self.scope or {}
            log(f"{_stamp()} {REFUSED} 503 {_peer(self.client)} "
                f"{_printable(str(scope.get('method', '-')).encode(), 16)} "
                f"{_printable(scope.get('raw_path') or b'-')} (over limit_concurrency)")

    return GatewayProtocol


# uvicorn's H11Protocol says why it answers 503 only through its logger; this is the text
CONCURRENCY_WARNING = "Exceeded concurrency limit."


class _Watched:
    """A connection's uvicorn logger, passing everything through, that also tells the
    connection when uvicorn refuses a request for ``limit_concurrency``."""

    def __init__(self, logger: Any, protocol: Any) -> None:
        self._logger, self._protocol = logger, protocol

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if msg == CONCURRENCY_WARNING:
            self._protocol.concurrency_refused()
        self._logger.warning(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def raise_open_files_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one, so TLS handshakes in progress
    (which asyncio holds up to 60 s) cannot run the gateway out of descriptors."""
    try:
        import resource  # POSIX only
    except ImportError:
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; OSError (e.g. in use) for the caller to explain."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.deploy.fleet_gateway",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--upstream", required=True, metavar="127.0.0.1:PORT")
    parser.add_argument("--cert", help="the SuperLink's server.pem")
    parser.add_argument("--key", help="the SuperLink's server.key")
    parser.add_argument("--ca", help="the deployment's ca.crt (verifies the SuperLink)")
    parser.add_argument("--insecure", action="store_true", help="no TLS (loopback demos)")
    parser.add_argument("--max-body", type=int, default=MAX_BODY, metavar="BYTES")
    parser.add_argument("--client-ca", metavar="CA.crt",
                        help="mutual TLS: only peers with a client certificate from this CA "
                             "complete the handshake")
    parser.add_argument("--require-signature", action="store_true",
                        help="refuse Fleet calls without a fresh, valid, unused node "
                             "signature (with --client-ca: by the certificate's key)")
    parser.add_argument("--max-per-peer", type=int, default=MAX_PER_PEER, metavar="N",
                        help=f"connections one address may hold (0: no limit; default "
                             f"{MAX_PER_PEER}; all peers together: {LIMIT_CONCURRENCY})")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                        metavar="SECONDS", help="close a connection whose request head is "
                        f"not complete after this long (0: never; default {HEADER_TIMEOUT:g})")
    parser.add_argument("--registered-db", metavar="STATE.DB",
                        help="the SuperLink's SQLite state: forward a Fleet call's body only "
                             "for a node key registered there (with --require-signature)")
    parser.add_argument("--replay-cache", type=int, default=REPLAY_CACHE, metavar="ENTRIES",
                        help=f"signatures remembered for {REPLAY_WINDOW:g} s "
                             f"(default {REPLAY_CACHE})")
    args = parser.parse_args(argv)
    if args.insecure == bool(args.cert and args.key and args.ca):
        parser.error("give --cert, --key and --ca, or --insecure")
    if args.client_ca and args.insecure:
        parser.error("--client-ca needs TLS: give --cert, --key and --ca, not --insecure")
    if not 0 <= args.max_per_peer < LIMIT_CONCURRENCY:
        parser.error(f"--max-per-peer must be 0 (no limit) to {LIMIT_CONCURRENCY - 1}, below "
                     f"the gateway's {LIMIT_CONCURRENCY} connections in all")
    if args.header_timeout < 0 or args.replay_cache < 1:
        parser.error("--header-timeout must be 0 or more and --replay-cache 1 or more")
    host, port = _split(args.listen)
    scheme = "http" if args.insecure else "https"
    verify: ssl.SSLContext | bool = (False if args.insecure
                                     else ssl.create_default_context(cafile=args.ca))

    def log(line: str) -> None:
        print(line, flush=True)

    raise_open_files_limit()
    if args.require_signature or args.client_ca:
        import flwr.supercore.primitives.asymmetric  # noqa: F401  (now, not at the first call)
    try:
        sock = bind(host, port)
    except OSError as exc:
        log(f"fleet gateway: cannot listen on {args.listen}: {exc.strerror or exc}")
        return 2
    peers = Peers()
    app = create_app(f"{scheme}://{args.upstream}", verify, max_body=args.max_body, log=log,
                     require_signature=args.require_signature,
                     peer_key=peers.key if args.client_ca else None,
                     replay_cache=args.replay_cache,
                     registered=RegisteredKeys(args.registered_db) if args.registered_db
                     else None)
    protocol = gateway_protocol(log, peers, max_per_peer=args.max_per_peer,
                                header_timeout=args.header_timeout)
    mutual = {"ssl_ca_certs": args.client_ca,
              "ssl_cert_reqs": ssl.CERT_REQUIRED} if args.client_ca else {}
    config = uvicorn.Config(app, ssl_certfile=args.cert, ssl_keyfile=args.key,
                            log_level="warning", access_log=False, server_header=False,
                            proxy_headers=False, limit_concurrency=LIMIT_CONCURRENCY,
                            timeout_keep_alive=30, timeout_graceful_shutdown=3,
                            http=protocol, ws="none", **mutual)  # no WebSocket upgrades
    try:
        config.load()  # the certificate and key, before saying ready
    except (OSError, ssl.SSLError) as exc:
        log(f"fleet gateway: cannot load the TLS certificate/key: {exc}")
        return 2
    extra = "".join([", client certificates required" if args.client_ca else "",
                     ", node signatures required" if args.require_signature else ""])
    log(f"{READY}: {scheme}://{args.listen} -> {scheme}://{args.upstream} "
        f"(Fleet API only; Control and Runtime APIs refused{extra})")
    asyncio.run(_serve(uvicorn.Server(config), sock, tls=not args.insecure))
    return 0


async def _serve(server: uvicorn.Server, sock: socket.socket, tls: bool) -> None:
    """Serve on ``sock``; with TLS, a handshake must finish within
    :data:`HANDSHAKE_TIMEOUT` s (uvicorn leaves asyncio's 60 s, so each silent connection
    would hold a descriptor a minute): this loop's ``create_server`` gets the timeout."""
    if tls:
        loop = asyncio.get_running_loop()
        loop.create_server = functools.partial(  # type: ignore[method-assign]
            loop.create_server, ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
    await server.serve(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
