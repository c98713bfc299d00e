"""Sharing the CKKS secret key among the clients through a server that only relays.

Each client makes an X25519 key pair and sends the server its public key. One client
(the dealer: the lowest partition id) makes the CKKS context and seals its secret for
every other client with HPKE (RFC 9180: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256,
AES-256-GCM; the ``cryptography`` package's implementation), bound to the run and the
recipient's partition. The server relays the public keys and the sealed boxes; it can
read neither. The box is also bound to the digest of the signing roster the dealer was shown
(:mod:`privacy.encryption.cohort`), so every key holder saw the dealer's roster. Trust
model: the server may deviate from the protocol but colludes with no client.
A server that substituted its own public keys (it is the only channel, with no PKI
between clients), or sealed a CKKS key of its own to every client (HPKE's base mode does
not authenticate the sender), could read the updates; fedpriv does not yet offer a key
provided per deployment out of band.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
RAW = serialization.Encoding.Raw


def node_keypair() -> tuple[bytes, bytes]:
    """(private, public) raw X25519 keys for one client's part of the key exchange."""
    key = X25519PrivateKey.generate()
    private = key.private_bytes(RAW, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
    return private, key.public_key().public_bytes(RAW, serialization.PublicFormat.Raw)


def _info(run: str, partition: int, roster: bytes) -> bytes:
    return f"fedpriv-he-key/{run}/partition-{partition}/".encode() + roster.hex().encode()


def seal(secret: bytes, recipient: bytes, run: str, partition: int,
         roster: bytes = b"") -> bytes:
    """``secret`` readable only with ``recipient``'s private key, for this run and client,
    and only by a client that was shown the same signing roster (its digest, ``roster``:
    :func:`privacy.encryption.cohort.roster_digest`) as the dealer."""
    return SUITE.encrypt(secret, X25519PublicKey.from_public_bytes(recipient),
                         info=_info(run, partition, roster))


def open_sealed(sealed: bytes, private: bytes, run: str, partition: int,
                roster: bytes = b"") -> bytes:
    try:
        return SUITE.decrypt(sealed, X25519PrivateKey.from_private_bytes(private),
                             info=_info(run, partition, roster))
    except (InvalidTag, ValueError) as exc:
        raise ValueError("the sealed HE key does not open with this client's key (it was "
                         "altered, sealed for another client or run, or the server showed "
                         f"the dealer another roster of signing keys: {exc!r})") from None
