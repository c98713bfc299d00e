"""TLS certificates and SuperNode keys for a deployment, made with ``cryptography``.

``write_certificates`` makes a private certificate authority and a server certificate
signed by it for the SuperLink. Its subject alternative names hold every host name or
address the SuperNodes use **and** 127.0.0.1 and localhost, because the SuperLink's own
SuperExec connects to it over loopback with the same certificate (Flower 1.41).
``write_node_keys`` makes one ECDSA P-384 key pair per SuperNode in OpenSSH format, what
``flower-supernode --auth-supernode-private-key`` reads and ``flwr supernode register``
takes (the same keys ``ssh-keygen -t ecdsa -b 384`` writes).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tasks.config import ConfigError

LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Certificates:
    """The three files the SuperLink needs (``ca`` is also every SuperNode's root)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_folder(cls, folder: Path) -> Certificates:
        return cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")

    def check(self) -> Certificates:
        missing = [str(p) for p in (self.ca, self.cert, self.key) if not p.is_file()]
        if missing:
            raise ConfigError(f"certificate files missing: {', '.join(missing)}. Make them with "
                              "`fedpriv deploy certs FOLDER --host NAME_OR_IP`.")
        return self


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpriv deployment"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_certificates(folder: Path, hosts: Sequence[str], days: int = 365) -> Certificates:
    """A CA and a SuperLink certificate for ``hosts`` (plus loopback) in ``folder``."""
    bad = [h for h in hosts if not h or any(c.isspace() or c in "/\\:" for c in h)]
    if bad:
        raise ConfigError(f"--host {bad[0]!r} is not a host name or IP address; give the "
                          "name or address SuperNodes will connect to, e.g. --host "
                          "server.lab.example or --host 10.0.0.5.")
    folder.mkdir(parents=True, exist_ok=True)
    out = Certificates.in_folder(folder)
    now = dt.datetime.now(dt.UTC)
    valid = {"not_valid_before": now - dt.timedelta(minutes=5),
             "not_valid_after": now + dt.timedelta(days=days)}
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder(**valid).subject_name(_name("fedpriv CA"))
          .issuer_name(_name("fedpriv CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA384()))
    names = list(dict.fromkeys([*hosts, *LOOPBACK]))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder(**valid).subject_name(_name(names[0]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out.key, key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    _write_private(folder / "ca.key", ca_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return out


def certificate_hosts(cert: Path) -> list[str]:
    """The names and addresses a certificate is valid for."""
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    san = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in san.get_values_for_type(x509.DNSName)] + \
        [str(v) for v in san.get_values_for_type(x509.IPAddress)]


def write_node_keys(folder: Path, count: int, prefix: str = "supernode") -> list[Path]:
    """``count`` ECDSA P-384 key pairs, ``<prefix>-<i>`` (private) and ``.pub``."""
    if count < 1:
        raise ConfigError(f"--nodes {count}: give at least 1 SuperNode.")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        key = ec.generate_private_key(ec.SECP384R1())
        path = folder / f"{prefix}-{i}"
        _write_private(path, key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()))
        path.with_suffix(".pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            + f" fedpriv-{prefix}-{i}\n".encode())
        paths.append(path)
    return paths
