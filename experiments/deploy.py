"""``fedpriv deploy``: the same apps on a real SuperLink and SuperNodes across hosts.

Flower 1.41's deployment runtime, secured by default: the SuperLink serves TLS with a
certificate from :mod:`experiments.credentials` and admits only SuperNodes whose public
key was registered (``--enable-supernode-auth``); it keeps registrations and finished
runs in SQLite (``--database``). Each command here starts Flower's own executables by
PID, in the foreground, and stops them when it ends (Ctrl-C, SIGTERM, or — through
Linux's parent-death signal — even ``kill -9``).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks.config import ConfigError

from .credentials import LOOPBACK, Certificates, certificate_hosts
from .procs import stream_child
from .superlink import LocalSuperLink, flower_env, flower_executable

DEFAULT_PORT = 9092
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

    def toml(self, name: str) -> str:
        """This connection as a ``[superlink.<name>]`` table of ``$FLWR_HOME/config.toml``."""
        trust = (f'root-certificates = "{self.ca.resolve()}"' if self.ca is not None
                 else "insecure = true")
        return f'[superlink.{name}]\naddress = "{self.address}"\n{trust}\n'

    def flags(self) -> list[str]:
        return (["--root-certificates", str(self.ca)] if self.ca is not None
                else ["--insecure"])


def superlink_command(certs: Certificates | None, state: Path, host: str, port: int,
                      auth: bool = True) -> list[str]:
    """``flower-superlink`` in deployment mode: TLS (unless ``certs`` is None), SuperNode
    authentication, and its state in ``state/state.db``."""
    if certs is None and auth:
        raise ConfigError("SuperNode authentication needs TLS: give --certs (an --insecure "
                          "loopback demo runs without authentication).")
    cmd = [flower_executable("flower-superlink"), "--host", host, "--port", str(port),
           "--database", str(state / "state.db"), "--disable-runtime-dependency-installation"]
    if certs is None:
        return [*cmd, "--insecure"]
    cmd += ["--ssl-ca-certfile", str(certs.ca), "--ssl-certfile", str(certs.cert),
            "--ssl-keyfile", str(certs.key)]
    return [*cmd, "--enable-supernode-auth"] if auth else cmd


def supernode_command(link: Connection, node_config: dict[str, str | int], key: Path | None,
                      host: str = "127.0.0.1", port: int = 9094) -> list[str]:
    """``flower-supernode`` for one host: the partition it serves, its key."""
    config = " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}"
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


def serve_superlink(certs: Certificates | None, state: Path, host: str, port: int,
                    auth: bool, nodes: int, echo: Echo = print) -> int:
    """Run the SuperLink in the foreground until it exits or is interrupted."""
    state.mkdir(parents=True, exist_ok=True)
    cmd = superlink_command(certs.check() if certs else None, state, host, port, auth)
    name = public_name(certs) if certs else "127.0.0.1"
    where = f"{name}:{port}"
    ca = f" --ca {certs.ca}" if certs else " --insecure"
    if certs is None:
        echo("warning: --insecure: no TLS and no SuperNode authentication; anyone who can "
             "reach this port can join the federation and read the models. Use it only on "
             "loopback.")
    echo(f"SuperLink on {host}:{port} ({'TLS' if certs else 'insecure'}"
         f"{', SuperNode authentication' if auth else ''}); state in {state / 'state.db'}")
    if auth:
        echo("register each SuperNode's public key first (from any host with ca.crt):")
        echo(f"  fedpriv deploy register KEYS/supernode-0.pub ... --superlink {where}{ca}")
    echo("then on each host I (with ca.crt and its own private key):")
    node_ca = " --ca ca.crt" if certs else " --insecure"
    key = " --key supernode-I" if auth else ""
    echo(f"  fedpriv deploy supernode --superlink {where}{node_ca}{key} --partition-id I "
         f"--num-partitions {nodes or 'N'}")
    echo("and submit a run (on this host, so the results folder is here):")
    echo(f"  fedpriv deploy run --superlink 127.0.0.1:{port}{ca} --config mnist")
    return stream_child(cmd, echo, flower_env(None))


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


def serve_supernode(link: Connection, node_config: dict[str, str | int], key: Path | None,
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
             "with `fedpriv deploy register KEY.pub --superlink ... --ca ...`, or, if it has "
             "just restarted, wait about a minute for its old session to time out.")
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
         "than a previous session stays online: register its key with `fedpriv deploy "
         "register KEY.pub --superlink ... --ca ...` (`--ls` lists the registered nodes).")
    return code


def register(link: Connection, keys: Sequence[Path], action: str = "register",
             echo: Echo = print) -> int:
    """``flwr supernode register`` (or ``unregister``/``ls``) through a private FLWR_HOME."""
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
    """A SuperLink that is already running somewhere: :func:`experiments.runner.execute`
    submits to it exactly as to a private one (only ``flwr run`` is started here)."""

    CONNECTION = "deploy"

    def __init__(self, link: Connection, cwd: Path | None = None) -> None:
        super().__init__(cwd=cwd)
        self.link = link
        self.simulation = False

    def start(self) -> DeployedSuperLink:
        self.home = Path(tempfile.mkdtemp(prefix="fp-deploy-"))
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.CONNECTION}"\n\n' + self.link.toml(self.CONNECTION))
        self.port = int(self.link.address.rpartition(":")[2])
        return self

    def died(self) -> str | None:
        return None

