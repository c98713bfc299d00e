"""Deployment key files: private keys are 0600 whatever was there before, never written
through a symbolic link, and the CA's signing key is kept apart from what the SuperLink's
host needs. The CLI tests run the real ``fedpriv`` console script in a subprocess."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from experiments.deploy.credentials import (
    CA_PRIVATE,
    Certificates,
    ca_key_path,
    certificates_message,
    write_certificates,
    write_node_keys,
)
from tasks.config import ConfigError

from .conftest import REPO

FEDPRIV = REPO / ".venv" / "bin" / "fedpriv"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _fedpriv(*args: str) -> subprocess.CompletedProcess:
    """The installed ``fedpriv`` entry point, as an operator runs it (umask 022)."""
    return subprocess.run([str(FEDPRIV), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, preexec_fn=lambda: os.umask(0o022))


def _world_readable(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("old, world-readable\n")
        (folder / name).chmod(0o644)


def test_deploy_certs_and_keys_over_0644_files_leave_private_keys_0600(tmp_path):
    certs, keys = tmp_path / "certs", tmp_path / "keys"
    _world_readable(certs, ["server.key", "ca.crt", "server.pem", "ca.key"])
    _world_readable(certs / CA_PRIVATE, ["ca.key"])
    (certs / CA_PRIVATE).chmod(0o755)
    _world_readable(keys, ["supernode-0", "supernode-1", "supernode-0.pub"])

    made = _fedpriv("deploy", "certs", str(certs), "--host", "server.lab")
    assert made.returncode == 0, made.stderr
    assert _mode(certs / "server.key") == 0o600
    assert _mode(ca_key_path(certs)) == 0o600
    assert _mode(certs / CA_PRIVATE) == 0o700
    assert _mode(certs / "ca.crt") == _mode(certs / "server.pem") == 0o644
    load_pem_private_key((certs / "server.key").read_bytes(), None)  # really replaced
    assert not (certs / "ca.key").exists()  # the replaced CA's stray key is gone

    made = _fedpriv("deploy", "keys", str(keys), "--nodes", "2")
    assert made.returncode == 0, made.stderr
    for i in (0, 1):
        assert _mode(keys / f"supernode-{i}") == 0o600
        assert (keys / f"supernode-{i}").read_text().startswith("-----BEGIN OPENSSH")
        assert _mode(keys / f"supernode-{i}.pub") == 0o644
    assert not [p for p in tmp_path.rglob(".*.tmp*")]  # no temporary file left behind


def test_keys_over_0644_files_are_0600_even_under_a_permissive_umask(tmp_path):
    _world_readable(tmp_path / "certs", ["server.key"])
    _world_readable(tmp_path / "certs" / CA_PRIVATE, ["ca.key"])
    _world_readable(tmp_path / "keys", ["supernode-0"])
    old = os.umask(0o000)
    try:
        certs = write_certificates(tmp_path / "certs", ["server.lab"])
        [key] = write_node_keys(tmp_path / "keys", 1)
    finally:
        os.umask(old)
    assert _mode(certs.key) == _mode(key) == _mode(ca_key_path(tmp_path / "certs")) == 0o600


@pytest.mark.parametrize("target", ["server.key", "ca.crt", f"{CA_PRIVATE}/ca.key"])
def test_a_symlinked_certificate_path_is_refused_and_its_target_untouched(tmp_path, target):
    certs, victim = tmp_path / "certs", tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    victim.chmod(0o644)
    link = certs / target
    link.parent.mkdir(parents=True)
    link.symlink_to(victim)

    with pytest.raises(ConfigError) as err:
        write_certificates(certs, ["server.lab"])
    message = str(err.value)
    assert "symbolic link" in message and str(victim) in message and "Remove the link" in message
    assert victim.read_text() == "someone else's file\n" and _mode(victim) == 0o644
    assert link.is_symlink()
    # refused before anything was written
    assert not [p for p in certs.rglob("*") if p.is_file() and not p.is_symlink()]


def test_a_symlinked_ca_private_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "shared"
    elsewhere.mkdir()
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / CA_PRIVATE).symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="symbolic link"):
        write_certificates(tmp_path / "certs", ["server.lab"])
    assert not list(elsewhere.iterdir())


def test_deploy_keys_refuses_a_symlinked_key_through_the_cli(tmp_path):
    keys, victim = tmp_path / "keys", tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA... admin\n")
    keys.mkdir()
    (keys / "supernode-1").symlink_to(victim)

    made = _fedpriv("deploy", "keys", str(keys), "--nodes", "2")
    assert made.returncode != 0
    assert "symbolic link" in made.stderr and "supernode-1" in made.stderr
    assert "Traceback" not in made.stderr
    assert victim.read_text() == "ssh-ed25519 AAAA... admin\n"
    assert not (keys / "supernode-0").exists()  # nothing written before the refusal


def test_the_ca_signing_key_is_not_among_the_superlinks_files(tmp_path):
    certs = write_certificates(tmp_path / "certs", ["server.lab"])
    signing = ca_key_path(tmp_path / "certs")
    superlink_needs = {certs.ca, certs.cert, certs.key}
    assert signing not in superlink_needs
    assert signing.parent == tmp_path / "certs" / CA_PRIVATE
    assert sorted(p.name for p in (tmp_path / "certs").iterdir()) == [
        "ca-private", "ca.crt", "server.key", "server.pem"]
    # the key in ca-private is the one that signed the server certificate
    ca_key = load_pem_private_key(signing.read_bytes(), None)
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    server = x509.load_pem_x509_certificate(certs.cert.read_bytes())
    assert ca_key.public_key().public_numbers() == ca.public_key().public_numbers()
    server.verify_directly_issued_by(ca)
    # a folder holding only the SuperLink's three files passes its check and exposes no key
    host = tmp_path / "superlink-host"
    host.mkdir()
    for path in superlink_needs:
        (host / path.name).write_bytes(path.read_bytes())
    on_host = Certificates.in_folder(host).check()
    assert on_host.exposed_signing_keys() == []
    assert Certificates.in_folder(tmp_path / "certs").exposed_signing_keys() == [signing]


def test_deploy_certs_says_where_each_file_goes(tmp_path):
    made = _fedpriv("deploy", "certs", str(tmp_path / "certs"), "--host", "server.lab")
    assert made.returncode == 0, made.stderr
    text = certificates_message(Certificates.in_folder(tmp_path / "certs"), ["server.lab"])
    assert "ca.crt to every host" in text
    assert "server.pem + server.key to the SuperLink's host only" in text
    assert f"keep {CA_PRIVATE}/ca.key offline" in text
    assert "issue a new server certificate" in text
    assert text in made.stdout  # what the command printed


# --- TLS client certificates and the folders credentials go into ---------------------------


def _mtls_server(certs: Certificates) -> tuple[int, list[str]]:
    """A loopback TLS server that demands a client certificate from the deployment's CA
    and answers one HTTP request per connection; returns its port and what it saw."""
    import socket
    import ssl
    import threading

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(certs.cert), str(certs.key))
    ctx.load_verify_locations(str(certs.ca))
    ctx.verify_mode = ssl.CERT_REQUIRED
    sock = socket.create_server(("127.0.0.1", 0))
    seen: list[str] = []

    def serve() -> None:
        while True:
            conn, _ = sock.accept()
            try:
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    seen.append(dict(x[0] for x in tls.getpeercert()["subject"])["commonName"])
                    tls.recv(65536)
                    tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n"
                                b"connection: close\r\n\r\n")
            except (ssl.SSLError, OSError) as exc:
                seen.append(f"refused: {exc}")

    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1], seen


def test_node_keys_with_certs_get_a_client_certificate_for_the_same_key(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    certs = write_certificates(tmp_path / "certs", ["server.lab"])
    made = _fedpriv("deploy", "keys", str(tmp_path / "keys"), "--nodes", "2", "--certs",
                    str(tmp_path / "certs"))
    assert made.returncode == 0, made.stderr
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    for i in range(2):
        key = serialization.load_ssh_private_key(
            (tmp_path / "keys" / f"supernode-{i}").read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(
            (tmp_path / "keys" / f"supernode-{i}.crt").read_bytes())
        assert cert.public_key() == key.public_key()  # TLS key = the node's signing key
        cert.verify_directly_issued_by(ca)
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert _mode(tmp_path / "keys" / f"supernode-{i}.crt") == 0o644
    without = _fedpriv("deploy", "keys", str(tmp_path / "other"), "--nodes", "1")
    assert "no TLS client certificates" in without.stdout
    missing = _fedpriv("deploy", "keys", str(tmp_path / "k3"), "--nodes", "1", "--certs",
                       str(tmp_path / "keys"))
    assert missing.returncode != 0 and "holds no CA" in missing.stderr
    assert not (tmp_path / "k3").exists()  # refused before anything is written


def test_flowers_fleet_client_presents_the_nodes_certificate_and_none_without_it(tmp_path):
    """The SuperNode-side patch: Flower's own Fleet client completes a mutual-TLS
    handshake with the node's certificate; unpatched, the server refuses it."""
    import httpx
    from flwr.supernode.fleet_http_client import FleetHttpClient

    from experiments.deploy import client_cert

    certs = write_certificates(tmp_path / "certs", ["127.0.0.1"])
    [key] = write_node_keys(tmp_path / "keys", 1, certs=tmp_path / "certs")
    port, seen = _mtls_server(certs)
    roots = certs.ca.read_bytes()
    assert client_cert.check() is None
    plain = FleetHttpClient.from_server_address(f"127.0.0.1:{port}", False, roots, [])
    with pytest.raises(httpx.HTTPError):
        plain._client.get(f"https://127.0.0.1:{port}/health")
    try:
        client_cert.install(tmp_path / "keys" / "supernode-0.crt", key)
        patched = FleetHttpClient.from_server_address(f"127.0.0.1:{port}", False, roots, [])
        assert patched._client.get(f"https://127.0.0.1:{port}/health").status_code == 200
    finally:  # back to the inherited classmethod for the other tests in this process
        del FleetHttpClient.from_server_address
    assert seen[0].startswith("refused") and seen[-1] == "supernode-0"
    other = write_node_keys(tmp_path / "other", 1)[0]
    with pytest.raises(ConfigError, match="does not belong to the key"):
        client_cert.install(tmp_path / "keys" / "supernode-0.crt", other)


def test_credentials_go_only_into_a_private_folder_of_ones_own(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "linked").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        write_node_keys(tmp_path / "linked", 1)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="can be written by other users"):
        write_certificates(shared, ["server.lab"])
    assert list(target.iterdir()) == [] and list(shared.iterdir()) == []
    fresh = write_node_keys(tmp_path / "new" / "keys", 1)[0]
    assert _mode(fresh.parent) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_credentials_are_refused_into_a_folder_another_user_owns(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody: another local user
    made = _fedpriv("deploy", "keys", str(theirs), "--nodes", "1")
    assert made.returncode != 0 and "not to you" in made.stderr, made.stderr
    assert list(theirs.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_the_superlinks_state_is_refused_in_another_users_folder_and_made_private(tmp_path):
    from experiments.deploy.superlink import serve_superlink

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to another user"):
        serve_superlink(None, theirs, "127.0.0.1", 9, auth=False, nodes=0)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:  # refused after the folder check
        used = busy.getsockname()[1]
        with pytest.raises(ConfigError, match="in use"):
            serve_superlink(None, mine, "127.0.0.1", used, auth=False, nodes=0,
                            internal_port=used + 1 if used < 65535 else used - 1)
    assert _mode(mine) == 0o700
