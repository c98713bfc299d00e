"""HE rounds: the clients' updates travel under CKKS homomorphic encryption.

What NVIDIA FLARE offers and Flower does not, built on :mod:`privacy.encryption`:

1. **Key setup** (once per run, also after a resume): the clients share one CKKS secret
   key through the server, which relays X25519 public keys and HPKE-sealed boxes it cannot
   open (:mod:`privacy.encryption.keyshare`); the server keeps the public context.
   Each client also sends an Ed25519 signing key; the server relays them as the run's
   roster (:mod:`privacy.encryption.cohort`).
2. **A round**: the sampled clients (the plain rounds' rule) train and send
   ``weight * update`` encrypted and signed for this round and for the client the server
   names to decrypt it (the cohort's first in partition order), plus what the disclosure
   policy allows in the clear (as under SecAgg+: their partition id, and the DP status
   with local DP). The server drops replies whose ciphertexts do not parse or whose
   signature does not verify, then relays the signed updates to the named client, which
   checks the signatures and that at least ``he-min-cohort`` distinct clients are in the
   sum, adds them itself and decrypts **only the sum**, once per round. A round with fewer
   is refused and recorded, never decrypted: the decrypting client enforces it, so a
   server that deviates cannot get one client's update decrypted. The server never
   decrypts an update itself; what remains (roster substitution, collusion with a client,
   key recovery from raw CKKS decryptions after Li & Micciancio 2021) is listed in
   docs/PRIVACY.md.
3. The server gets the decrypted weighted sum and the sum of the weights (the record
   counts; under central DP every weight is 1, so the sum of the clients' clipped
   updates, which the aggregation releases as every other sum, with CKKS's encoding
   error accounted as extra sensitivity, like SecAgg+'s quantization).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp.strategy import Strategy

from privacy.encryption import ckks
from privacy.encryption.cohort import MIN_COHORT_FLOOR, CohortRefused, SignedUpdate, check_signature
from tasks import messages
from tasks.config import RunConfig
from tasks.encrypted_updates import to_record

from ..aggregation import Aggregation, Collected
from ..grid import FederationGrid
from ..replies import metrics_of, split_replies
from ..rounds import DEAD_WORKER, RoundLog, WorkerLost, short_reason
from . import cohort, per_round


class KeySetupFailed(RuntimeError):
    """A client failed in the HE key setup or while decrypting the aggregate."""


def encoding_slack(num_parameters: int) -> float:
    """The most CKKS encoding can lengthen one client's update (L2): each slot moves by at
    most N / (2 * scale)."""
    return math.sqrt(num_parameters) * ckks.ENCODING_ERROR


class HEProtocol:
    """One HE-aggregated round at a time, over the nodes found by client discovery."""

    individual_updates = False

    def __init__(self, cfg: RunConfig, grid: FederationGrid,
                 partition_of: Mapping[int, int]) -> None:
        self.cfg = cfg
        self.grid = grid
        self.partition_of = dict(partition_of)
        self.timeout = cfg.federation.round_timeout
        self.per_round = per_round(cfg, len(self.partition_of))
        self.min_replies = min(cfg.federation.min_train_clients, len(self.partition_of))
        self.min_cohort = cfg.secagg.he_min_cohort
        self.public: bytes | None = None
        self.roster: dict[int, bytes] = {}  # partition id -> the client's signing key
        self.num_parameters = 0  # the model's size, for the encoding slack run.json records
        self._declared: list[int] = []  # the round's cohort, as told to its clients
        self._declines: list[SignedUpdate] = []  # its signed declines (no ciphertexts)

    @classmethod
    def for_run(cls, cfg: RunConfig, grid: FederationGrid, partition_of: Mapping[int, int],
                *, evaluation: Strategy | None = None, context: Context | None = None,
                max_weight: float = 0.0, num_parameters: int = 0) -> HEProtocol:
        protocol = cls(cfg, grid, partition_of)
        protocol.num_parameters = num_parameters
        return protocol

    @staticmethod
    def slack(cfg: RunConfig, num_parameters: int) -> float:
        return encoding_slack(num_parameters)

    def describe(self) -> dict[str, Any]:
        floor = max(self.min_cohort, MIN_COHORT_FLOOR)
        return {
            "protocol": "CKKS homomorphic encryption (TenSEAL)",
            # what the decrypting client enforces: never a sum of fewer than `floor` clients
            "individual-updates-visible": floor < 2, "min-cohort": floor,
            "min-cohort-enforced-by": "the decrypting client (updates signed per round and "
                                      "decryptor; one decryption per round)",
            "key": "shared among the clients (X25519 + HPKE), relayed by the server, which "
                   "holds only the public context",
            "poly-modulus-degree": ckks.POLY_MODULUS, "coeff-mod-bits": list(ckks.COEFF_BITS),
            "scale-bits": ckks.SCALE_BITS, "encoding-slack": encoding_slack(self.num_parameters),
            "decryption": "the cohort's first client checks the signed updates, sums and "
                          "decrypts them (under central DP, before the server adds the "
                          "noise); it sees the sum"}

    def evaluate(self, server_round: int, arrays: ArrayRecord, log: RoundLog) -> None:
        return None  # the clients' own evaluation would send per-client numbers in the clear

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
        hello = {n: m.content.config_records[messages.HE_STATE]
                 for n, m in self._ask(nodes, messages.HE_HELLO, {}).items()}
        self.roster = {self.partition_of[n]: bytes(hello[n]["signing-key"]) for n in nodes}
        roster = {"roster-partitions": list(self.roster),
                  "roster-keys": list(self.roster.values())}
        dealer, others = nodes[0], nodes[1:]
        dealt = self._ask([dealer], messages.HE_DEAL, {dealer: ConfigRecord({
            "partitions": [self.partition_of[n] for n in others],
            "public-keys": [hello[n]["public-key"] for n in others], **roster})})[
            dealer].content.config_records[messages.HE_STATE]
        if others:
            self._ask(others, messages.HE_INSTALL, {
                n: ConfigRecord({"sealed": box, **roster})
                for n, box in zip(others, dealt["sealed"], strict=True)})
        self.public = bytes(dealt["public-context"])

    def collect(self, server_round: int, arrays: ArrayRecord, config: dict[str, Any],
                aggregation: Aggregation, log: RoundLog) -> Collected | None:
        """Train, check and relay the signed ciphertexts; the named client decrypts the sum."""
        if self.public is None:
            self.setup()
        nodes = cohort(aggregation, self.partition_of, self.cfg.training.seed, server_round,
                       self.per_round)
        log.sampled = sorted(self.partition_of[n] for n in nodes)
        # the cohort the clients sign and the decryptor decrypts only whole (with the
        # contribution record; without it, none is declared and a part may be decrypted)
        self._declared = list(log.sampled) if self.cfg.secagg.contribution_record else []
        if len(nodes) < self.min_cohort:
            log.refused = (f"only {len(nodes)} client(s) to sample, fewer than he-min-cohort "
                           f"= {self.min_cohort}: nothing trained or decrypted")
            return None
        decryptor = log.sampled[0]
        config = ConfigRecord({**config, "he-decryptor": decryptor,
                               "he-cohort": self._declared})
        out = [Message(RecordDict({"arrays": arrays, "config": config}),
                       message_type=messages.HE_FIT, dst_node_id=n) for n in nodes]
        chunks = ckks.num_chunks(sum(int(np.prod(a.shape)) for a in arrays.values()))
        replies = list(self.grid.send_and_receive(out, timeout=self.timeout))
        ok, log.skipped, log.failures = split_replies(
            self.grid, self.partition_of, replies,
            check=lambda m: _has_ciphertexts(m, chunks) or self._unsigned(m, server_round,
                                                                         decryptor),
            asked=nodes, timeout=self.timeout)
        # clients that declined to train (DP budget spent, screen) and signed it: in the
        # cohort, adding nothing to the sum
        skipped = {c["partition-id"] for c in log.skipped}
        self._declines = [_signed(m, self._pid(m)) for m in replies
                          if not m.has_error() and self._pid(m) in skipped
                          and messages.HE_STATE in m.content.config_records
                          and self._unsigned(m, server_round, decryptor) is None]
        self._drop_unparsable(ok, log)
        log.clients = [{"partition-id": self._pid(m), **metrics_of(m),
                        "upload-bytes": sum(len(c) for c in _chunks(m))} for m in ok]
        log.check_not_all_failed(self.min_replies)
        log.refused = self._below_minimum(ok, decryptor)
        if not ok or log.refused is not None:
            return None
        return self._decrypt(server_round, arrays, ok, decryptor, log)

    def _unsigned(self, msg: Message, server_round: int, decryptor: int) -> str | None:
        """Why a reply's signature does not verify (the decryptor would refuse it)."""
        signature = msg.content.config_records[messages.HE_STATE].get("signature")
        if not signature:
            return "no signature with the ciphertexts"
        try:
            check_signature(_signed(msg, self._pid(msg)), self.roster, self._run_name(),
                            server_round, decryptor, self._declared)
        except CohortRefused as exc:
            return f"CohortRefused: {exc}"
        return None

    def _run_name(self) -> str:
        """What the clients bind their signatures to (clients.encrypted.run_name)."""
        return Path(self.cfg.results.run_dir or "run").name

    def _below_minimum(self, ok: list[Message], decryptor: int) -> str | None:
        """Why this round's sum may not be decrypted, or None."""
        if len(ok) < self.min_cohort:
            return (f"{len(ok)} valid encrypted update(s), fewer than he-min-cohort = "
                    f"{self.min_cohort}: not decrypted (the model stays as it was)")
        members = {self._pid(m) for m in ok} | {u.partition for u in self._declines}
        if self.cfg.secagg.contribution_record and members != set(self._declared):
            missing = sorted(set(self._declared) - members)
            return (f"client(s) {missing} of the declared cohort sent no valid update, and "
                    "the clients' contribution records let only a whole cohort's sum be "
                    "decrypted: not decrypted (the model stays as it was)")
        if decryptor not in {self._pid(m) for m in ok}:
            return (f"client {decryptor}, named to decrypt this round, sent no valid update "
                    "(the others signed their updates for it alone): not decrypted")
        return None

    def _pid(self, msg: Message) -> int:
        return self.partition_of.get(msg.metadata.src_node_id, -1)

    def _drop_unparsable(self, ok: list[Message], log: RoundLog) -> None:
        """Move from ``ok`` to the round's failures every reply whose ciphertexts do not
        parse in the run's context (so one garbage reply fails only its sender)."""
        while ok:
            try:
                ckks.add(self.public or b"", [_chunks(m) for m in ok],
                         [f"client {self._pid(m)}" for m in ok])
                return
            except ckks.CiphertextRejected as exc:
                if exc.index is None:
                    raise
                bad = ok.pop(exc.index)
                log.failures.append({"partition-id": self._pid(bad),
                                     "node-id": bad.metadata.src_node_id,
                                     "error": f"UpdateRejected: CiphertextRejected: {exc}"})

    def _decrypt(self, server_round: int, arrays: ArrayRecord, ok: list[Message],
                 decryptor: int, log: RoundLog) -> Collected | None:
        """Relay the signed updates to the round's decryptor, which checks and sums them and
        decrypts the sum; check its count slot. A refusal by the decryptor (e.g. its host
        demands a larger cohort) is recorded."""
        glob = arrays.to_numpy_ndarrays()
        length = sum(a.size for a in glob)
        holder = next(m.metadata.src_node_id for m in ok if self._pid(m) == decryptor)
        request = to_record(server_round, [*(_signed(m, self._pid(m)) for m in ok),
                                           *self._declines], length, self._declared)
        try:
            reply = self._ask([holder], messages.HE_DECRYPT, {holder: request})[holder]
        except KeySetupFailed as exc:
            if "CohortRefused" not in str(exc):
                raise
            log.refused = f"the decrypting client refused: {exc}"
            return None
        record = reply.content.array_records["arrays"]
        values = record["sum"].numpy()
        ckks.check_count(record["counts"].numpy(), len(ok))
        return Collected(total=_unflatten(values[:length], glob), weight=float(values[length]),
                         count=len(ok))


def _chunks(msg: Message) -> list[bytes]:
    return list(msg.content.config_records[messages.HE_STATE]["ciphertexts"])


def _signed(msg: Message, partition: int) -> SignedUpdate:
    record = msg.content.config_records[messages.HE_STATE]
    return SignedUpdate(partition, tuple(bytes(c) for c in record["ciphertexts"]),
                        bytes(record.get("signature", b"")))


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
