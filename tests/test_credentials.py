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
