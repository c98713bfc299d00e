"""TLS certificates and SuperNode keys for a deployment, made with ``cryptography``.

``write_certificates`` makes a private certificate authority and a server certificate
signed by it for the SuperLink. Its subject alternative names hold every host name or
address the SuperNodes use **and** 127.0.0.1 and localhost, because the SuperLink's own
SuperExec connects to it over loopback with the same certificate (Flower 1.41).
``write_node_keys`` makes one ECDSA P-384 key pair per SuperNode in OpenSSH format, what
``flower-supernode --auth-supernode-private-key`` reads and ``flwr supernode register``
takes (the same keys ``ssh-keygen -t ecdsa -b 384`` writes); given the certificates
folder, it also issues each node a TLS client certificate for that same key, which the
fleet gateway demands (mutual TLS), so only the deployment's nodes complete a handshake.
Credentials are written only into a folder the user owns that no one else may write to
and that is not a symbolic link.

Private keys are written 0600 into a fresh temporary file beside the target (created with
``O_EXCL | O_NOFOLLOW``) that is renamed over it, so a key never inherits an old file's
mode and is never written through a symbolic link; a key path that is a link is refused.
The CA's signing key goes to ``FOLDER/ca-private/ca.key`` (a 0700 folder), apart from
the three files the SuperLink's host needs: it is needed only to issue a new server
certificate and belongs offline.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tasks.config import ConfigError

LOOPBACK = ("127.0.0.1", "localhost")
CA_PRIVATE = "ca-private"  # the subfolder of the certificates folder holding ca.key


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
        read_certificate(self.ca, "--certs")
        read_certificate(self.cert, "--certs")
        try:
            serialization.load_pem_private_key(self.key.read_bytes(), password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ConfigError(f"{self.key} is not an unencrypted PEM private key ({exc}); make "
                              "the files again with `fedpriv deploy certs`.") from None
        return self

    def exposed_signing_keys(self) -> list[Path]:
        """CA signing keys lying beside the SuperLink's files (an earlier version's
        ``ca.key``, or ``ca-private/`` copied along): they belong offline, since whoever
        holds one can issue a certificate SuperNodes trust as the SuperLink."""
        folder = self.ca.parent
        return [p for p in (folder / "ca.key", folder / CA_PRIVATE / "ca.key")
                if p.is_file() or p.is_symlink()]


def read_certificate(path: Path, flag: str) -> x509.Certificate:
    """The PEM certificate at ``path``; ConfigError naming the file and ``flag`` otherwise."""
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as exc:
        raise ConfigError(f"{flag}: {path} is not a PEM certificate ({exc}); copy the "
                          "deployment's files made by `fedpriv deploy certs` again.") from None


def read_node_key(path: Path, flag: str, private: bool) -> None:
    """Check a SuperNode key file (OpenSSH format, ECDSA, as `fedpriv deploy keys` makes
    it) before Flower is given it; ConfigError naming the file and ``flag`` otherwise."""
    what = "private key" if private else "public key (.pub)"
    if not path.is_file():
        raise ConfigError(f"{flag} {str(path)!r} is not a file; give the SuperNode {what} "
                          "made by `fedpriv deploy keys`.")
    try:
        data = path.read_bytes()
        key = (serialization.load_ssh_private_key(data, password=None) if private
               else serialization.load_ssh_public_key(data))
    except (ValueError, TypeError, UnsupportedAlgorithm, OSError) as exc:
        raise ConfigError(f"{flag} {str(path)!r} is not an OpenSSH {what} ({exc}); copy the "
                          "file `fedpriv deploy keys` made again (unchanged).") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        raise ConfigError(f"{flag} {str(path)!r} is a {type(key).__name__}; Flower's SuperNode "
                          "authentication needs the ECDSA keys `fedpriv deploy keys` makes.")


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpriv deployment"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


MAX_DAYS = 3650  # ten years


def host_name(host: str) -> str:
    """``host`` as it goes into a certificate: an IP address, or a DNS name in its ASCII
    (IDNA A-label) form; ConfigError for anything else (e.g. 999.1.1.1)."""
    hint = ("give the name or address SuperNodes will connect to, e.g. --host "
            "server.lab.example or --host 10.0.0.5.")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if all(label.isdigit() for label in labels):
        raise ConfigError(f"--host {host!r} looks like an IPv4 address but is not one; {hint}")
    try:
        ascii_name = host.rstrip(".").encode("idna").decode("ascii")
    except UnicodeError:
        raise ConfigError(f"--host {host!r} is not a valid host name; {hint}") from None
    if not ascii_name or len(ascii_name) > 253 or not all(
            label and len(label) <= 63 and label.replace("-", "").isalnum()
            and not label.startswith("-") and not label.endswith("-")
            for label in ascii_name.split(".")):
        raise ConfigError(f"--host {host!r} is not a host name or IP address; {hint}")
    return ascii_name.lower()


def _make_folder(folder: Path) -> None:
    """``folder`` made (with parents, 0700 when new); ConfigError naming it when that cannot
    be done, or when it is a link or another user may change what is in it."""
    if folder.is_symlink():
        raise ConfigError(
            f"{folder} is a symbolic link (to {os.readlink(folder)}); fedpriv writes "
            "certificates and keys only into a real folder you own, because whoever controls "
            "the link's target could swap the files afterwards. Name a folder of your own "
            "(it is made if missing), then run the command again.")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{folder} is a file, not a folder: name a folder to write the "
                          "certificates or keys into.") from None
    except OSError as exc:
        raise ConfigError(f"cannot make the folder {folder} ({exc.strerror}); name a folder "
                          "you can write to.") from None
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot write into {folder} (no permission); name a folder you "
                          "can write to.")
    _own_folder(folder)


def _own_folder(folder: Path) -> None:
    """ConfigError unless ``folder`` belongs to this user and no one else may write in it:
    another user who owns or can write to it could replace ``ca.crt``, a key or
    ``ca-private/`` after fedpriv wrote them."""
    info = folder.stat()
    me = os.geteuid()
    if info.st_uid != me:
        owner = _user_name(info.st_uid)
        raise ConfigError(
            f"{folder} belongs to {owner}, not to you; they could replace the certificates "
            "or keys written there (a CA, a server key, a node key) after fedpriv wrote "
            "them. Name a folder you own (it is made if missing), then run the command "
            "again.")
    if info.st_mode & 0o022:
        raise ConfigError(
            f"{folder} can be written by other users (mode {info.st_mode & 0o777:o}); they "
            "could replace the certificates or keys written there. Make it private (chmod "
            f"700 {folder}) or name another folder, then run the command again.")


def _user_name(uid: int) -> str:
    import pwd

    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refuse_link(path: Path, what: str) -> None:
    if path.is_symlink():
        raise ConfigError(
            f"{path} is a symbolic link (to {os.readlink(path)}); fedpriv does not write "
            f"{what} through a link, because the link's target, not the folder you named, "
            "would receive it, with whatever permissions that file has. Remove the link "
            f"(rm {path}) or choose another folder, then run the command again.")


def _write_file(path: Path, data: bytes, mode: int, what: str) -> None:
    """Write ``data`` to ``path`` with exactly ``mode``, atomically and never through a
    link: a fresh temporary file beside it (``O_EXCL | O_NOFOLLOW``), fsynced, then
    renamed over ``path`` (a rename replaces a file or link itself, it follows nothing)."""
    _refuse_link(path, what)
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; it cannot be replaced by {what}. Move it "
                          "away or choose another folder.")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # exactly ``mode``, whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)  # the rename itself survives a crash
    finally:
        os.close(folder)


def _write_private(path: Path, data: bytes) -> None:
    """A private key: 0600 whatever existed at ``path`` before, never through a link."""
    _write_file(path, data, 0o600, "a private key")


def _write_public(path: Path, data: bytes) -> None:
    """A certificate or public key (0644), also never through a link."""
    _write_file(path, data, 0o644, "a certificate or public key")


def _private_folder(path: Path) -> Path:
    """``path`` as a folder only its owner can open (0700), made if missing."""
    _refuse_link(path, "the CA's signing key")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file; fedpriv keeps the CA's signing key in a folder "
                          "of that name. Move the file away, then run the command again.")
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def ca_key_path(folder: Path) -> Path:
    """Where ``write_certificates(folder, ...)`` keeps the CA's signing key."""
    return folder / CA_PRIVATE / "ca.key"


def certificates_message(made: Certificates, hosts: Sequence[str]) -> str:
    """What ``fedpriv deploy certs`` prints: which file goes to which host."""
    return (f"wrote {made.ca}, {made.cert}, {made.key} and {ca_key_path(made.ca.parent)}; "
            f"valid for {', '.join(hosts)}, 127.0.0.1 and localhost.\n"
            f"  copy {made.ca.name} to every host (SuperLink and SuperNodes);\n"
            f"  {made.cert.name} + {made.key.name} to the SuperLink's host only;\n"
            f"  keep {CA_PRIVATE}/ca.key offline (it is needed only to issue a new server "
            "certificate; whoever holds it can impersonate the SuperLink).")


def write_certificates(folder: Path, hosts: Sequence[str], days: int = 365) -> Certificates:
    """A CA and a SuperLink certificate for ``hosts`` (plus loopback) in ``folder``.

    ``folder`` gets ``ca.crt``, ``server.pem`` and ``server.key``; the CA's signing key
    goes to ``folder/ca-private/ca.key`` (see :func:`ca_key_path`). A ``ca.key`` left
    beside them by an earlier version is the replaced CA's and is removed."""
    hosts = [host_name(h) for h in hosts]
    if not 1 <= days <= MAX_DAYS:
        raise ConfigError(f"--days {days}: a certificate must be valid for 1 to {MAX_DAYS} days "
                          "from now (0 or less would expire before SuperNodes use it).")
    _make_folder(folder)
    out = Certificates.in_folder(folder)
    for path in (out.ca, out.cert, out.key, ca_key_path(folder)):  # before any write
        _refuse_link(path, "a certificate or key")
    private = _private_folder(folder / CA_PRIVATE)
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
    pkcs8 = (serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
             serialization.NoEncryption())
    _write_private(private / "ca.key", ca_key.private_bytes(*pkcs8))
    _write_private(out.key, key.private_bytes(*pkcs8))
    _write_public(out.ca, ca.public_bytes(serialization.Encoding.PEM))
    _write_public(out.cert, cert.public_bytes(serialization.Encoding.PEM))
    stale = folder / "ca.key"  # where earlier versions put the (now replaced) CA's key
    if stale.is_symlink() or stale.is_file():
        stale.unlink()
    return out


def certificate_hosts(cert: Path) -> list[str]:
    """The names and addresses a certificate is valid for."""
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    san = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in san.get_values_for_type(x509.DNSName)] + \
        [str(v) for v in san.get_values_for_type(x509.IPAddress)]


def write_node_keys(folder: Path, count: int, prefix: str = "supernode",
                    certs: Path | None = None) -> list[Path]:
    """``count`` ECDSA P-384 key pairs, ``<prefix>-<i>`` (private) and ``.pub``; with
    ``certs`` (a folder made by :func:`write_certificates`), also ``<prefix>-<i>.crt``, a
    TLS client certificate for the same key from the deployment's CA, which the fleet
    gateway demands before any request (mutual TLS)."""
    if not 1 <= count <= 10_000:
        raise ConfigError(f"--nodes {count}: give 1 to 10,000 SuperNodes.")
    issuer = _issuer(certs) if certs is not None else None
    _make_folder(folder)
    for i in range(count):  # refuse before anything is written
        for path in (folder / f"{prefix}-{i}", folder / f"{prefix}-{i}.pub",
                     folder / f"{prefix}-{i}.crt"):
            _refuse_link(path, "a SuperNode key")
    paths = []
    for i in range(count):
        key = ec.generate_private_key(ec.SECP384R1())
        path = folder / f"{prefix}-{i}"
        _write_private(path, key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()))
        _write_public(path.with_suffix(".pub"), key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            + f" fedpriv-{prefix}-{i}\n".encode())
        if issuer is not None:
            _write_public(client_certificate_path(path), client_certificate(
                key.public_key(), f"{prefix}-{i}", *issuer))
        paths.append(path)
    return paths


def client_certificate_path(key: Path) -> Path:
    """Where :func:`write_node_keys` puts the TLS client certificate of node key ``key``."""
    return key.with_name(key.name + ".crt")


def _issuer(certs: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The deployment's CA certificate and signing key from a ``fedpriv deploy certs``
    folder; ConfigError saying what is missing."""
    ca, key = certs / "ca.crt", ca_key_path(certs)
    if not (ca.is_file() and key.is_file()):
        raise ConfigError(
            f"--certs {str(certs)!r} holds no CA: it needs ca.crt and {CA_PRIVATE}/ca.key, "
            "as `fedpriv deploy certs FOLDER --host NAME` writes them (run this where the "
            "CA's signing key is kept).")
    certificate = read_certificate(ca, "--certs")
    try:
        signing = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{key} is not the CA's PEM signing key ({exc}); make the files "
                          "again with `fedpriv deploy certs`.") from None
    if not isinstance(signing, ec.EllipticCurvePrivateKey) or \
            signing.public_key() != certificate.public_key():
        raise ConfigError(f"{key} does not belong to {ca}; make the files again with "
                          "`fedpriv deploy certs`.")
    return certificate, signing


def client_certificate(public: ec.EllipticCurvePublicKey, name: str, ca: x509.Certificate,
                       ca_key: ec.EllipticCurvePrivateKey) -> bytes:
    """A PEM TLS client certificate (clientAuth only) for a node's own key, valid while
    the CA is."""
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca.subject)
            .public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(ca.not_valid_after_utc)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    return cert.public_bytes(serialization.Encoding.PEM)
