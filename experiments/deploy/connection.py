"""How operators and SuperNodes reach a deployment's SuperLink, and what operators do there.

:class:`Connection` is an address and the deployment's CA (or ``--insecure``);
:func:`refuse_public_port` says, before Flower's bare "403 Forbidden", that operator
commands go to the SuperLink's internal port; :func:`register` runs ``flwr supernode
register`` through a private FLWR_HOME; :class:`DeployedSuperLink` lets
:func:`experiments.runtime.runner.execute` submit runs to a deployment.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from tasks.config import ConfigError

from ..runtime.owned_folders import owned_folder
from ..runtime.superlink import LocalSuperLink, flower_config, flower_env, flower_executable
from .credentials import read_certificate
from .fleet_gateway import OPERATOR_ONLY

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
        if self.ca is not None:
            read_certificate(self.ca, "--ca")

    def table(self) -> dict[str, str | bool]:
        """This connection's entry in ``$FLWR_HOME/config.toml``."""
        trust: dict[str, str | bool] = ({"root-certificates": str(self.ca.resolve())}
                                        if self.ca is not None else {"insecure": True})
        return {"address": self.address, **trust}

    def toml(self, name: str) -> str:
        """This connection as a ``[superlink.<name>]`` table of ``$FLWR_HOME/config.toml``."""
        return tomli_w.dumps({"superlink": {name: self.table()}})

    def flags(self) -> list[str]:
        return (["--root-certificates", str(self.ca)] if self.ca is not None
                else ["--insecure"])


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
        if not _demands_client_certificate(link):
            raise _unreachable(link, exc.reason) from None
    except (OSError, ValueError) as exc:
        if not _demands_client_certificate(link):
            raise _unreachable(link, exc) from None
    raise ConfigError(f"--superlink {link.address} is the deployment's public port, which "
                      "serves SuperNodes only (Flower's Fleet API). Operator commands "
                      "(register, run) run on the SuperLink's host against its internal "
                      "port: --superlink 127.0.0.1:INTERNAL_PORT (the port `fedpriv deploy "
                      "superlink` printed; --port + 1 by default).")


def _demands_client_certificate(link: Connection) -> bool:
    """Whether ``link`` is a TLS server that refused us for want of a client certificate:
    under TLS 1.3 the client's handshake completes, then the gateway (mutual TLS) sends
    the "certificate required" alert or, under asyncio, just closes without a byte."""
    if link.ca is None:
        return False
    host, _, port = link.address.rpartition(":")
    context = ssl.create_default_context(cafile=str(link.ca))
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname=host.strip("[]")) as tls:
            tls.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            return tls.recv(1) == b""
    except ssl.SSLError as exc:
        return "CERTIFICATE_REQUIRED" in str(exc).upper()
    except OSError:
        return False


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
    home = owned_folder("deploy", remove_at_exit=False)
    try:
        (home / "config.toml").write_text(flower_config("deploy", {"deploy": link.table()}))
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
        self.home = owned_folder("deploy", remove_at_exit=False)
        (self.home / "config.toml").write_text(
            flower_config(self.CONNECTION, {self.CONNECTION: self.link.table()}))
        self.port = int(self.link.address.rpartition(":")[2])
        return self

    def died(self) -> str | None:
        return None


