"""``fedpriv deploy``: the same apps on a real SuperLink and SuperNodes across hosts.

Flower 1.41's deployment runtime, secured by default: the SuperLink serves TLS with a
certificate from :mod:`experiments.deploy.credentials` and admits only SuperNodes whose public
key was registered (``--enable-supernode-auth``); it keeps registrations and finished
runs in SQLite (``--database``). It listens on loopback only, because its Control API
(register nodes, run any app on every SuperNode, read logs) needs no login in
open-source Flower; the public port is :mod:`experiments.deploy.fleet_gateway`, which forwards
Flower's Fleet API alone. Each command here starts Flower's own executables by
PID, in the foreground, and stops them when it ends (Ctrl-C, SIGTERM, or — through
Linux's parent-death signal — even ``kill -9``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks.config import ConfigError

from ..runtime.procs import Foreground, stream_child
from ..runtime.superlink import LocalSuperLink, flower_env, flower_executable
from .credentials import LOOPBACK, Certificates, certificate_hosts, read_certificate
from .fleet_gateway import OPERATOR_ONLY, READY, bind

DEFAULT_PORT = 9092
SERVING = "deployment ready"  # printed once the SuperLink, SuperExec and gateway are up
Echo = Callable[[str], None]


@dataclass(frozen=True)
class Connection:
    """How a client of the SuperLink (`flwr`, a SuperNode) reaches it."""

    address: str  # host:port
    ca: Path | None  # the deployment's CA certificate; None: insecure (loopback demos)

    def __post_init__(self) -> None:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--superlink {self.address!r} is not HOST:PORT, e.g. "
                              f"--superlink server.lab.example:{DEFAULT_PORT}.")
        if self.ca is not None and not self.ca.is_file():
            raise ConfigError(f"--ca {str(self.ca)!r} does not exist. Copy the deployment's "
                              "ca.crt (made by `fedpriv deploy certs`) to this host.")
        if self.ca is not None:
            read_certificate(self.ca, "--ca")

    def toml(self, name: str) -> str:
        """This connection as a ``[superlink.<name>]`` table of ``$FLWR_HOME/config.toml``."""
        trust = (f'root-certificates = "{self.ca.resolve()}"' if self.ca is not None
                 else "insecure = true")
        return f'[superlink.{name}]\naddress = "{self.address}"\n{trust}\n'

    def flags(self) -> list[str]:
        return (["--root-certificates", str(self.ca)] if self.ca is not None
                else ["--insecure"])


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


def gateway_command(certs: Certificates | None, host: str, port: int, internal: int
                    ) -> list[str]:
    """The fleet-only gateway (:mod:`experiments.deploy.fleet_gateway`) on the public
    ``host:port``, in front of the SuperLink on ``127.0.0.1:internal``."""
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    tls = (["--cert", str(certs.cert), "--key", str(certs.key), "--ca", str(certs.ca)]
           if certs else ["--insecure"])
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


def supernode_command(link: Connection, node_config: dict[str, str | int | bool],
                      key: Path | None,
                      host: str = "127.0.0.1", port: int = 9094) -> list[str]:
    """``flower-supernode`` for one host: the partition it serves, its key."""
    config = " ".join(f'{k}="{v}"' if isinstance(v, str)
                      else f"{k}={str(v).lower()}" if isinstance(v, bool) else f"{k}={v}"
                      for k, v in node_config.items())
    cmd = [flower_executable("flower-supernode"), "--superlink", link.address, *link.flags(),
           "--node-config", config, "--host", host, "--port", str(port)]
    if key is not None:
        if not key.is_file():
            raise ConfigError(f"--key {str(key)!r} does not exist. Copy this host's private "
                              "key (made by `fedpriv deploy keys`) here.")
        cmd += ["--auth-supernode-private-key", str(key)]
    return cmd


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
                    internal_port: int | None = None, startup_timeout: float = 90.0) -> int:
    """Run the SuperLink in the foreground until it exits or is interrupted.

    The SuperLink (Fleet, Control and Runtime APIs on one server) listens on
    ``127.0.0.1:internal_port`` only (default ``port + 1``); the public ``host:port`` is
    the fleet-only gateway, so whoever reaches it can do nothing but connect a SuperNode
    whose key the operator registered. Operator commands run on this host, against the
    internal port. A Runtime API secret (``state/superexec.secret``) binds the SuperExec.
    """
    internal = internal_port or port + 1
    if not 0 < internal < 65536 or not 0 < port < 65536:
        raise ConfigError(f"--port {port} and --internal-port {internal} must be in 1..65535.")
    if internal == port:
        raise ConfigError(f"--internal-port {internal} must differ from --port {port}: the "
                          "SuperLink listens on 127.0.0.1:INTERNAL, the gateway on "
                          "HOST:PORT.")
    if certs:
        certs.check()
    state.mkdir(mode=0o700, parents=True, exist_ok=True)  # registrations, runs, the secret
    port_free("127.0.0.1", internal, "--internal-port")
    port_free(host, port, "--port")
    secret = write_secret(state)
    name = public_name(certs) if certs else "127.0.0.1"
    ca = f" --ca {certs.ca}" if certs else " --insecure"
    op = f"--superlink 127.0.0.1:{internal}{ca}"
    if certs is None:
        echo("warning: --insecure: no TLS and no SuperNode authentication; anyone who can "
             "reach this port can join the federation and read the models. Use it only on "
             "loopback.")
    echo(f"SuperLink on 127.0.0.1:{internal} ({'TLS' if certs else 'insecure'}"
         f"{', SuperNode authentication' if auth else ''}; Control and Runtime APIs on this "
         f"host only); fleet gateway for SuperNodes on {host}:{port}; state in "
         f"{state / 'state.db'}")
    ready = threading.Event()

    def line(text: str) -> None:
        if text.startswith(READY):
            ready.set()
        echo(text)

    with Foreground(line, flower_env(None)) as children:
        link = children.start(superlink_command(certs, state, "127.0.0.1", internal, auth,
                                                secret))
        if not children.pump(lambda: _answers(internal, certs), startup_timeout):
            echo(f"the SuperLink did not start on 127.0.0.1:{internal} (exit code "
                 f"{link.poll()}); see its output above.")
            return link.poll() or 1
        children.start(superexec_command(certs, internal, secret, link.pid))
        children.start(gateway_command(certs, host, port, internal))
        if not children.pump(ready.is_set, startup_timeout):
            echo(f"the fleet gateway did not start on {host}:{port}; see its output above.")
            gone = children.exited()
            return (gone.returncode if gone else 0) or 1
        if auth:
            echo("on this host, register each SuperNode's public key first:")
            echo(f"  fedpriv deploy register KEYS/supernode-0.pub ... {op}")
        echo("then on each host I (with ca.crt and its own private key):")
        node_ca = " --ca ca.crt" if certs else " --insecure"
        key = " --key supernode-I" if auth else ""
        echo(f"  fedpriv deploy supernode --superlink {name}:{port}{node_ca}{key} "
             f"--partition-id I --num-partitions {nodes or 'N'}")
        echo("and submit runs on this host (the results folder is written here):")
        echo(f"  fedpriv deploy run {op} --config mnist")
        echo(f"{SERVING}: SuperNodes connect to {name}:{port}; operator commands "
             f"(register, run, ls) use 127.0.0.1:{internal} on this host")
        children.pump()
        gone = children.exited()
        return gone.returncode if gone else 0


# What flower-supernode prints (Flower 1.41): exit code 305 (SUPERNODE_CONNECTION_ERROR);
# 2004 (FLEET_NODE_ACTIVATION_FAILED, "Failed to activate SuperNode."), which it reports
# alike for an unregistered key and for a registered node whose previous session still
# counts as online; and its node id, logged once the SuperLink has activated it.
REFUSED = "Exit Code: 305"
NOT_ACTIVATED = "[code: 2004]"
JOINED = "SuperNode ID:"
ONLINE_AFTER_HEARTBEAT = 60  # Flower's HEARTBEAT_PATIENCE (2) x the 30 s heartbeat


class _Attempt:
    """The output of one start of flower-supernode. A retry's lines are held back until
    the SuperLink admits the node, so that refused retries print nothing."""

    def __init__(self, echo: Echo, on_join: Callable[[], str] | None = None) -> None:
        self.echo = echo
        self.on_join = on_join
        self.held: list[str] | None = [] if on_join else None
        self.refused = self.not_activated = False

    def line(self, text: str) -> None:
        self.refused = self.refused or REFUSED in text
        self.not_activated = self.not_activated or NOT_ACTIVATED in text
        if self.held is None:
            self.echo(text)
            return
        self.held.append(text)
        if JOINED in text and self.on_join:
            self.echo(self.on_join())
            self.release()
        elif len(self.held) > 100:  # not Flower's usual start-up: stop holding back
            self.release()

    def release(self) -> None:
        held, self.held = self.held or [], None
        for text in held:
            self.echo(text)


def serve_supernode(link: Connection, node_config: dict[str, str | int | bool], key: Path | None,
                    port: int, echo: Echo = print, *, rejoin_wait: float = 90.0,
                    retry_every: float = 3.0) -> int:
    """Run one SuperNode in the foreground until it exits or is interrupted.

    A SuperNode restarted after a crash or ``kill -9`` is refused while the SuperLink still
    counts its previous session as online (up to 60 s after its last heartbeat); Flower
    reports that exactly as it reports an unregistered key. So a refused activation is
    retried every ``retry_every`` s for up to ``rejoin_wait`` s, then ends with the
    register advice.
    """
    cmd = supernode_command(link, node_config, key, port=port)
    echo(f"SuperNode for {link.address} ({'TLS' if link.ca else 'insecure'}"
         f"{', authenticated' if key else ''}), node config: {cmd[cmd.index('--node-config') + 1]}")
    env = flower_env(None)
    attempt = _Attempt(echo)
    code = stream_child(cmd, attempt.line, env)
    if not attempt.refused:
        return code
    if key is None or not attempt.not_activated or rejoin_wait <= 0:
        echo("the SuperLink refused this SuperNode (Flower's exit code 305): register its key "
             "on the SuperLink's host with `fedpriv deploy register KEY.pub --superlink "
             "127.0.0.1:INTERNAL_PORT --ca ...`, or, if it has just restarted, wait about a "
             "minute for its old session to time out.")
        return code
    echo(f"the SuperLink refused to activate this SuperNode: it still counts this node's "
         f"previous session as online for up to {ONLINE_AFTER_HEARTBEAT} s after its last "
         f"heartbeat (after a crash or kill -9), or its key is not registered; retrying every "
         f"{retry_every:g} s for up to {rejoin_wait:g} s")
    start = time.monotonic()
    tries = 1
    while time.monotonic() + retry_every < start + rejoin_wait:
        time.sleep(retry_every)  # Ctrl-C and SIGTERM end it at once
        tries += 1
        attempt = _Attempt(echo, lambda n=tries: f"the SuperLink admitted this SuperNode "
                                                 f"after {time.monotonic() - start:.0f} s "
                                                 f"(attempt {n})")
        code = stream_child(cmd, attempt.line, env)
        if not (attempt.refused and attempt.not_activated):
            attempt.release()  # it joined and has ended, or failed in another way
            return code
    echo(f"the SuperLink refused this SuperNode for {time.monotonic() - start:.0f} s, longer "
         "than a previous session stays online: register its key on the SuperLink's "
         "host with `fedpriv deploy register KEY.pub --superlink 127.0.0.1:INTERNAL_PORT "
         "--ca ...` (`--ls` lists the registered nodes).")
    return code


def refuse_public_port(link: Connection) -> None:
    """ConfigError when ``link`` is a deployment's public port (its fleet gateway), which
    refuses operator commands; said before Flower's bare "403 Forbidden"."""
    scheme = "https" if link.ca else "http"
    context = ssl.create_default_context(cafile=str(link.ca)) if link.ca else None
    try:
        with urllib.request.urlopen(f"{scheme}://{link.address}/v1/control/list-runs",
                                    timeout=5, context=context):
            return
    except urllib.error.HTTPError as exc:
        if exc.code != 403 or OPERATOR_ONLY[:40] not in exc.read(4096).decode(errors="replace"):
            return
    except urllib.error.URLError as exc:
        raise _unreachable(link, exc.reason) from None
    except (OSError, ValueError) as exc:
        raise _unreachable(link, exc) from None
    raise ConfigError(f"--superlink {link.address} is the deployment's public port, which "
                      "serves SuperNodes only (Flower's Fleet API). Operator commands "
                      "(register, run) run on the SuperLink's host against its internal "
                      "port: --superlink 127.0.0.1:INTERNAL_PORT (the port `fedpriv deploy "
                      "superlink` printed; --port + 1 by default).")


def _unreachable(link: Connection, reason: object) -> ConfigError:
    """The one paragraph for a SuperLink that cannot be reached (before anything is made)."""
    if isinstance(reason, ssl.SSLError):
        why = (f"the TLS handshake failed ({reason}): --ca is not the deployment's ca.crt, "
               "or the port does not serve TLS (an --insecure SuperLink: give --insecure).")
    else:
        why = (f"nothing answered ({reason}): is `fedpriv deploy superlink` running on this "
               "host, and is this its internal port (--port + 1 by default)?")
    return ConfigError(f"--superlink {link.address}: cannot reach the SuperLink: {why} "
                       "Nothing was started or written.")


def register(link: Connection, keys: Sequence[Path], action: str = "register",
             echo: Echo = print) -> int:
    """``flwr supernode register`` (or ``unregister``/``ls``) through a private FLWR_HOME."""
    refuse_public_port(link)
    for key in keys:
        if action == "register" and not key.is_file():
            raise ConfigError(f"public key {str(key)!r} does not exist (the .pub file made by "
                              "`fedpriv deploy keys`).")
    home = Path(tempfile.mkdtemp(prefix="fp-deploy-"))
    try:
        (home / "config.toml").write_text('[superlink]\ndefault = "deploy"\n\n'
                                          + link.toml("deploy"))
        env = flower_env(home)
        worst = 0
        for arg in ([str(k) for k in keys] if keys else [None]):
            cmd = [flower_executable("flwr"), "supernode", action,
                   *([arg] if arg else []), "deploy"]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL, timeout=120)
            for line in (done.stdout + done.stderr).splitlines():
                if line.strip() and "Using SuperLink" not in line:
                    echo(line)
            worst = worst or done.returncode
        return worst
    finally:
        shutil.rmtree(home, ignore_errors=True)


class DeployedSuperLink(LocalSuperLink):
    """A SuperLink that is already running somewhere: :func:`experiments.runtime.runner.execute`
    submits to it exactly as to a private one (only ``flwr run`` is started here)."""

    CONNECTION = "deploy"

    def __init__(self, link: Connection, cwd: Path | None = None) -> None:
        super().__init__(cwd=cwd)
        self.link = link
        self.simulation = False

    def start(self) -> DeployedSuperLink:
        refuse_public_port(self.link)
        self.home = Path(tempfile.mkdtemp(prefix="fp-deploy-"))
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.CONNECTION}"\n\n' + self.link.toml(self.CONNECTION))
        self.port = int(self.link.address.rpartition(":")[2])
        return self

    def died(self) -> str | None:
        return None

