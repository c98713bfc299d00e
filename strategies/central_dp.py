"""Central (client-level) DP: Flower's DP-FedAvg wrappers with a client-level accountant.

DP-FedAvg (McMahan et al. 2018): each sampled client's update is clipped to L2 norm S,
the server averages the m clipped updates **with equal weights** and adds
N(0, (z S / m)^2) noise. The mean of m updates each bounded by S changes by at most
S / m when one client is added or removed, so every round is a Gaussian mechanism
with noise multiplier z at client level. Equal weights are what that sensitivity
needs: an example-weighted mean would let a large client move it by more than S / m.
Clients therefore report ``dp-weight = 1`` and FedAvg weights by it.

Accounting uses Flower 1.41's ``RdpAccountant`` (Google's dp-accounting) with
add-or-remove-one neighbours and **no amplification by subsampling**: Flower samples
a fixed-size subset of clients each round, and we do not claim the amplification a
Poisson sample would give. The reported epsilon is therefore an upper bound; it is
exact when every client takes part in every round (fraction-train = 1).

Adaptive clipping (Andrew et al. 2021) adds noise of std sigma_b to the count of
unclipped updates too; Flower raises the update noise so that the pair of releases
is a Gaussian mechanism with the requested effective multiplier z (their Theorem 1),
which is what is composed here.

A round in which fewer than m clients reply is not aggregated (and costs nothing):
averaging k < m updates while adding noise for m would under-noise the release.
Trust model: this protects the released model from its users. The server still sees
every raw update; only local DP-SGD (or local noise) protects a client from the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from privacy.accounting import auto_delta, clients_per_round

DP_WEIGHT_KEY = "dp-weight"


class PrivacyBudgetReached(RuntimeError):
    """The next round would exceed max-epsilon."""


def central_delta(cfg: Mapping[str, Any], num_clients: int) -> float:
    """The configured delta, or 1 / (10 N) over the N clients (the unit of privacy here)."""
    return float(cfg["delta"]) or auto_delta(num_clients)


def sampled_per_round(cfg: Mapping[str, Any], num_clients: int) -> int:
    """How many clients Flower's FedAvg samples each round."""
    return clients_per_round(num_clients, float(cfg["fraction-train"]),
                             int(cfg["min-train-clients"]))


def adaptive_count_stddev_ok(noise_multiplier: float, sampled: int) -> bool:
    """Flower's adaptive clipping needs z < 2 sigma_b with its default sigma_b = m / 20."""
    return noise_multiplier < 2 * (sampled / 20)


class CentralAccountant:
    """Client-level accounting of DP-FedAvg releases (Flower's RdpAccountant)."""

    def __init__(self, cfg: Mapping[str, Any], num_clients: int) -> None:
        from flwr.serverapp import (
            NeighboringRelation,
            PrivacyConfig,
            RdpAccountant,
            SamplingMethod,
        )

        self.noise_multiplier = float(cfg["noise-multiplier"])
        self.clipping = str(cfg["central-clipping"])
        self.sampled = sampled_per_round(cfg, num_clients)
        self.population = num_clients
        self.delta = central_delta(cfg, num_clients)
        self.max_epsilon = float(cfg["max-epsilon"]) or None
        self.accountant = RdpAccountant(PrivacyConfig(
            target_delta=self.delta, population_size=num_clients,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION, max_epsilon=self.max_epsilon))
        self.clipping_norm = float(cfg["clipping-norm"])
        self.last_round_released = False

    def event(self) -> Any:
        from flwr.serverapp import GaussianPrivacyEvent

        return GaussianPrivacyEvent(noise_multiplier=self.noise_multiplier,
                                    sample_size=self.sampled, population_size=self.population)

    def check(self, server_round: int) -> None:
        """Raise :class:`PrivacyBudgetReached` if releasing this round would exceed max-epsilon."""
        if self.max_epsilon is not None and self.accountant.would_exceed(self.event()):
            raise PrivacyBudgetReached(
                f"round {server_round} would take client-level epsilon from "
                f"{self.epsilon:.3f} past max-epsilon = {self.max_epsilon}")

    def release(self) -> None:
        self.accountant.compose(self.event())
        self.last_round_released = True

    @property
    def epsilon(self) -> float:
        return self.accountant.get_epsilon(self.delta) if self.accountant.num_releases else 0.0

    def describe(self) -> dict[str, Any]:
        """The privacy part of a ledger record."""
        return {"mode": "central", "epsilon": self.epsilon, "delta": self.delta,
                "noise-multiplier": self.noise_multiplier, "clipping": self.clipping,
                "clipping-norm": self.clipping_norm, "sampled": self.sampled,
                "population": self.population, "releases": self.accountant.num_releases,
                "released-this-round": self.last_round_released,
                "accounting": "RDP, add-or-remove-one client, no subsampling amplification"}


class CentralDP(Strategy):
    """Wrap an equal-weight FedAvg in Flower's DP wrapper; account every released round."""

    def __init__(self, inner: Strategy, cfg: Mapping[str, Any], num_clients: int) -> None:
        self.privacy = CentralAccountant(cfg, num_clients)
        z, s, m = self.privacy.noise_multiplier, self.privacy.clipping_norm, self.privacy.sampled
        wrappers = {
            "server-fixed": lambda: DifferentialPrivacyServerSideFixedClipping(inner, z, s, m),
            "client-fixed": lambda: DifferentialPrivacyClientSideFixedClipping(inner, z, s, m),
            "server-adaptive": lambda: DifferentialPrivacyServerSideAdaptiveClipping(
                inner, z, m, initial_clipping_norm=s),
            "client-adaptive": lambda: DifferentialPrivacyClientSideAdaptiveClipping(
                inner, z, m, initial_clipping_norm=s),
        }
        self.dp = wrappers[self.privacy.clipping]()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.privacy.check(server_round)
        return list(self.dp.configure_train(server_round, arrays, config, grid))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = [r for r in replies if not r.has_error()]
        self.privacy.last_round_released = False
        if len(replies) != self.privacy.sampled:
            return None, None  # see the module docstring: no under-noised release
        arrays, metrics = self.dp.aggregate_train(server_round, replies)
        if arrays is not None:
            self.privacy.clipping_norm = float(self.dp.clipping_norm)  # adaptive moves it
            self.privacy.release()
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.dp.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        return self.dp.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.dp.summary()
