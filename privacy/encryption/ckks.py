"""CKKS homomorphic encryption of client updates, with TenSEAL (Cheon, Kim, Kim & Song 2017,
"Homomorphic Encryption for Arithmetic of Approximate Numbers"; Benaissa et al. 2021,
TenSEAL).

A client encrypts its weighted update, then its weight, as CKKS vectors of :data:`SLOTS`
values; the server, holding only the public context, adds the clients' ciphertexts; one
client holding the secret key decrypts the sum. The last slot of every vector is a 1, so
each decrypted vector says how many clients it sums: a sum from another key, or from a
ciphertext altered on the way, fails that check instead of silently becoming a model.
(The check catches accidents; a server holding the public key could encrypt any count,
which is why the decrypting client adds only updates signed by their senders:
:mod:`privacy.encryption.cohort`.)

Parameters (fixed): ring degree N = 8192, coefficient modulus 60 + 40 + 60 bits (128-bit
security for N = 8192 by the HE standard's table), scale 2^40. Only additions are done,
so no relinearization or Galois keys are made. Precision: CKKS is approximate; the
rounding when a vector is encoded moves each slot by at most N / (2 * 2^40) = 3.7e-9
(:data:`ENCODING_ERROR`), which is the data-dependent part of the error; the rest is
encryption noise, independent of the data (measured: about 1e-8 per slot after a sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

POLY_MODULUS = 8192
COEFF_BITS = (60, 40, 60)
SCALE_BITS = 40
SLOTS = POLY_MODULUS // 2
ENCODING_ERROR = POLY_MODULUS / 2 / 2**SCALE_BITS  # the most encoding moves one slot
LIMIT = 2.0**50  # |values| far below the modulus (2^100 / 2^40 = 2^60), even summed


class CiphertextRejected(ValueError):
    """A ciphertext that does not parse, or a decrypted sum that fails its count check
    (``index``: which of the parts given to :func:`add` was rejected, if one was)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def _ts():
    import tenseal  # imported only by runs that encrypt (about 0.3 s)

    return tenseal


def new_secret_context() -> bytes:
    """A fresh CKKS context with its secret key, serialized (the clients' shared secret)."""
    ts = _ts()
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=POLY_MODULUS,
                     coeff_mod_bit_sizes=list(COEFF_BITS))
    ctx.global_scale = 2.0**SCALE_BITS
    return ctx.serialize(save_secret_key=True, save_galois_keys=False, save_relin_keys=False)


def public_context(secret: bytes) -> bytes:
    """The same context without its secret key: enough to encrypt and add, not to decrypt."""
    ctx = _ts().context_from(secret)
    ctx.make_context_public()
    return ctx.serialize(save_galois_keys=False, save_relin_keys=False)


def num_chunks(length: int) -> int:
    return -(-(length + 1) // (SLOTS - 1))


def encrypt(context: bytes, update: np.ndarray, weight: float) -> list[bytes]:
    """``weight * update`` and then ``weight``, as CKKS vectors of SLOTS - 1 values each
    followed by a 1 (the check slot)."""
    values = np.concatenate([np.asarray(update, dtype=np.float64).ravel() * weight, [weight]])
    if not np.isfinite(values).all() or np.abs(values).max() >= LIMIT:
        raise ValueError(f"an update with values beyond +-{LIMIT:.0e} (or NaN/Inf) cannot be "
                         "encrypted faithfully")
    ts = _ts()
    ctx = ts.context_from(context)
    step = SLOTS - 1
    return [ts.ckks_vector(ctx, [*values[i:i + step].tolist(), 1.0]).serialize()
            for i in range(0, len(values), step)]


def add(public: bytes, parts: Sequence[Sequence[bytes]], names: Sequence[str]) -> list[bytes]:
    """The ciphertext of the sum of every client's vector (``names``: who sent each part,
    for the error); the server's whole role, done without the secret key."""
    ts = _ts()
    ctx = ts.context_from(public)
    total = None
    lengths = {len(p) for p in parts}
    if len(lengths) != 1:
        raise CiphertextRejected(f"the clients sent different numbers of ciphertexts "
                                 f"({dict(zip(names, map(len, parts), strict=True))})")
    for index, (name, chunks) in enumerate(zip(names, parts, strict=True)):
        try:
            vectors = [ts.ckks_vector_from(ctx, bytes(c)) for c in chunks]
        except Exception as exc:  # TenSEAL raises bare ValueError/RuntimeError from SEAL
            raise CiphertextRejected(f"{name}'s ciphertext does not parse as a CKKS vector of "
                                     f"this run's context ({type(exc).__name__}: {exc}); it "
                                     "was altered or made with another context",
                                     index) from None
        total = vectors if total is None else [a + b for a, b in zip(total, vectors,
                                                                     strict=True)]
    return [v.serialize() for v in total or []]


def decrypt(secret: bytes, chunks: Sequence[bytes], length: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """The summed vector (``length`` update values, then the summed weight) and each
    ciphertext's check slot (the number of clients summed, if all is well)."""
    ts = _ts()
    ctx = ts.context_from(secret)
    try:
        plain = [np.asarray(ts.ckks_vector_from(ctx, bytes(c)).decrypt()) for c in chunks]
    except Exception as exc:
        raise CiphertextRejected(f"the aggregate does not decrypt ({type(exc).__name__}: "
                                 f"{exc})") from None
    values = np.concatenate([p[:-1] for p in plain])[:length + 1]
    return values, np.array([p[-1] for p in plain])


def check_count(counts: np.ndarray, expected: int) -> None:
    """Every ciphertext's check slot must say how many clients were summed (to well within
    CKKS noise); otherwise the sum was decrypted with another key, or a ciphertext was
    altered on the way (a change to any coefficient moves every slot of its vector)."""
    wrong = np.flatnonzero(~(np.abs(counts - expected) < 1e-3))
    if wrong.size:
        raise CiphertextRejected(
            f"the decrypted aggregate's check slot is {counts[wrong[0]]:.6g} in "
            f"{wrong.size} of its {counts.size} ciphertexts, not the {expected} clients "
            "summed: the clients do not share one key, or a ciphertext was altered on the way")
