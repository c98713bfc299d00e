"""``fedpriv deploy superlink``: the same apps on a real SuperLink across hosts.

Flower 1.41's deployment runtime, secured by default: the SuperLink serves TLS with a
certificate from :mod:`experiments.deploy.credentials` and admits only SuperNodes whose
public key was registered (``--enable-supernode-auth``); it keeps registrations and
finished runs in SQLite (``--database``). It listens on loopback only, because its Control
API (register nodes, run any app on every SuperNode, read logs) needs no login in
open-source Flower; the public port is :mod:`experiments.deploy.fleet_gateway`, which
forwards Flower's Fleet API alone. Each command here starts Flower's own executables by
PID, in the foreground, and stops them when it ends (Ctrl-C, SIGTERM, or — through
Linux's parent-death signal — even ``kill -9``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import ssl
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tasks.config import ConfigError

from ..runtime.procs import Foreground, listens_on
from ..runtime.superlink import flower_env, flower_executable
from .credentials import LOOPBACK, Certificates, certificate_hosts
from .fleet_gateway import READY, bind

SERVING = "deployment ready"  # printed once the SuperLink, SuperExec and gateway are up
Echo = Callable[[str], None]


def superlink_command(certs: Certificates | None, state: Path, host: str, port: int,
                      auth: bool = True, secret: Path | None = None) -> list[str]:
    """``flower-superlink`` in deployment mode: TLS (unless ``certs`` is None), SuperNode
    authentication, and its state in ``state/state.db``. With ``secret``, the Runtime API
    demands it of the SuperExec, which then runs apart (:func:`superexec_command`): Flower
    ignores the secret for the SuperExec the SuperLink starts itself."""
    if certs is None and auth:
        raise ConfigError("SuperNode authentication needs TLS: give --certs (an --insecure "
                          "loopback demo runs without authentication).")
    cmd = [flower_executable("flower-superlink"), "--host", host, "--port", str(port),
           "--database", str(state / "state.db"), "--disable-runtime-dependency-installation"]
    if secret is not None:
        cmd += ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
    if certs is None:
        return [*cmd, "--insecure"]
    cmd += ["--ssl-ca-certfile", str(certs.ca), "--ssl-certfile", str(certs.cert),
            "--ssl-keyfile", str(certs.key)]
    return [*cmd, "--enable-supernode-auth"] if auth else cmd


def superexec_command(certs: Certificates | None, port: int, secret: Path,
                      superlink_pid: int) -> list[str]:
    """``flower-superexec`` for a SuperLink on ``127.0.0.1:port`` that runs with
    ``--isolation process``: it launches the ServerApps, proving itself with ``secret``."""
    trust = ["--root-certificates", str(certs.ca)] if certs else ["--insecure"]
    return [flower_executable("flower-superexec"), "--runtime-api-address",
            f"127.0.0.1:{port}", *trust, "--superexec-auth-secret-file", str(secret),
            "--parent-pid", str(superlink_pid)]


def gateway_command(certs: Certificates | None, host: str, port: int, internal: int,
                    client_certs: bool = True, auth: bool = True,
                    state: Path | None = None) -> list[str]:
    """The fleet-only gateway (:mod:`experiments.deploy.fleet_gateway`) on the public
    ``host:port``, in front of the SuperLink on ``127.0.0.1:internal``. With TLS it
    demands a client certificate from the deployment's CA (``client_certs``) and, with
    SuperNode authentication, a fresh node signature made by that certificate's key, of
    a node registered in ``state/state.db``, before any request body is read."""
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    tls = (["--cert", str(certs.cert), "--key", str(certs.key), "--ca", str(certs.ca)]
           if certs else ["--insecure"])
    if certs and client_certs:
        tls += ["--client-ca", str(certs.ca)]
    if certs and auth:
        tls += ["--require-signature"]
        if state is not None:
            tls += ["--registered-db", str(state / "state.db")]
    return [sys.executable, "-m", "experiments.deploy.fleet_gateway", "--listen", listen,
            "--upstream", f"127.0.0.1:{internal}", *tls]


def write_secret(state: Path) -> Path:
    """A fresh Runtime API secret for this start, ``state/superexec.secret``, mode 0600:
    created new (never through a symlink or over another user's file), then renamed."""
    path = state / "superexec.secret"
    tmp = state / f".superexec.secret.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode())
    os.replace(tmp, path)
    return path


def port_free(host: str, port: int, flag: str) -> None:
    """ConfigError, in one paragraph, when ``host:port`` cannot be listened on."""
    try:
        bind(host, port).close()
    except OSError as exc:
        why = ("is in use (another SuperLink, or a previous one still stopping?)"
               if exc.errno == errno.EADDRINUSE else f"cannot be listened on ({exc.strerror})")
        raise ConfigError(f"{host}:{port} {why}; choose another {flag}.") from None


def public_name(certs: Certificates) -> str:
    """The first name or address in the certificate that is not loopback."""
    names = [h for h in certificate_hosts(certs.cert) if h not in LOOPBACK]
    return names[0] if names else "127.0.0.1"


def _answers(port: int, certs: Certificates | None) -> bool:
    """Whether the SuperLink on ``127.0.0.1:port`` answers its health check."""
    scheme = "https" if certs else "http"
    context = ssl.create_default_context(cafile=str(certs.ca)) if certs else None
    try:
        with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/health", timeout=1,
                                    context=context) as r:
            return r.status == 200
    except OSError:
        return False


def serve_superlink(certs: Certificates | None, state: Path, host: str, port: int,
                    auth: bool, nodes: int, echo: Echo = print,
                    internal_port: int | None = None, startup_timeout: float = 90.0,
                    client_certs: bool = True) -> int:
    """Run the SuperLink in the foreground until it exits or is interrupted.

    The SuperLink (Fleet, Control and Runtime APIs on one server) listens on
    ``127.0.0.1:internal_port`` only (default ``port + 1``); the public ``host:port`` is
    the fleet-only gateway, so whoever reaches it can do nothing but connect a SuperNode
    whose key the operator registered. Operator commands run on this host, against the
    internal port. A Runtime API secret (``state/superexec.secret``) binds the SuperExec.
    """
    internal = _internal_port(port, internal_port)
    if certs:
        certs.check()
    state.mkdir(mode=0o700, parents=True, exist_ok=True)  # registrations, runs, the secret
    if state.is_symlink() or state.stat().st_uid != os.geteuid():
        raise ConfigError(f"--state {str(state)!r} is a symbolic link or belongs to another "
                          "user, who could then read the registrations and runs or replace "
                          "the Runtime API secret; name a folder of your own (it is made if "
                          "missing).")
    state.chmod(0o700)
    port_free("127.0.0.1", internal, "--internal-port")
    port_free(host, port, "--port")
    secret = write_secret(state)
    name = public_name(certs) if certs else "127.0.0.1"
    _announce(certs, state, host, port, internal, auth, echo, client_certs)
    ready = threading.Event()

    def line(text: str) -> None:
        if text.startswith(READY):
            ready.set()
        echo(text)

    with Foreground(line, flower_env(None)) as children:
        link = children.start(superlink_command(certs, state, "127.0.0.1", internal, auth,
                                                secret))
        # its own port answering: not an answer from a process that took the port after
        # the check above (the SuperExec would give it the Runtime API secret)
        if not children.pump(lambda: listens_on(link.pid, internal)
                             and _answers(internal, certs), startup_timeout):
            echo(f"the SuperLink did not start on 127.0.0.1:{internal} (exit code "
                 f"{link.poll()}); see its output above.")
            return link.poll() or 1
        children.start(superexec_command(certs, internal, secret, link.pid))
        children.start(gateway_command(certs, host, port, internal, client_certs, auth,
                                       state))
        if not children.pump(ready.is_set, startup_timeout):
            echo(f"the fleet gateway did not start on {host}:{port}; see its output above.")
            gone = children.exited()
            return (gone.returncode if gone else 0) or 1
        _next_steps(certs, name, port, internal, auth, nodes, echo, client_certs)
        children.pump()
        gone = children.exited()
        return gone.returncode if gone else 0


def _internal_port(port: int, internal_port: int | None) -> int:
    """The SuperLink's own port on 127.0.0.1 (default ``port + 1``), checked."""
    internal = internal_port or port + 1
    if not 0 < internal < 65536 or not 0 < port < 65536:
        raise ConfigError(f"--port {port} and --internal-port {internal} must be in 1..65535.")
    if internal == port:
        raise ConfigError(f"--internal-port {internal} must differ from --port {port}: the "
                          "SuperLink listens on 127.0.0.1:INTERNAL, the gateway on "
                          "HOST:PORT.")
    return internal


def _announce(certs: Certificates | None, state: Path, host: str, port: int, internal: int,
              auth: bool, echo: Echo, client_certs: bool = True) -> None:
    """What is about to listen where, with a warning when it is not secured."""
    if certs is None:
        echo("warning: --insecure: no TLS and no SuperNode authentication; anyone who can "
             "reach this port can join the federation and read the models. Use it only on "
             "loopback.")
    elif not client_certs:
        echo("warning: --no-client-certs: anyone who can reach the public port can complete "
             "a TLS handshake and hold connections open; only node signatures keep them "
             "out of the federation.")
    mutual = ", client certificates required" if certs and client_certs else ""
    echo(f"SuperLink on 127.0.0.1:{internal} ({'TLS' if certs else 'insecure'}"
         f"{', SuperNode authentication' if auth else ''}; Control and Runtime APIs on this "
         f"host only); fleet gateway for SuperNodes on {host}:{port}{mutual}; state in "
         f"{state / 'state.db'}")


def _next_steps(certs: Certificates | None, name: str, port: int, internal: int, auth: bool,
                nodes: int, echo: Echo, client_certs: bool = True) -> None:
    """The commands to run next (register, start SuperNodes, submit runs), then
    :data:`SERVING`."""
    ca = f" --ca {certs.ca}" if certs else " --insecure"
    op = f"--superlink 127.0.0.1:{internal}{ca}"
    if certs and client_certs:
        echo("each SuperNode needs its key and TLS client certificate: `fedpriv deploy keys "
             "KEYS --nodes N --certs CERTS` (where the CA's signing key is kept)")
    if auth:
        echo("on this host, register each SuperNode's public key first:")
        echo(f"  fedpriv deploy register KEYS/supernode-0.pub ... {op}")
    echo("then on each host I (with ca.crt, its own private key and its .crt):")
    node_ca = " --ca ca.crt" if certs else " --insecure"
    key = " --key supernode-I" if auth else ""
    echo(f"  fedpriv deploy supernode --superlink {name}:{port}{node_ca}{key} "
         f"--partition-id I --num-partitions {nodes or 'N'}")
    echo("and submit runs on this host (the results folder is written here):")
    echo(f"  fedpriv deploy run {op} --config mnist")
    echo(f"{SERVING}: SuperNodes connect to {name}:{port}; operator commands "
         f"(register, run, ls) use 127.0.0.1:{internal} on this host")
