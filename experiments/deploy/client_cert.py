"""A SuperNode that shows the SuperLink's gateway its TLS client certificate.

The gateway (:mod:`experiments.deploy.fleet_gateway`) asks every peer for a certificate
from the deployment's CA, so an outsider cannot even finish the TLS handshake. Flower's
SuperNode (1.41, 1.42) has no option for a client certificate: its Fleet client is
``FleetHttpClient.from_server_address`` (``flwr.supercore.protobuf.client``), which builds
an ``ssl.SSLContext`` from the root certificates alone. :func:`install`, called in the
SuperNode's own process before it connects, replaces that classmethod on
``FleetHttpClient`` with one that builds the same context and loads the node's
certificate chain into it; everything else stays Flower's.

The certificate is issued by ``fedpriv deploy keys --certs`` for the node's own Flower key
(the OpenSSH file given to ``--auth-supernode-private-key``), so the key that signs each
Fleet request and the key of the TLS session are one. Python's ``ssl`` loads keys from
files only: the key goes, as PEM, into an anonymous memory file (``memfd_create``) that
is read once and closed, never onto disk. :func:`check` says when the installed Flower
no longer matches (``tests/test_deploy_gateway_nodes.py`` fails then).
"""

from __future__ import annotations

import inspect
import os
import ssl
from pathlib import Path
from typing import Any

from tasks.config import ConfigError

CLIENT = "flwr.supernode.fleet_http_client.FleetHttpClient"


def check() -> str | None:
    """Why the patch cannot apply to the installed Flower (None: it can)."""
    from flwr.supercore.protobuf.client import ProtobufClient
    from flwr.supernode.fleet_http_client import FleetHttpClient

    if not issubclass(FleetHttpClient, ProtobufClient):
        return f"{CLIENT} is no longer a ProtobufClient"
    init = inspect.signature(ProtobufClient.__init__).parameters
    if not {"base_url", "interceptors", "verify", "retry_invoker"} <= set(init):
        return "ProtobufClient.__init__ no longer takes base_url, interceptors, verify, " \
               "retry_invoker"
    made = inspect.signature(FleetHttpClient.from_server_address).parameters
    if list(made)[:4] != ["server_address", "insecure", "root_certificates", "interceptors"]:
        return f"{CLIENT}.from_server_address changed its parameters"
    import flwr.supernode.fleet_http_connection as conn

    if "FleetHttpClient.from_server_address(" not in inspect.getsource(conn):
        return "the SuperNode no longer makes its Fleet client with from_server_address"
    return None


def context(cert: Path, key: Path, roots: bytes | str | None) -> ssl.SSLContext:
    """A TLS client context that trusts ``roots`` (PEM bytes, a file, or the system's) and
    presents ``cert`` with the node's OpenSSH private ``key``."""
    from cryptography.hazmat.primitives import serialization

    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if isinstance(roots, bytes):
        ctx = ssl.create_default_context(cadata=roots.decode("ascii"))
    elif isinstance(roots, str):
        ctx = ssl.create_default_context(cafile=roots)
    try:
        private = serialization.load_ssh_private_key(key.read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"{key}: not the OpenSSH private key `fedpriv deploy keys` made "
                          f"({exc}); copy it again unchanged.") from None
    pem = private.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    fd = os.memfd_create("fedpriv-node-key", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        ctx.load_cert_chain(str(cert), f"/proc/self/fd/{fd}")
    except ssl.SSLError as exc:
        raise ConfigError(f"{cert} does not belong to the key {key} ({exc.reason}); use the "
                          f"certificate `fedpriv deploy keys --certs` wrote beside it.") from None
    finally:
        os.close(fd)
    return ctx


def install(cert: Path, key: Path) -> None:
    """Make this process's Flower Fleet client present ``cert`` (for ``key``); a
    ConfigError before any connection when the files do not fit or Flower changed."""
    why = check()
    if why:
        raise ConfigError(f"cannot present a TLS client certificate with this Flower: {why}. "
                          "Install the Flower version fedpriv pins (pip install -e .).")
    if not cert.is_file():
        raise ConfigError(f"--client-cert {str(cert)!r} is not a file; copy the node's "
                          "certificate (supernode-I.crt, made by `fedpriv deploy keys "
                          "--certs`) to this host.")
    context(cert, key, None)  # the pair fits: fail now, not at the first connection
    from flwr.supernode.fleet_http_client import FleetHttpClient

    def from_server_address(cls: Any, server_address: str, insecure: bool,
                            root_certificates: bytes | str | None, interceptors: Any, *,
                            retry_invoker: Any = None) -> Any:
        if insecure:
            raise ConfigError("a TLS client certificate needs TLS: drop --insecure and "
                              "give the deployment's ca.crt.")
        return cls(f"https://{server_address}", interceptors=interceptors,
                   verify=context(cert, key, root_certificates), retry_invoker=retry_invoker)

    FleetHttpClient.from_server_address = classmethod(from_server_address)  # type: ignore
