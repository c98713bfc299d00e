"""The privacy part of the ledger: what each client has spent, round by round.

Local DP-SGD: every client reports its own cumulative epsilon when it trains (or
declines to, its budget spent); the server keeps the latest value per client and
records the maximum and the mean over the whole population (clients never sampled
have spent nothing). This is deliberately not Flower's example-weighted average,
which would hide the clients that spent the most.

Central DP-FedAvg: the client-level epsilon of the released model, from the
strategy's accountant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strategies import RoundLog
from strategies.central_dp import CentralDP


def headline_epsilon(entry: Mapping[str, Any] | None) -> float | None:
    """The one epsilon that sums up a ledger privacy entry or a run's privacy summary:
    local DP-SGD -> the largest over clients; central DP -> the client-level epsilon."""
    if not entry:
        return None
    if entry.get("mode") == "central":
        return entry.get("epsilon")
    if entry.get("mode") == "local":
        return entry.get("epsilon-max")
    return None


def anonymization_entry(name: str, clients: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per-round summary of the clients' release scores (``anon-*`` metrics)."""
    scored = [c for c in clients if any(k.startswith("anon-") for k in c)]
    if not scored:
        return None
    keys = sorted({k for c in scored for k in c if k.startswith("anon-")})
    per = {str(c["partition-id"]): {k[5:]: c[k] for k in keys if k in c} for c in scored}
    mean = {k[5:]: sum(c[k] for c in scored if k in c) / sum(1 for c in scored if k in c)
            for k in keys}
    worst = {k[5:]: max(c[k] for c in scored if k in c) for k in keys}
    return {"anonymizer": name, "mean": mean, "max": worst, "clients": per}


class PrivacyLog:
    """Turns each round's client replies into the ``privacy`` record of the ledger."""

    def __init__(self, cfg: Mapping[str, Any], strategy: Any, num_clients: int) -> None:
        self.mode = str(cfg["dp"])
        self.target = float(cfg["target-epsilon"])
        self.num_clients = num_clients
        inner = getattr(strategy, "inner", None)
        self.central = (inner.privacy if isinstance(inner, CentralDP)
                        else getattr(strategy, "central", None))
        self.epsilon: dict[int, float] = {}
        self.delta: dict[int, float] = {}
        self.exhausted: dict[int, int] = {}  # partition id -> round it first declined
        self.secure = bool(cfg["secure-aggregation"])

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def update(self, rnd: int, log: RoundLog) -> dict[str, Any] | None:
        """Fold one round in; return its ledger entry (None without DP)."""
        if self.central is not None:
            return self.central.describe()
        if self.mode != "local":
            return None
        for c in [*log.clients, *log.skipped]:
            if "epsilon" in c:
                self.epsilon[c["partition-id"]] = float(c["epsilon"])
                self.delta[c["partition-id"]] = float(c["delta"])
        for c in log.skipped:
            self.exhausted.setdefault(c["partition-id"], rnd)
        spent = [self.epsilon.get(p, 0.0) for p in range(self.num_clients)]
        return {
            "mode": "local",
            "epsilon-max": max(spent),
            "epsilon-mean": sum(spent) / len(spent),
            "delta-max": max(self.delta.values(), default=0.0),
            "target-epsilon": self.target,
            "epsilon": {str(p): e for p, e in sorted(self.epsilon.items())},
            "skipped": [c["partition-id"] for c in log.skipped],
            "exhausted": sorted(self.exhausted),
        }

    def all_exhausted(self) -> bool:
        return self.mode == "local" and len(self.exhausted) >= self.num_clients

    def summary(self) -> dict[str, Any]:
        """For run.json and summary.md."""
        if self.central is not None:
            return self.central.describe()
        if self.mode != "local":
            return {"mode": "none"}
        spent = [self.epsilon.get(p, 0.0) for p in range(self.num_clients)]
        first = min(self.exhausted.values(), default=None)
        return {"mode": "local", "epsilon-max": max(spent), "epsilon-mean": sum(spent) / len(spent),
                "delta-max": max(self.delta.values(), default=0.0),
                "target-epsilon": self.target, "clients-out-of-budget": len(self.exhausted),
                "first-out-of-budget-round": first}
