"""The client's side of homomorphic-encryption aggregation (``secure-aggregation = "he"``).

Key setup (:mod:`privacy.encryption.keyshare`): every client answers ``he_hello`` with an
X25519 public key; the dealer answers ``he_deal`` with the CKKS public context and the
secret context sealed for each other client; each client opens its box (``he_install``).
Each client also makes an Ed25519 signing key; the server relays the public halves as the
run's roster, whose digest is bound into every sealed key. A round (``train.he``): train,
then send ``weight * update`` encrypted (:mod:`privacy.encryption.ckks`), signed for this
round and the client the server named to decrypt it; at most one update per round. The
named client (``he_decrypt``) checks the signatures and that at least the minimum cohort of
distinct clients is in the sum, adds the ciphertexts itself and decrypts once per round
(:mod:`privacy.encryption.cohort`). The keys live in ``Context.state`` and are never
written to disk (:data:`clients.state_store.TRANSIENT`): a resumed run makes new ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context

from privacy.encryption import ckks, cohort, keyshare
from tasks.messages import HE_STATE

from . import contributions
from .update import Client, local_update

MIN_COHORT = "he-min-cohort"  # node_config key: a host may demand a larger minimum cohort


def _keys(context: Context) -> ConfigRecord:
    if HE_STATE not in context.state.config_records:
        context.state[HE_STATE] = ConfigRecord({})
    return context.state.config_records[HE_STATE]


def run_name(context: Context) -> str:
    """What binds a sealed key to its run: the run folder's name."""
    return Path(str(context.run_config.get("run-dir") or "run")).name


def hello(context: Context) -> tuple[bytes, bytes]:
    """Fresh X25519 (key exchange) and Ed25519 (signing) pairs for this run; the public
    halves go to the server."""
    private, public = keyshare.node_keypair()
    signing, verify = cohort.signing_keypair()
    keys = _keys(context)
    keys["node-private"], keys["signing-private"], keys["signing-public"] = \
        private, signing, verify
    return public, verify


def _keep_roster(context: Context, partition_id: int, roster: Mapping[int, bytes]) -> bytes:
    """Keep the roster the server relayed; it must hold this client's own signing key."""
    keys = _keys(context)
    if "signing-public" not in keys:
        raise RuntimeError("HE key setup before he_hello: this client has no signing key")
    if roster.get(partition_id) != bytes(keys["signing-public"]):
        raise ValueError(f"the roster the server relayed does not hold client {partition_id}'s "
                         "own signing key: refusing the key setup")
    keys["roster-partitions"] = sorted(roster)
    keys["roster-keys"] = [roster[p] for p in sorted(roster)]
    return cohort.roster_digest(roster)


def roster(context: Context) -> dict[int, bytes]:
    keys = _keys(context)
    return {int(p): bytes(k) for p, k in zip(keys.get("roster-partitions", []),
                                             keys.get("roster-keys", []), strict=True)}


def deal(context: Context, partition_id: int, partitions: list[int], publics: list[bytes],
         signers: Mapping[int, bytes]) -> tuple[bytes, list]:
    """As the dealer: a new CKKS context, kept; its secret sealed for every other client,
    bound to the roster of signing keys the dealer was shown."""
    digest = _keep_roster(context, partition_id, signers)
    secret = ckks.new_secret_context()
    _keys(context)["secret"] = secret
    run = run_name(context)
    sealed = [keyshare.seal(secret, pub, run, pid, digest)
              for pid, pub in zip(partitions, publics, strict=True)]
    return ckks.public_context(secret), sealed


def install(context: Context, partition_id: int, sealed: bytes,
            signers: Mapping[int, bytes]) -> None:
    """Open the key the dealer sealed; it opens only under the dealer's roster."""
    keys = _keys(context)
    if "node-private" not in keys:
        raise RuntimeError("he_install before he_hello: this client has no key-exchange key")
    digest = _keep_roster(context, partition_id, signers)
    keys["secret"] = keyshare.open_sealed(sealed, bytes(keys["node-private"]),
                                          run_name(context), partition_id, digest)


def min_cohort(client: Client, context: Context) -> int:
    """The fewest distinct clients this client lets a decrypted sum hold: the run's
    ``he-min-cohort``, raised by its host's node config, never below two."""
    own = context.node_config.get(MIN_COHORT, 0)
    try:
        own = int(own)
    except (TypeError, ValueError):
        raise ValueError(f"node config {MIN_COHORT} = {own!r} is not a whole number; give "
                         f"e.g. {MIN_COHORT}=3 or leave it out") from None
    return max(client.cfg.secagg.he_min_cohort, own, cohort.MIN_COHORT_FLOOR)


def _next_round(context: Context, what: str, server_round: int) -> None:
    """Claim ``server_round`` for ``what`` (sign, decrypt): once per round, rounds increase."""
    keys = _keys(context)
    last = int(keys.get(what, 0))
    if server_round <= last:
        verb = "signed an update" if what == "last-signed" else "decrypted a sum"
        raise cohort.CohortRefused(f"this client already {verb} for round {last}; refusing "
                                   f"round {server_round} (once per round, rounds increase)")
    keys[what] = server_round


def secret(context: Context) -> bytes:
    keys = _keys(context)
    if "secret" not in keys:
        raise RuntimeError("this client holds no HE key for the run (the key setup did not "
                           "reach it): it cannot encrypt or decrypt")
    return bytes(keys["secret"])


def encrypted_update(client: Client, context: Context, arrays: Mapping[str, Any],
                     config: Mapping[str, Any], simulated: bool = False
                     ) -> tuple[list[bytes] | None, bytes | None, dict[str, Any]]:
    """Train on the global model, then encrypt ``weight * (new - old)`` with the shared key
    (weight 1 under central DP, where the update is clipped, else the record count: CKKS's
    error is absolute, so weights are not scaled down) and sign it for this round and
    decryptor. (None, None, metrics) when it declined to train."""
    secret(context)  # no key: fail before training
    if "server-round" not in config or "he-decryptor" not in config:
        raise ValueError("an HE round must name its round and the client that will decrypt "
                         "the sum (server-round, he-decryptor)")
    server_round, decryptor = int(config["server-round"]), int(config["he-decryptor"])
    if decryptor not in roster(context):
        raise cohort.CohortRefused(f"the named decryptor {decryptor} is not in this run's "
                                   "roster")
    declared = sorted({int(p) for p in config.get("he-cohort", [])})
    guard, radius = contributions.settings(client.cfg.secagg.contribution_record,
                                           client.cfg.secagg.contribution_radius,
                                           context.node_config, simulated)
    if guard and (client.partition_id not in declared or decryptor not in declared
                  or not set(declared) <= set(roster(context))):
        raise cohort.CohortRefused(
            f"the round's declared cohort {declared} must hold this client "
            f"({client.partition_id}) and the decryptor ({decryptor}), all from the roster: "
            "the contribution record binds each update to one whole cohort")
    _next_round(context, "last-signed", server_round)
    state = {k: v for k, v in arrays.items()}
    secret_seed = None
    if guard:
        with contributions.held(context, radius, simulated) as record:  # saved before training
            entry = record.claim([v.numpy() for v in state.values()], declared, "he",
                                 server_round,
                                 contributions.request_context(config, context.run_config),
                                 client.round_seed(server_round)
                                 if simulated and not client.cfg.privacy.secure_rng else None)
        secret_seed = entry.seed
    new_state, metrics = local_update(client, context, state, config, secret_seed)
    if guard:
        contributions.ContributionRecord.check_replay(entry, new_state is None)
    if new_state is None:  # declined: a signed statement with no ciphertexts, so that the
        # round's decryptor can tell a decline (nothing in the sum) from a dropped update
        return [], cohort.sign(bytes(_keys(context)["signing-private"]), cohort.statement(
            run_name(context), server_round, client.partition_id, decryptor, [],
            declared)), metrics
    update = np.concatenate([(new_state[k].numpy().astype(np.float64)
                              - state[k].numpy().astype(np.float64)).ravel() for k in state])
    weight = 1.0 if client.cfg.privacy.dp == "central" else float(metrics["num-examples"])
    chunks = ckks.encrypt(secret(context), update, weight)
    signature = cohort.sign(bytes(_keys(context)["signing-private"]), cohort.statement(
        run_name(context), server_round, client.partition_id, decryptor, chunks, declared))
    return chunks, signature, metrics


def decrypt_sum(client: Client, context: Context, server_round: int,
                updates: list[cohort.SignedUpdate], length: int, declared: list[int],
                simulated: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """As the round's decryptor: check the cohort (signatures over the declared cohort,
    distinct members, the minimum, with the contribution record the whole declared
    cohort), add the ciphertexts here and decrypt the sum, once per round."""
    last = int(_keys(context).get("last-decrypted", 0))
    if server_round <= last:
        _next_round(context, "last-decrypted", server_round)  # refuses
    cohort.check_cohort(updates, roster(context), run_name(context), server_round,
                        client.partition_id, min_cohort(client, context), declared,
                        # exact whenever the senders signed a cohort (they may keep a
                        # record even when this host does not), or this host keeps one
                        exact=bool(declared) or contributions.settings(
                            client.cfg.secagg.contribution_record,
                            client.cfg.secagg.contribution_radius, context.node_config,
                            simulated)[0])
    _next_round(context, "last-decrypted", server_round)
    summed = [u for u in updates if u.chunks]  # signed declines add nothing
    total = ckks.add(secret(context), [u.chunks for u in summed],
                     [f"client {u.partition}" for u in summed])
    values, counts = ckks.decrypt(secret(context), total, length)
    ckks.check_count(counts, len(summed))
    return values, counts
