"""The client's side of homomorphic-encryption aggregation (``secure-aggregation = "he"``).

Key setup (:mod:`privacy.encryption.keyshare`): every client answers ``he_hello`` with an
X25519 public key; the dealer answers ``he_deal`` with the CKKS public context and the
secret context sealed for each other client; each client opens its box (``he_install``).
A round (``train.he``): train, then send ``weight * update`` encrypted
(:mod:`privacy.encryption.ckks`); a client holding the key decrypts only the aggregate
(``he_decrypt``). The keys live in ``Context.state`` and are never written to disk
(:data:`clients.state_store.TRANSIENT`): a resumed run makes new ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context

from privacy.encryption import ckks, keyshare
from tasks.messages import HE_STATE

from .update import Client, local_update


def _keys(context: Context) -> ConfigRecord:
    if HE_STATE not in context.state.config_records:
        context.state[HE_STATE] = ConfigRecord({})
    return context.state.config_records[HE_STATE]


def run_name(context: Context) -> str:
    """What binds a sealed key to its run: the run folder's name."""
    return Path(str(context.run_config.get("run-dir") or "run")).name


def hello(context: Context) -> bytes:
    """A fresh X25519 pair for this run's key exchange; the public half goes to the server."""
    private, public = keyshare.node_keypair()
    _keys(context)["node-private"] = private
    return public


def deal(context: Context, partitions: list[int], publics: list[bytes]) -> tuple[bytes, list]:
    """As the dealer: a new CKKS context, kept; its secret sealed for every other client."""
    secret = ckks.new_secret_context()
    _keys(context)["secret"] = secret
    run = run_name(context)
    sealed = [keyshare.seal(secret, pub, run, pid) for pid, pub in zip(partitions, publics,
                                                                      strict=True)]
    return ckks.public_context(secret), sealed


def install(context: Context, partition_id: int, sealed: bytes) -> None:
    keys = _keys(context)
    if "node-private" not in keys:
        raise RuntimeError("he_install before he_hello: this client has no key-exchange key")
    keys["secret"] = keyshare.open_sealed(sealed, bytes(keys["node-private"]),
                                          run_name(context), partition_id)


def secret(context: Context) -> bytes:
    keys = _keys(context)
    if "secret" not in keys:
        raise RuntimeError("this client holds no HE key for the run (the key setup did not "
                           "reach it): it cannot encrypt or decrypt")
    return bytes(keys["secret"])


def encrypted_update(client: Client, context: Context, arrays: Mapping[str, Any],
                     config: Mapping[str, Any]) -> tuple[list[bytes] | None, dict[str, Any]]:
    """Train on the global model, then encrypt ``weight * (new - old)`` with the shared key:
    weight 1 under central DP (the update is clipped), else the record count (CKKS's error
    is absolute, so weights are not scaled down). None when it declined to train."""
    secret(context)  # no key: fail before training
    state = {k: v for k, v in arrays.items()}
    new_state, metrics = local_update(client, context, state, config)
    if new_state is None:
        return None, metrics
    update = np.concatenate([(new_state[k].numpy().astype(np.float64)
                              - state[k].numpy().astype(np.float64)).ravel() for k in state])
    weight = 1.0 if client.cfg.privacy.dp == "central" else float(metrics["num-examples"])
    return ckks.encrypt(secret(context), update, weight), metrics


def decrypt_sum(context: Context, chunks: list[bytes], length: int
                ) -> tuple[np.ndarray, np.ndarray]:
    return ckks.decrypt(secret(context), chunks, length)
