"""Turns what a round runner observed, plus the server's evaluation, into ledger records."""

from __future__ import annotations

import time
from typing import Any

from privacy.dp.disclosure import declined
from strategies.rounds import RoundLog, short_reason
from tasks.results.folder import RunFolder
from tasks.results.info import RunInfo
from tasks.results.ledger import RoundRecord, headline_epsilon

from .console import say, table_header, table_row
from .privacy_log import AnonymizationLog, PrivacyLog


def weighted_mean(clients: list[dict[str, Any]], key: str) -> float | None:
    """Example-weighted mean of one client metric over the clients that reported it."""
    pairs = [(int(c["num-examples"]), float(c[key])) for c in clients
             if key in c and "num-examples" in c]
    total = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / total if total else None


def train_summary(log: RoundLog) -> dict[str, Any]:
    """Example-weighted train loss/accuracy over the clients that trained this round.

    Computed from the per-client metrics rather than taken from the strategy, because
    DP-FedAvg and SecAgg+ aggregate no metrics, and they are absent when the clients do
    not disclose them (:mod:`privacy.dp.disclosure`).
    """
    out: dict[str, Any] = {"num-examples": sum(int(c.get("num-examples", 0))
                                               for c in log.clients),
                           "clients": len(log.clients)}
    for key in ("loss", "accuracy"):
        if (value := weighted_mean(log.clients, f"train-{key}")) is not None:
            out[key] = value
    return out


class RoundRecorder:
    """Writes one ledger record per round, prints the progress table, keeps run.json's
    running fields (``info``) up to date."""

    def __init__(self, run: RunFolder, info: RunInfo, privacy: PrivacyLog,
                 anonymization: AnonymizationLog) -> None:
        self.run = run
        self.info = info
        self.privacy = privacy
        self.anonymization = anonymization
        self.t_first_round: float | None = None
        self.elapsed_before = 0.0  # a resumed run's elapsed time before it was resumed

    def initial(self, test: dict[str, float]) -> None:
        self.info.initial = test
        self.run.write_info(self.info)
        say(table_header(self.privacy.enabled))
        say(table_row(0, test, None, "-", None, 0.0 if self.privacy.enabled else None))

    def resumed(self, start: int) -> None:
        """A resumed run: the table goes on at round ``start``; elapsed time too."""
        self.elapsed_before = float(self.info.elapsed_s or 0.0)
        say(table_header(self.privacy.enabled))

    def record(self, log: RoundLog, test: dict[str, float], eval_s: float) -> RoundRecord:
        now = time.perf_counter()
        if self.t_first_round is None:
            self.t_first_round = log.started
        record = RoundRecord(
            round=log.round, test=test, train=train_summary(log), sampled=log.sampled,
            clients=log.clients, failures=log.failures,
            time={"round-s": now - log.started,
                  "train-s": (log.train_done or now) - log.started,
                  "central-eval-s": eval_s,
                  "elapsed-s": self.elapsed_before + now - self.t_first_round},
            privacy=self.privacy.update(log.round, log),
            anonymization=self.anonymization.entry(log.clients), skipped=log.skipped,
            refused=log.refused, tampered=log.tampered)
        if record.anonymization is not None:
            self.info.anonymization = {k: v for k, v in record.anonymization.items()
                                       if k != "clients"}
        if log.evaluated:
            record.client_eval = {"loss": weighted_mean(log.evaluated, "eval-loss"),
                                  "accuracy": weighted_mean(log.evaluated, "eval-accuracy"),
                                  "clients": log.evaluated}
        self.run.append_round(record)
        self.info.rounds_completed = log.round
        self.info.elapsed_s = record.time["elapsed-s"]
        self._print(record, log)
        return record

    def _print(self, record: RoundRecord, log: RoundLog) -> None:
        say(table_row(record.round, record.test, record.train,
                      f"{len(log.clients)}/{len(log.sampled)}", record.time["round-s"],
                      headline_epsilon(record.privacy)))
        why: dict[str, list[int]] = {}
        for c in log.skipped:
            why.setdefault(declined(c) or "skipped", []).append(c["partition-id"])
        for reason, ids in why.items():
            say(f"  round {log.round}: {len(ids)} client(s) sent no update, {reason}: {ids}")
        if log.refused:
            say(f"  round {log.round}: refused, the model is unchanged: {log.refused}")
        if log.tampered:
            say(f"  round {log.round}: the server sent trap weights ({log.tampered}); the "
                "global model is the honest one of the round before (accuracy as before)")
        if log.failures:
            say(f"  round {log.round}: {len(log.failures)} client error(s), e.g. client "
                f"{log.failures[0]['partition-id']}: {short_reason(log.failures[0]['error'])}")
