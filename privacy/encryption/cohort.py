"""The minimum cohort under HE, enforced by the client that decrypts, not by the server.

Under single-key CKKS every client holds the secret key and the server chooses what it asks
a client to decrypt. Left to the server, "decrypt only the sum" fails against an active
server: it can sample a cohort of one, drop all replies but one, or send one client's
ciphertext alone for decryption. Here the decrypting client checks the sum itself, in the
spirit of SecAgg+'s threshold (Bell et al. 2020): nothing below ``minimum`` distinct clients
is ever decrypted.

* **Signed updates.** In the key setup each client makes an Ed25519 signing key (RFC 8032,
  ``cryptography``'s implementation) and the server relays the public halves as the run's
  *roster* (partition id -> key). The roster's digest is bound into every sealed CKKS key
  (:mod:`privacy.encryption.keyshare`), so a client that installed the key holds the
  dealer's roster. With its ciphertexts a client signs a :func:`statement` naming the run,
  the round, itself, the client that will decrypt, and the hash of every ciphertext.
* **One update per round.** A client signs at most one update per round (rounds strictly
  increase), so the server cannot have it train twice for one round with different
  settings and compare.
* **One decryption per round.** The decrypting client decrypts at most once per round,
  only updates signed for this round and naming it, from at least ``minimum`` distinct
  roster members, and adds the ciphertexts itself. Since each client's update for a round
  names one decryptor, which decrypts once, every update is inside exactly one decrypted
  sum of at least ``minimum`` clients.

Who it protects against: a server that deviates from the protocol (drops, forges, replays
or re-orders messages, lies about the cohort) but does not hold a client's secret and did
not substitute the roster. What it does not stop, stated in docs/PRIVACY.md: a server that
substitutes keys in the roster at setup (it is the only channel between clients, as in
SecAgg+ without a PKI), a server colluding with any client (each holds the CKKS secret), and
a server that makes the other clients' contributions known by the models or settings it
sends them (the malicious-server study's subject).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

MIN_COHORT_FLOOR = 2  # no setting, the server's or a node's, goes below a sum of two
_RAW = serialization.Encoding.Raw


class CohortRefused(ValueError):
    """A decryption request the decrypting client refuses (too few distinct clients, a bad
    or missing signature, a replayed or second request for a round)."""


def signing_keypair() -> tuple[bytes, bytes]:
    """(private, public) raw Ed25519 keys a client signs its encrypted updates with."""
    key = Ed25519PrivateKey.generate()
    return (key.private_bytes(_RAW, serialization.PrivateFormat.Raw,
                              serialization.NoEncryption()),
            key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw))


def roster_digest(roster: Mapping[int, bytes]) -> bytes:
    """A hash of the roster (partition id -> signing key), in partition order."""
    h = hashlib.sha256(b"fedpriv-he-roster\0")
    for pid in sorted(roster):
        h.update(pid.to_bytes(8, "big", signed=True) + hashlib.sha256(roster[pid]).digest())
    return h.digest()


def statement(run: str, server_round: int, partition: int, decryptor: int,
              chunks: Sequence[bytes], cohort: Sequence[int] = ()) -> bytes:
    """What a client signs with its update: run, round, sender, decryptor, the cohort the
    server declared for the round (empty: none declared), ciphertexts."""
    h = hashlib.sha256(b"fedpriv-he-update\0" + run.encode() + b"\0")
    for n in (server_round, partition, decryptor, len(chunks)):
        h.update(int(n).to_bytes(8, "big", signed=True))
    members = sorted({int(c) for c in cohort})
    h.update(len(members).to_bytes(8, "big"))
    for c in members:
        h.update(c.to_bytes(8, "big", signed=True))
    for c in chunks:
        h.update(hashlib.sha256(c).digest())
    return h.digest()


def sign(private: bytes, message: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).sign(message)


@dataclass(frozen=True)
class SignedUpdate:
    """One client's encrypted update as relayed by the server."""

    partition: int
    chunks: tuple[bytes, ...]
    signature: bytes


def check_signature(update: SignedUpdate, roster: Mapping[int, bytes], run: str,
                    server_round: int, decryptor: int, cohort: Sequence[int] = ()) -> None:
    """Raise :class:`CohortRefused` unless ``update`` carries its sender's signature over
    this run, round, decryptor and declared cohort."""
    key = roster.get(update.partition)
    if key is None:
        raise CohortRefused(f"an update claims to come from client {update.partition}, "
                            "which is not in this run's roster")
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(
            update.signature, statement(run, server_round, update.partition, decryptor,
                                        update.chunks, cohort))
    except (InvalidSignature, ValueError):
        raise CohortRefused(f"client {update.partition}'s update does not carry its "
                            f"signature for round {server_round} and decryptor {decryptor} "
                            "(forged, altered, replayed from another round, or meant for "
                            "another decryptor)") from None


def check_cohort(updates: Sequence[SignedUpdate], roster: Mapping[int, bytes], run: str,
                 server_round: int, decryptor: int, minimum: int,
                 cohort: Sequence[int] = (), exact: bool = False) -> None:
    """Everything the decrypting client requires before it sums and decrypts: at least
    ``minimum`` (never below :data:`MIN_COHORT_FLOOR`) distinct roster members, each
    signed for this round, this decryptor and the declared ``cohort``, all with the same
    number of ciphertexts; with ``exact``, the senders are the whole declared cohort (no
    subset of a cohort is decrypted: a subset's sum differs from the whole's by the
    missing members' updates)."""
    minimum = max(minimum, MIN_COHORT_FLOOR)
    senders = [u.partition for u in updates]
    if len(set(senders)) != len(senders):
        raise CohortRefused(f"the same client appears twice in the sum (clients {senders}): "
                            "an update counts once")
    if len(set(map(bytes, (roster.get(p, b"") for p in senders)))) != len(senders):
        raise CohortRefused("two clients of the sum share one signing key in the roster: "
                            "they may be one client")
    summed = [u.partition for u in updates if u.chunks]  # a signed decline adds nothing
    if len(summed) < minimum:
        raise CohortRefused(f"refusing to decrypt a sum of {len(summed)} client(s) "
                            f"({sorted(summed)}) in round {server_round}: the minimum "
                            f"cohort is {minimum} distinct clients, so that no client's "
                            "update is ever decrypted alone")
    if len({len(u.chunks) for u in updates if u.chunks}) != 1:
        raise CohortRefused("the updates to sum have different numbers of ciphertexts")
    for u in updates:
        check_signature(u, roster, run, server_round, decryptor, cohort)
    if exact and sorted(set(senders)) != sorted({int(c) for c in cohort}):
        raise CohortRefused(f"the updates to sum come from {sorted(set(senders))}, not the "
                            f"whole cohort {sorted({int(c) for c in cohort})} their senders "
                            "were told of: a part of a cohort is never decrypted")
