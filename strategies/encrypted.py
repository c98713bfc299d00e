"""Rounds aggregated under CKKS homomorphic encryption: the server sums ciphertexts.

What NVIDIA FLARE offers and Flower does not, built on :mod:`privacy.encryption`:

1. **Key setup** (once per run, also after a resume): the clients share one CKKS secret
   key through the server, which relays X25519 public keys and HPKE-sealed boxes it cannot
   open (:mod:`privacy.encryption.keyshare`); the server keeps the public context.
2. **A round**: the sampled clients (the plain rounds' rule) train and send
   ``weight * update`` encrypted, plus what the disclosure policy allows in the clear
   (as under SecAgg+: their partition id, and the DP status with local DP). The server
   checks that every ciphertext parses in the run's context, adds them in partition order,
   and asks one client holding the key to decrypt **only the sum**; the decrypted count
   slot must equal the number of clients summed. The server never decrypts an update
   itself; its known ways around that (an active key substitution, key recovery from raw
   CKKS decryptions after Li & Micciancio 2021) are listed in docs/PRIVACY.md.
3. The weighted average (weights: the record counts), or, under
   central DP, the sum of the clients' clipped updates released through the same
   DP-FedAvg mechanism as every other path, with CKKS's encoding error accounted as
   extra sensitivity (like SecAgg+'s quantization).

It is a :class:`strategies.rounds.RoundRunner`, so the loop and ledger do not care.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from privacy.dp.accounting import clients_per_round
from privacy.dp.dpfedavg import CLIP_KEY
from privacy.encryption import ckks
from tasks import messages
from tasks.config import RunConfig

from .central_dp import CentralPrivacy, central_params
from .grid import FederationGrid
from .rounds import (
    DEAD_WORKER,
    RoundLog,
    RoundResult,
    WorkerLost,
    metrics_of,
    short_reason,
    split_replies,
)
from .secure import cohort
from .state import RunnerState


class KeySetupFailed(RuntimeError):
    """A client failed in the HE key setup or while decrypting the aggregate."""


def encoding_slack(num_parameters: int) -> float:
    """The most CKKS encoding can lengthen one client's update (L2): each slot moves by at
    most N / (2 * scale)."""
    return math.sqrt(num_parameters) * ckks.ENCODING_ERROR


def he_central(cfg: RunConfig, num_clients: int, num_parameters: int) -> CentralPrivacy:
    """Central DP over HE rounds: DP-FedAvg with CKKS's encoding error accounted."""
    return CentralPrivacy(central_params(cfg, num_clients, encoding_slack(num_parameters)),
                          cfg.privacy.central_clipping, cfg.training.seed)


class EncryptedRounds:
    """One HE-aggregated round at a time, over the nodes found by client discovery."""

    def __init__(self, cfg: RunConfig, grid: FederationGrid, partition_of: Mapping[int, int],
                 central: CentralPrivacy | None = None) -> None:
        self.cfg = cfg
        self.grid = grid
        self.partition_of = dict(partition_of)
        self.central = central
        self.timeout = cfg.federation.round_timeout
        self.per_round = clients_per_round(len(self.partition_of), cfg.federation.fraction_train,
                                           cfg.federation.min_train_clients)
        self.min_replies = min(cfg.federation.min_train_clients, len(self.partition_of))
        self.public: bytes | None = None
        self.key_holders: list[int] = []  # node ids holding the secret key

    def state(self) -> RunnerState:
        return ({"central": self.central.state()} if self.central is not None else {}), {}

    def restore(self, state: RunnerState) -> None:
        if self.central is not None:
            self.central.restore(state[0]["central"])

    def _ask(self, node_ids: list[int], action: str, records: Mapping[int, ConfigRecord]
             ) -> dict[int, Message]:
        out = [Message(RecordDict({"config": ConfigRecord({}),
                                   **({messages.HE_STATE: records[n]} if n in records else {})}),
                       message_type=action, dst_node_id=n) for n in node_ids]
        replies = {self.grid.node_of(m): m for m in self.grid.send_and_receive(
            out, timeout=self.timeout)}
        bad = [(self.partition_of.get(n, -1), replies[n].error.reason if n in replies
                else f"no answer within {self.timeout:.0f} s (round-timeout)")
               for n in node_ids if n not in replies or replies[n].has_error()]
        if bad:
            pid, reason = bad[0]
            if DEAD_WORKER.search(reason):
                raise WorkerLost(f"{action}: the Ray worker serving client {pid} died "
                                 f"({short_reason(reason)})")
            what = "decrypting the aggregate" if action == messages.HE_DECRYPT else \
                f"the HE key setup ({action})"
            raise KeySetupFailed(f"{what}: client {pid} failed: {short_reason(reason)}")
        return replies

    def setup(self) -> None:
        """Share one CKKS key among all the run's clients; keep its public context."""
        nodes = sorted(self.partition_of, key=lambda n: self.partition_of[n])
        hello = self._ask(nodes, messages.HE_HELLO, {})
        dealer, others = nodes[0], nodes[1:]
        dealt = self._ask([dealer], messages.HE_DEAL, {dealer: ConfigRecord({
            "partitions": [self.partition_of[n] for n in others],
            "public-keys": [hello[n].content.config_records[messages.HE_STATE]["public-key"]
                            for n in others]})})[dealer].content.config_records[
            messages.HE_STATE]
        if others:
            self._ask(others, messages.HE_INSTALL, {
                n: ConfigRecord({"sealed": box}) for n, box in zip(others, dealt["sealed"],
                                                                    strict=True)})
        self.public = bytes(dealt["public-context"])
        self.key_holders = nodes

    def fit_config(self, server_round: int) -> dict[str, Any]:
        config: dict[str, Any] = {"server-round": server_round,
                                  "local-epochs": self.cfg.training.local_epochs}
        if self.central is not None:
            config[CLIP_KEY] = self.central.clipping_norm
        return config

    def run_round(self, server_round: int, arrays: ArrayRecord) -> RoundResult:
        if self.public is None:
            self.setup()
        if self.central is not None:
            self.central.last_round_released = False
        log = RoundLog(server_round)
        nodes = cohort(self.partition_of, self.cfg.training.seed, server_round, self.per_round)
        log.sampled = sorted(self.partition_of[n] for n in nodes)
        config = ConfigRecord(self.fit_config(server_round))
        out = [Message(RecordDict({"arrays": arrays, "config": config}),
                       message_type=messages.HE_FIT, dst_node_id=n) for n in nodes]
        chunks = ckks.num_chunks(sum(int(np.prod(a.shape)) for a in arrays.values()))
        ok, log.skipped, log.failures = split_replies(
            self.grid, self.partition_of, self.grid.send_and_receive(out, timeout=self.timeout),
            check=lambda m: _has_ciphertexts(m, chunks))
        total = self._sum(ok, log)  # drops (as failures) replies whose ciphertexts are bad
        log.clients = [{"partition-id": self._pid(m), **metrics_of(m),
                        "upload-bytes": sum(len(c) for c in _chunks(m))} for m in ok]
        log.check_not_all_failed(self.min_replies)
        new = self._decrypt(server_round, arrays, ok, total) if ok else None
        log.train_done = time.perf_counter()
        return RoundResult(new, log, arrays)

    def _pid(self, msg: Message) -> int:
        return self.partition_of.get(msg.metadata.src_node_id, -1)

    def _sum(self, ok: list[Message], log: RoundLog) -> list[bytes]:
        """The ciphertext sum of the replies in ``ok``; a reply whose ciphertext does not
        parse in the run's context is moved from ``ok`` to the round's failures."""
        while ok:
            try:
                return ckks.add(self.public or b"", [_chunks(m) for m in ok],
                                [f"client {self._pid(m)}" for m in ok])
            except ckks.CiphertextRejected as exc:
                if exc.index is None:
                    raise
                bad = ok.pop(exc.index)
                log.failures.append({"partition-id": self._pid(bad),
                                     "node-id": bad.metadata.src_node_id,
                                     "error": f"UpdateRejected: CiphertextRejected: {exc}"})
        return []

    def _decrypt(self, server_round: int, arrays: ArrayRecord, ok: list[Message],
                 total: list[bytes]) -> ArrayRecord:
        """Have a client that replied (so is alive, and holds the key) decrypt the sum; check
        its count slot; turn it into the next global model."""
        glob = arrays.to_numpy_ndarrays()
        length = sum(a.size for a in glob)
        replied = {m.metadata.src_node_id for m in ok}
        holder = next(n for n in self.key_holders if n in replied)
        reply = self._ask([holder], messages.HE_DECRYPT, {holder: ConfigRecord(
            {"ciphertexts": total, "length": length})})[holder]
        record = reply.content.array_records["arrays"]
        values = record["sum"].numpy()
        ckks.check_count(record["counts"].numpy(), len(ok))
        weight, summed = float(values[length]), values[:length]
        if self.central is not None:  # equal weights: the sum of the clipped updates
            result = self.central.release(server_round, glob, _unflatten(summed, glob))
        else:
            result = [(g + u).astype(g.dtype) for g, u in
                      zip(glob, _unflatten(summed / weight, glob), strict=True)]
        return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(arrays.keys(), result,
                                                                     strict=True)})


def _chunks(msg: Message) -> list[bytes]:
    return list(msg.content.config_records[messages.HE_STATE]["ciphertexts"])


def _has_ciphertexts(msg: Message, expected: int) -> str | None:
    record = msg.content.config_records.get(messages.HE_STATE)
    if record is None or not record.get("ciphertexts"):
        return "no ciphertexts in the reply"
    got = len(record["ciphertexts"])
    return None if got == expected else \
        f"{got} ciphertexts for a model that needs {expected}"


def _unflatten(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    out, i = [], 0
    for a in like:
        out.append(flat[i:i + a.size].reshape(a.shape))
        i += a.size
    return out
