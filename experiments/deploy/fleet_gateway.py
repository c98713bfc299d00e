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

``python -m experiments.deploy.fleet_gateway --listen HOST:PORT --upstream 127.0.0.1:PORT
(--cert server.pem --key server.key --ca ca.crt | --insecure)``
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

FLEET_PREFIX = "/v1/fleet/"
# Fleet routes are lower-case words joined by '-' (register-node, pull-messages, ...):
# no dots, no '%', no second '/', so no path can leave the prefix once forwarded.
FLEET_PATH = re.compile(rb"/v1/fleet/[a-z][a-z0-9-]{0,63}")
MAX_BODY = 256 * 1024 * 1024  # Flower chunks arrays at 5 MiB and caps FABs at 10 MB
READY = "fleet gateway ready"
REFUSED = "gateway refused"
# RFC 9110 hop-by-hop fields, the Host (httpx sets the upstream's), and what uvicorn adds
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                  "host"})
_NOT_BACK = _HOP | {"server", "date"}
OPERATOR_ONLY = ("this port serves only Flower's Fleet API (SuperNodes). The Control and "
                 "Runtime APIs (flwr run, ls, log, stop, supernode register/unregister) "
                 "are served only on the SuperLink host's loopback address: run operator "
                 "commands on that host.\n")

Log = Callable[[str], None]


class _TooLarge(Exception):
    """The request body passed the gateway's bound."""


def _printable(raw: bytes, limit: int = 200) -> str:
    text = raw[:limit].decode("ascii", "backslashreplace")
    return "".join(c if c.isprintable() else "?" for c in text)


def _stamp() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def create_app(upstream: str, verify: ssl.SSLContext | bool, *, max_body: int = MAX_BODY,
               log: Log = print, transport: httpx.AsyncBaseTransport | None = None
               ) -> Starlette:
    """The gateway's ASGI app forwarding Fleet calls to ``upstream`` (``scheme://host:port``);
    ``transport`` replaces the network in tests."""
    timeout = httpx.Timeout(connect=5.0, read=120.0, write=60.0, pool=30.0)
    client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        nonlocal client
        async with httpx.AsyncClient(base_url=upstream, verify=verify, timeout=timeout,
                                     transport=transport, follow_redirects=False,
                                     limits=httpx.Limits(max_connections=128)) as c:
            client = c
            yield

    async def forward(request: Request) -> Response:
        route = _route(request, max_body)
        if not isinstance(route, str):
            return _refuse(request, *route, log)
        path = route
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        assert client is not None
        sent = client.build_request(request.method, path, headers=headers,
                                    content=_bounded(request, max_body)
                                    if request.method == "POST" else None)
        try:
            answer = await client.send(sent, stream=True)
        except _TooLarge:
            return _refuse(request, 413, f"request body over {max_body} bytes.\n", log)
        except httpx.HTTPError as exc:
            log(f"{_stamp()} gateway: the SuperLink did not answer {path}: "
                f"{type(exc).__name__}: {exc}")
            return PlainTextResponse("502: the SuperLink behind this gateway did not "
                                     "answer.\n", status_code=502)
        back = [(k, v) for k, v in answer.headers.multi_items() if k.lower() not in _NOT_BACK]
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                                 headers=dict(back), background=BackgroundTask(answer.aclose))

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)],
                     lifespan=lifespan)


def _route(request: Request, max_body: int) -> str | tuple[int, str]:
    """The upstream path a request goes to (``/health`` or one Fleet route), or the
    (status, reason) it is refused with."""
    raw: bytes = request.scope.get("raw_path") or b""
    query = request.scope.get("query_string") or b""
    is_fleet = raw.startswith(FLEET_PREFIX.encode())
    if raw == b"/health" and request.method in ("GET", "HEAD") and not query:
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


def _refuse(request: Request, status: int, body: str, log: Log) -> Response:
    """The refusal, with one log line on the operator's side."""
    peer = f"{request.client.host}:{request.client.port}" if request.client else "?"
    raw = request.scope.get("raw_path") or request.url.path.encode()
    log(f"{_stamp()} {REFUSED} {status} {peer} {_printable(request.method.encode(), 16)} "
        f"{_printable(raw)}")
    return PlainTextResponse(f"{status}: {body}", status_code=status)


async def _bounded(request: Request, max_body: int) -> AsyncIterator[bytes]:
    """The request body as it streams in; :class:`_TooLarge` past ``max_body`` bytes."""
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > max_body:
            raise _TooLarge
        yield chunk


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
    args = parser.parse_args(argv)
    if args.insecure == bool(args.cert and args.key and args.ca):
        parser.error("give --cert, --key and --ca, or --insecure")
    host, port = _split(args.listen)
    scheme = "http" if args.insecure else "https"
    verify: ssl.SSLContext | bool = (False if args.insecure
                                     else ssl.create_default_context(cafile=args.ca))

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        sock = bind(host, port)
    except OSError as exc:
        log(f"fleet gateway: cannot listen on {args.listen}: {exc.strerror or exc}")
        return 2
    app = create_app(f"{scheme}://{args.upstream}", verify, max_body=args.max_body, log=log)
    config = uvicorn.Config(app, ssl_certfile=args.cert, ssl_keyfile=args.key,
                            log_level="warning", access_log=False, server_header=False,
                            proxy_headers=False, limit_concurrency=512,
                            timeout_keep_alive=30, timeout_graceful_shutdown=3)
    try:
        config.load()  # the certificate and key, before saying ready
    except (OSError, ssl.SSLError) as exc:
        log(f"fleet gateway: cannot load the TLS certificate/key: {exc}")
        return 2
    log(f"{READY}: {scheme}://{args.listen} -> {scheme}://{args.upstream} "
        f"(Fleet API only; Control and Runtime APIs refused)")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
