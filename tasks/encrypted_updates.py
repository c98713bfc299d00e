"""How signed encrypted updates travel between server and decrypting client (HE rounds).

A ``ConfigRecord`` holds flat lists only, so the server relays the round's updates as the
senders' partition ids, their signatures, and every ciphertext in sender order (each sender
sent the same number), and the signed declines (a client that declined to train signs a
statement with no ciphertexts) apart. Both sides read and write it here, so the layout is
defined once.
"""

from __future__ import annotations

from collections.abc import Sequence

from flwr.app import ConfigRecord

from privacy.encryption.cohort import CohortRefused, SignedUpdate


def to_record(server_round: int, updates: Sequence[SignedUpdate], length: int,
              cohort: Sequence[int] = ()) -> ConfigRecord:
    """A decryption request: the round, the signed updates to sum, the model's length, the
    cohort the senders were told of."""
    summed = [u for u in updates if u.chunks]
    declines = [u for u in updates if not u.chunks]  # signed, with no ciphertexts
    return ConfigRecord({"server-round": server_round, "length": length,
                         "cohort": [int(c) for c in cohort],
                         "partitions": [u.partition for u in summed],
                         "signatures": [u.signature for u in summed],
                         "ciphertexts": [c for u in summed for c in u.chunks],
                         "declined-partitions": [u.partition for u in declines],
                         "declined-signatures": [u.signature for u in declines]})


def cohort_of(record: ConfigRecord) -> list[int]:
    """The declared cohort a decryption request carries (empty: none)."""
    return [int(c) for c in record.get("cohort", [])]


def from_record(record: ConfigRecord) -> list[SignedUpdate]:
    """The signed updates of a decryption request; an inconsistent layout is refused."""
    partitions = [int(p) for p in record.get("partitions", [])]
    signatures = [bytes(s) for s in record.get("signatures", [])]
    chunks = [bytes(c) for c in record.get("ciphertexts", [])]
    if not partitions or len(signatures) != len(partitions) or len(chunks) % len(partitions):
        raise CohortRefused(f"a decryption request with {len(partitions)} senders, "
                            f"{len(signatures)} signatures and {len(chunks)} ciphertexts: "
                            "every sender needs one signature and the same number of "
                            "ciphertexts")
    k = len(chunks) // len(partitions)
    declined = [int(p) for p in record.get("declined-partitions", [])]
    declined_signatures = [bytes(s) for s in record.get("declined-signatures", [])]
    if len(declined) != len(declined_signatures):
        raise CohortRefused("a decryption request whose declines do not each carry one "
                            "signature")
    return [*(SignedUpdate(p, tuple(chunks[i * k:(i + 1) * k]), s)
              for i, (p, s) in enumerate(zip(partitions, signatures, strict=True))),
            *(SignedUpdate(p, (), s)
              for p, s in zip(declined, declined_signatures, strict=True))]
