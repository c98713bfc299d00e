"""The privacy part of the ledger: what each client has spent, round by round.

Local DP-SGD: every client reports its own cumulative epsilon when it trains (or
declines to, its budget spent); the server keeps the latest value per client and
records the maximum and the mean over the whole population (clients never sampled
have spent nothing). This is deliberately not Flower's example-weighted average,
which would hide the clients that spent the most.

Central DP-FedAvg: the client-level epsilon of the released model, from the
strategy's accountant.

Distributed DP: each client's epsilon against the server, from the rounds it took part
in and how many noise shares each of those sums held (:class:`DistributedLedger`).
"""

from __future__ import annotations

from typing import Any

from privacy.anonymize import dp_sgd_unit
from privacy.dp import distributed
from privacy.dp.accounting import ACCOUNTANT_NAMES
from privacy.dp.dpfedavg import default_central_delta
from strategies.central_dp import CentralPrivacy
from strategies.rounds import RoundLog
from tasks.config import RunConfig
from tasks.distributed_dp import plan_for


class AnonymizationLog:
    """The clients' release scores (``anon-*`` metrics), kept per client across rounds.

    A client's release is fixed for the run, so its scores do not change; the summary
    averages over every client that has reported, not just this round's sample.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.scores: dict[int, dict[str, float]] = {}

    def add(self, clients: list[dict[str, Any]]) -> list[int]:
        """Fold in replies; return the partition ids that reported scores."""
        seen = []
        for c in clients:
            scores = {k[5:]: float(v) for k, v in c.items() if k.startswith("anon-")}
            if scores:
                self.scores[int(c["partition-id"])] = scores
                seen.append(int(c["partition-id"]))
        return seen

    def state(self) -> dict[str, Any]:
        return {str(p): s for p, s in self.scores.items()}

    def restore(self, state: dict[str, Any]) -> None:
        self.scores = {int(p): dict(s) for p, s in state.items()}

    def summary(self) -> dict[str, Any] | None:
        if not self.scores:
            return None
        keys = sorted({k for s in self.scores.values() for k in s})
        mean = {k: sum(s[k] for s in self.scores.values() if k in s)
                / sum(1 for s in self.scores.values() if k in s) for k in keys}
        worst = {k: max(s[k] for s in self.scores.values() if k in s) for k in keys}
        return {"anonymizer": self.name, "clients-scored": len(self.scores), "mean": mean,
                "max": worst}

    def entry(self, clients: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The ledger record of one round: this round's clients plus the running summary."""
        seen = self.add(clients)
        summary = self.summary()
        if summary is None:
            return None
        return {**summary, "clients": {str(p): self.scores[p] for p in seen}}


class DistributedLedger:
    """Distributed DP's accounting on the server: for each client, the number of noise
    shares in every sum it was part of (who took part is public); its epsilon composes
    those rounds without amplification (the server picks the cohorts)."""

    def __init__(self, cfg: RunConfig, num_clients: int, num_parameters: int) -> None:
        self.plan = plan_for(cfg, num_parameters)
        self.num_clients = num_clients
        self.delta = cfg.privacy.delta or default_central_delta(num_clients)
        self.shares: dict[int, list[int]] = {}
        self.epsilon: dict[int, float] = {}
        self._known: dict[tuple[int, ...], float] = {}  # epsilon by a history's multiset

    def _epsilon(self, shares: list[int]) -> float:
        """A history's epsilon, computed once per distinct history (the clients of a
        round mostly share theirs; the composition does not depend on the order)."""
        key = tuple(sorted(shares))
        if key not in self._known:
            self._known[key] = self.plan.epsilon(list(key), self.delta)
        return self._known[key]

    def add(self, log: RoundLog) -> None:
        members = [c["partition-id"] for c in [*log.clients, *log.skipped]]
        for pid in members:
            self.shares.setdefault(pid, []).append(len(members))
            self.epsilon[pid] = self._epsilon(self.shares[pid])

    def describe(self) -> dict[str, Any]:
        spent = [self.epsilon.get(p, 0.0) for p in range(self.num_clients)]
        return {"mode": "distributed", "epsilon": max(spent), "epsilon-max": max(spent),
                "epsilon-mean": sum(spent) / len(spent), "delta": self.delta,
                "mechanism": "Skellam (Agarwal, Kairouz & Liu 2021) inside SecAgg+",
                **self.plan.describe(), "neighbours": distributed.NEIGHBOURS,
                "amplification": "none (the server picks the cohorts)",
                "accountant": "dp-accounting RDP (zCDP events of the Skellam sum)",
                "rounds-max": max((len(v) for v in self.shares.values()), default=0)}

    def state(self) -> dict[str, Any]:
        return {str(p): v for p, v in self.shares.items()}

    def restore(self, state: dict[str, Any]) -> None:
        self.shares = {int(p): [int(n) for n in v] for p, v in state.items()}
        self.epsilon = {p: self._epsilon(v) for p, v in self.shares.items()}


class PrivacyLog:
    """Turns each round's client replies into the ``privacy`` record of the ledger."""

    def __init__(self, cfg: RunConfig, central: CentralPrivacy | None, num_clients: int,
                 num_parameters: int = 0) -> None:
        self.mode = cfg.privacy.dp
        self.unit = dp_sgd_unit(cfg.anonymization.anonymizer, cfg.privacy.dp_train_data)
        self.relation = cfg.privacy.dp_relation
        self.accountant = ACCOUNTANT_NAMES[cfg.privacy.accountant]
        self.public = cfg.privacy.public_records
        self.target = cfg.privacy.target_epsilon
        self.num_clients = num_clients
        self.central = central
        self.epsilon: dict[int, float] = {}
        self.delta: dict[int, float] = {}
        self.exhausted: dict[int, int] = {}  # partition id -> round it first declined
        self.steps: dict[int, int] = {}  # partition id -> DP-SGD steps its ledger reported
        self.distributed = DistributedLedger(cfg, num_clients, num_parameters) \
            if self.mode == "distributed" else None

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def update(self, rnd: int, log: RoundLog) -> dict[str, Any] | None:
        """Fold one round in; return its ledger entry (None without DP)."""
        if self.central is not None:
            return self.central.describe()
        if self.distributed is not None:
            self.distributed.add(log)
            return self.distributed.describe()
        if self.mode != "local":
            return None
        for c in [*log.clients, *log.skipped]:
            if "epsilon" in c:
                self.epsilon[c["partition-id"]] = float(c["epsilon"])
                self.delta[c["partition-id"]] = float(c["delta"])
            if "dp-steps" in c:
                self.steps[c["partition-id"]] = int(c["dp-steps"])
        for c in log.skipped:
            self.exhausted.setdefault(c["partition-id"], rnd)
        return {
            **self._spent(),
            "epsilon": {str(p): e for p, e in sorted(self.epsilon.items())},
            "skipped": [c["partition-id"] for c in log.skipped],
            "exhausted": sorted(self.exhausted),
        }

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the latest epsilon and delta each client reported, and
        when each first ran out of budget (the central accountant is the runner's)."""
        return {"epsilon": {str(p): e for p, e in self.epsilon.items()},
                "delta": {str(p): d for p, d in self.delta.items()},
                "steps": {str(p): n for p, n in self.steps.items()},
                "exhausted": {str(p): r for p, r in self.exhausted.items()},
                **({"distributed-shares": self.distributed.state()}
                   if self.distributed is not None else {})}

    def restore(self, state: dict[str, Any]) -> None:
        self.epsilon = {int(p): float(e) for p, e in state["epsilon"].items()}
        self.delta = {int(p): float(d) for p, d in state["delta"].items()}
        self.exhausted = {int(p): int(r) for p, r in state["exhausted"].items()}
        self.steps = {int(p): int(n) for p, n in state.get("steps", {}).items()}
        if self.distributed is not None:
            self.distributed.restore(state.get("distributed-shares", {}))

    def stop_reason(self, server_round: int) -> str | None:
        """Why the run cannot go on: every client has spent its budget."""
        if self.mode == "local" and len(self.exhausted) >= self.num_clients:
            return (f"every client has spent its privacy budget (target-epsilon {self.target}) "
                    f"by round {server_round}")
        return None

    def summary(self) -> dict[str, Any]:
        """For run.json and summary.md."""
        if self.central is not None:
            return self.central.describe()
        if self.distributed is not None:
            return self.distributed.describe()
        if self.mode != "local":
            return {"mode": "none"}
        return {**self._spent(), "clients-out-of-budget": len(self.exhausted),
                "first-out-of-budget-round": min(self.exhausted.values(), default=None)}

    def _spent(self) -> dict[str, Any]:
        """Max and mean over all clients (a client never sampled has spent 0)."""
        spent = [self.epsilon.get(p, 0.0) for p in range(self.num_clients)]
        return {"mode": "local", "epsilon-max": max(spent), "epsilon-mean": sum(spent) / len(spent),
                "delta-max": max(self.delta.values(), default=0.0), "target-epsilon": self.target,
                "unit": self.unit, "dp-relation": self.relation,
                "neighbours": (f"add or remove one {self.unit} of a client"
                               if self.relation == "add-remove"
                               else f"replace one {self.unit} of a client"),
                "public": ("the configuration and the public size N "
                           f"({self.public or 'the expected partition size'}): q, steps, "
                           "normaliser, sigma, delta" if self.relation == "add-remove"
                           else "the configuration and each client's record count n"),
                "accountant": self.accountant}
