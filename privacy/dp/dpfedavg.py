"""DP-FedAvg (McMahan et al. 2018): client-level DP for the released global model.

The mechanism, per round:

1. sample clients: **Poisson** (each of the N clients independently with probability
   q) or a **fixed-size** cohort of m (Flower's default sampling);
2. clip every sampled client's update to L2 norm C (Flat clipping);
3. sum the clipped updates, add N(0, (z_u C)^2) per coordinate, and divide by a
   **fixed** denominator d (qN for Poisson, m for a fixed cohort), never by the number
   of replies actually received: the released update is g + (sum + noise) / d.

Neighbouring relation: **add or remove one client** (all of its data). Sensitivity of
the sum, hence privacy per round:

- Poisson, q < 1: adding a client adds at most C to the sum, so the round is the
  Poisson-subsampled Gaussian mechanism with multiplier z (amplification by
  subsampling is claimed, because the sampling really is Poisson).
- every client every round (q = 1, or m = N): the Gaussian mechanism with multiplier z.
- fixed cohort m < N: a client that joins the population can take the place of
  another in the cohort, so the sum moves by up to 2C: the Gaussian mechanism with
  multiplier z / 2. No amplification is claimed for fixed-size sampling (an upper bound;
  use Poisson sampling to be credited for sampling).

Dividing by the number of replies instead (Flower's DP wrappers) lets one client move
the mean by up to 2C/m even when everyone takes part; the fixed denominator avoids
that, and makes dropouts harmless for privacy (a missing reply only removes a term).

Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive
Clipping"): clients' bits b_i = 1[||update_i|| <= C] are summed as b_i - 1/2 with
N(0, sigma_b^2) noise, divided by d, and C <- C exp(-eta (b_mean - gamma)) moves C
towards the gamma-quantile of the update norms. Their Theorem 1: the pair (update sum
with multiplier z_u, centred bit sum with std sigma_b) is exactly a Gaussian mechanism
with multiplier z = (z_u^-2 + (2 sigma_b)^-2)^-1/2, so z_u is raised from z to keep the
requested effective z, which is what is accounted.

Accounting: Google's dp-accounting, composed over every released round: its
privacy-loss distribution by default (Koskela et al. 2020; Doroshenko et al. 2022; the
tightest valid figure), or its RDP (Mironov 2017; Mironov, Talwar and Zhang 2019 for the
sampled Gaussian) with ``accountant = "rdp"``. This module
is plain numpy + dp-accounting: it knows nothing of Flower.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .correlated import MatrixMechanism
from .modes import CENTRAL_MECHANISMS, CLIENT_SAMPLINGS
from .noise import gaussian_noise, noise_rng

if TYPE_CHECKING:  # dp-accounting is imported where it is used: clients need only `clip`
    from dp_accounting import DpEvent

CLIP_KEY = "clipping-norm"  # round config: the norm clients clip their own update to
UNCLIPPED_KEY = "unclipped"  # reply: 1 if the client's update norm was <= that norm
NEIGHBOURS = "add or remove one client (all of its data)"
Update = list[np.ndarray]


def default_central_delta(num_clients: int) -> float:
    """delta = min(1e-5, N^-1.1): well below 1/N, the delta of releasing a random client.

    A mechanism that publishes one randomly chosen client's update in full is
    (0, 1/N)-DP, so a useful delta must be much smaller than 1/N; N^-1.1 keeps that true
    for large federations, 1e-5 is the usual ceiling.
    """
    return min(1e-5, float(num_clients) ** -1.1)


def effective_update_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """z_u such that (z_u on the sum, sigma_b on the centred bits) is a Gaussian with z.

    Andrew et al. 2021, Theorem 1: z^-2 = z_u^-2 + (2 sigma_b)^-2. Needs z < 2 sigma_b.
    """
    rest = noise_multiplier ** -2 - (2 * count_stddev) ** -2
    if rest <= 0:
        raise ValueError(f"adaptive clipping needs noise-multiplier < 2 x clipped-count std "
                         f"({2 * count_stddev:g}), got {noise_multiplier}")
    return rest ** -0.5


CENTRAL_ACCOUNTANTS = ("pld", "rdp")  # dp-accounting's; Opacus' PRV is DP-SGD's only


@dataclass(frozen=True)
class DPFedAvgParams:
    """Everything that defines the mechanism (and so its privacy)."""

    noise_multiplier: float  # z: the effective multiplier that is accounted
    clipping_norm: float  # C (the initial C with adaptive clipping)
    population: int  # N clients
    sampling: str = "fixed"  # fixed | poisson
    fraction: float = 1.0  # q for Poisson
    cohort: int = 0  # m for fixed-size sampling (0: everyone)
    adaptive: bool = False
    target_quantile: float = 0.5  # gamma: share of updates left unclipped
    clip_lr: float = 0.2  # eta (Andrew et al.'s recommended 0.2)
    count_stddev: float = 0.0  # sigma_b; 0 = d / 20 (Andrew et al.'s recommendation)
    delta: float = 0.0  # 0 = default_central_delta(N)
    max_epsilon: float = 0.0  # 0 = no limit
    secure_rng: bool = False
    quantization_slack: float = 0.0  # L2 bound on what quantization adds to one update
    accountant: str = "pld"  # dp-accounting's PLD (tightest) or its RDP
    mechanism: str = "gaussian"  # the noise across rounds (privacy.dp.correlated)
    groups: int = 0  # cyclic sampling: the groups, one trained per round in turn
    bands: int = 0  # banded-mf: the bands of C (0: as many as groups)
    rounds: int = 0  # the rounds the correlated strategy is built for

    def __post_init__(self) -> None:
        if self.sampling not in CLIENT_SAMPLINGS:
            raise ValueError(f"sampling must be one of {CLIENT_SAMPLINGS}, got "
                             f"{self.sampling!r}")
        if self.mechanism not in CENTRAL_MECHANISMS:
            raise ValueError(f"mechanism must be one of {CENTRAL_MECHANISMS}, got "
                             f"{self.mechanism!r}")
        if (self.mechanism != "gaussian" or self.cyclic) and not (
                self.cyclic and self.rounds >= self.groups >= 1):
            raise ValueError(f"mechanism {self.mechanism!r} with {self.sampling!r} sampling "
                             "needs cyclic sampling over 1..rounds groups")
        if self.adaptive and self.matrix is not None:
            raise ValueError("adaptive clipping is accounted for per-round independent noise "
                             "under fixed or Poisson sampling only")
        if self.noise_multiplier <= 0 or self.clipping_norm <= 0 or self.population < 1:
            raise ValueError("noise multiplier, clipping norm and population must be positive")
        if self.accountant not in CENTRAL_ACCOUNTANTS:
            raise ValueError(f"central DP's accountant must be one of {CENTRAL_ACCOUNTANTS}, "
                             f"got {self.accountant!r}")

    @property
    def cyclic(self) -> bool:
        return self.sampling.startswith("cyclic")

    @property
    def matrix(self) -> MatrixMechanism | None:
        """The mechanism across rounds under cyclic participation (None: DP-FedAvg's
        per-round accounting under fixed or Poisson sampling)."""
        if not self.cyclic:
            return None
        return MatrixMechanism(self.mechanism, self.rounds, self.groups,
                               self.bands or self.groups, self.sampling == "cyclic-poisson",
                               self.fraction)

    @property
    def everyone(self) -> bool:
        """True when every client takes part in every round (fraction 1: no sampling).

        Decided by the rule, not by the cohort's size: a fixed cohort of m = N clients
        (e.g. through min-train-clients) is still a cohort of m, which a joining client
        could enter by displacing another.
        """
        return self.fraction >= 1.0

    @property
    def denominator(self) -> float:
        """d: the fixed number the noisy sum is divided by (expected cohort size; with
        cyclic sampling the mean group's, N / groups, times the rate for cyclic-poisson:
        one d for every round, even for groups of unequal sizes, since dividing rounds by
        different numbers would scale their correlated noise differently and undo its
        cancellation on the model)."""
        if self.cyclic:
            rate = self.fraction if self.sampling == "cyclic-poisson" else 1.0
            return self.population / self.groups * rate
        if self.sampling == "poisson":
            return self.fraction * self.population
        return float(self.cohort or self.population)

    @property
    def sensitivity_factor(self) -> int:
        """How many C one client can move the sum by: 2 when it can displace another
        (a fixed cohort; a cyclic group takes all of its members)."""
        return 1 if self.sampling != "fixed" or self.everyone else 2

    @property
    def count_std(self) -> float:
        return self.count_stddev or self.denominator / 20

    @property
    def update_multiplier(self) -> float:
        """z_u: the multiplier of the noise actually added to the update sum."""
        if not self.adaptive:
            return self.noise_multiplier
        return effective_update_multiplier(self.noise_multiplier, self.count_std)

    @property
    def target_delta(self) -> float:
        return self.delta or default_central_delta(self.population)

    @property
    def accounted_multiplier(self) -> float:
        """Noise std over the sum's sensitivity: z / (1 or 2), less quantization's slack.

        With secure aggregation each client's update is stochastically rounded to the
        quantization grid, which can lengthen it by up to ``quantization_slack``.
        """
        c = self.clipping_norm
        return self.noise_multiplier / self.sensitivity_factor * c / (c + self.quantization_slack)

    def round_event(self) -> DpEvent:
        """The dp-accounting event of one released round (add/remove-one neighbours)."""
        from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent

        gaussian = GaussianDpEvent(self.accounted_multiplier)
        if self.sampling == "poisson" and not self.everyone:
            return PoissonSampledDpEvent(self.fraction, gaussian)
        return gaussian

    @property
    def slack_factor(self) -> float:
        """C / (C + slack): how much secure aggregation's rounding lowers the multiplier."""
        c = self.clipping_norm
        return c / (c + self.quantization_slack)

    def record_event(self) -> DpEvent:
        """One released round under the record-level relation (one record of a client that
        takes part added or removed): that client's clipped update can move by up to 2C,
        so a Gaussian with multiplier z / 2 (less quantization's slack); no amplification
        is claimed, whatever the client sampling."""
        from dp_accounting import GaussianDpEvent

        c = self.clipping_norm
        return GaussianDpEvent(self.noise_multiplier / 2 * c / (c + self.quantization_slack))

    def describe_accounting(self) -> str:
        z = f"{self.accounted_multiplier:.4g}"
        name = f"{self.accountant.upper()} (dp-accounting)"
        if self.matrix is not None:
            how = (f"{self.matrix.describe()}; noise multiplier {z} on C x, whose "
                   "sensitivity is computed from C over the schedule")
            if self.quantization_slack:
                how += (f"; sensitivity raised by {self.quantization_slack:.3g} for secure "
                        "aggregation's rounding")
            return f"{name} of the whole release so far: {how}"
        if self.sampling == "poisson" and not self.everyone:
            how = (f"Poisson-subsampled Gaussian, q = {self.fraction:g}, multiplier {z} "
                   "(amplification by Poisson sampling)")
        elif self.everyone:
            how = f"Gaussian, multiplier {z} (every client every round)"
        else:
            how = (f"Gaussian, multiplier {z} = z / 2 (a client joining can displace another "
                   f"from the fixed cohort of {self.cohort}: sensitivity 2C; no amplification "
                   "claimed for fixed-size sampling)")
        if self.quantization_slack:
            how += (f"; sensitivity raised by {self.quantization_slack:.3g} for secure "
                    "aggregation's rounding (SecAgg+ quantization, or CKKS encoding)")
        return f"{name} over every released round; per round: {how}"


def flat_norm(update: Sequence[np.ndarray]) -> float:
    return float(math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in update)))


def clip(update: Sequence[np.ndarray], norm: float) -> tuple[Update, float]:
    """The update scaled to L2 norm at most ``norm`` (float64), and its norm before."""
    before = flat_norm(update)
    scale = min(1.0, norm / before) if before > 0 else 1.0
    return [np.asarray(a, dtype=np.float64) * scale for a in update], before


def clipped_sum(updates: Sequence[Sequence[np.ndarray]], norm: float,
                shapes: Sequence[tuple[int, ...]]) -> tuple[Update, list[bool]]:
    """The sum of the updates each clipped to ``norm``, and each one's bit
    b_i = 1[||update_i|| <= norm] (what adaptive clipping counts)."""
    total = [np.zeros(s, dtype=np.float64) for s in shapes]
    bits = []
    for update in updates:
        clipped, before = clip(update, norm)
        for acc, a in zip(total, clipped, strict=True):
            acc += a
        bits.append(before <= norm)
    return total, bits


@dataclass
class RoundRelease:
    """The noisy update of one round and what went into it."""

    update: Update
    clipping_norm: float  # C used this round
    unclipped_fraction: float | None  # the noisy b_mean (adaptive clipping only)


class DPFedAvg:
    """The server side of DP-FedAvg: noise the clipped sum, divide by a fixed denominator.
    Under cyclic sampling with a correlated mechanism the noise comes from its per-round
    source (:mod:`privacy.dp.correlated`), rebuilt from the seed on resume."""

    def __init__(self, params: DPFedAvgParams, seed: int = 0) -> None:
        self.params = params
        self.seed = seed
        self.clipping_norm = params.clipping_norm
        self._source: Any = None  # the correlated noise, built at the first release

    def resume(self) -> None:
        """Continue from a checkpoint: the correlated noise source is rebuilt at the next
        release, drawing the earlier rounds again from their seeds (``advance``)."""
        self._source = None

    def _correlated(self, shapes: list[tuple[int, ...]], std: float) -> Any:
        matrix = self.params.matrix
        if self._source is None and matrix is not None:
            self._source = matrix.noise(shapes, std, self.seed, self.params.secure_rng)
        return self._source

    def release(self, server_round: int, clipped_total: Sequence[np.ndarray],
                unclipped: Sequence[bool] = ()) -> RoundRelease:
        """(sum + N(0, (z_u C)^2)) / d; with adaptive clipping also move C (Andrew et al.).

        ``clipped_total`` is the sum of the round's updates, each clipped to the current
        ``clipping_norm``; ``unclipped`` the clients' bits (adaptive clipping only).
        """
        p = self.params
        c = self.clipping_norm
        std = p.update_multiplier * c
        d = p.denominator
        source = self._correlated([np.shape(a) for a in clipped_total], std)
        rng = noise_rng(self.seed, server_round, p.secure_rng)
        noise = (source.advance(server_round) if source is not None else
                 [gaussian_noise(np.shape(a), std, rng, p.secure_rng) for a in clipped_total])
        noisy = [(np.asarray(a, dtype=np.float64) + w) / d
                 for a, w in zip(clipped_total, noise, strict=True)]
        fraction = None
        if p.adaptive:
            centred = sum(float(b) - 0.5 for b in unclipped) + float(
                gaussian_noise((), p.count_std, rng, p.secure_rng))
            fraction = centred / p.denominator + 0.5
            self.clipping_norm = c * math.exp(-p.clip_lr * (fraction - p.target_quantile))
        return RoundRelease(noisy, c, fraction)


@functools.lru_cache(maxsize=256)
def _composed_epsilon(event: DpEvent, releases: int, delta: float, accountant: str) -> float:
    from dp_accounting import NeighboringRelation, SelfComposedDpEvent
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    if releases == 0:
        return 0.0
    # dp-accounting logs a warning for every fractional order its series cannot
    # evaluate for a sampled Gaussian; those orders are simply left out of the bound.
    logging.getLogger("absl").setLevel(logging.ERROR)
    from .accounting import pld_interval

    relation = NeighboringRelation.ADD_OR_REMOVE_ONE
    rdp = RdpAccountant(neighboring_relation=relation)
    rdp.compose(SelfComposedDpEvent(event, releases))
    if accountant == "rdp":
        return float(rdp.get_epsilon(delta))
    # the grid made coarser for epsilons over 10 (tiny noise would need 10^8 points)
    acc = PLDAccountant(relation,
                        value_discretization_interval=pld_interval(rdp.get_epsilon(delta)))
    acc.compose(SelfComposedDpEvent(event, releases))
    return float(acc.get_epsilon(delta))


class CentralAccountant:
    """Client-level epsilon of the released model: every released round composed
    (dp-accounting's PLD by default, or its RDP); under cyclic sampling the whole
    release so far as one mechanism (:class:`privacy.dp.correlated.MatrixMechanism`),
    ``releases`` then counting rounds (a round that released nothing still counts)."""

    def __init__(self, params: DPFedAvgParams) -> None:
        self.params = params
        self.releases = 0

    def epsilon_after(self, releases: int) -> float:
        """Client-level epsilon after ``releases`` rounds."""
        matrix = self.params.matrix
        if matrix is not None:
            return self._composed(matrix.event(self.params.accounted_multiplier, releases),
                                  min(releases, 1)) if releases else 0.0
        return self._composed(self.params.round_event(), releases)

    def _composed(self, event: DpEvent, releases: int) -> float:
        """dp-accounting's PLD (default: the tightest valid figure) or RDP epsilon of
        ``releases`` rounds of ``event``, add/remove neighbours."""
        return _composed_epsilon(event, releases, self.params.target_delta,
                                 self.params.accountant)

    @property
    def epsilon(self) -> float:
        return self.epsilon_after(self.releases)

    def record_epsilon_after(self, releases: int) -> float:
        """Record-level epsilon after ``releases`` rounds (see ``record_event``): what an
        audit that changes one record inside a client is bounded by. Client-level
        add/remove does not bound it (the client stays and its update changes), except
        for a fixed cohort, whose rounds are already accounted with z / 2."""
        matrix, p = self.params.matrix, self.params
        if matrix is not None:
            return self._composed(matrix.record_event(p.noise_multiplier * p.slack_factor,
                                                      releases), 1) if releases else 0.0
        return self._composed(self.params.record_event(), releases)

    def would_exceed(self, server_round: int = 0) -> bool:
        """Whether releasing round ``server_round`` would take epsilon past max-epsilon
        (under cyclic sampling every round up to it counts, released or not)."""
        limit = self.params.max_epsilon
        upto = (max(self.releases + 1, server_round) if self.params.matrix
                else self.releases + 1)
        return bool(limit) and self.epsilon_after(upto) > limit * (1 + 1e-9)

    def record_release(self, server_round: int = 0) -> None:
        """Count a release (under cyclic sampling: every round up to ``server_round``)."""
        self.releases = (max(self.releases + 1, server_round) if self.params.matrix
                         else self.releases + 1)


@functools.lru_cache(maxsize=64)
def calibrate(params: DPFedAvgParams, target_epsilon: float, rounds: int) -> DPFedAvgParams:
    """``params`` with the smallest noise multiplier (to 0.1%) whose client-level epsilon
    after ``rounds`` rounds, as :class:`CentralAccountant` reports it, is at most
    ``target_epsilon``. Epsilon only falls as the multiplier grows: RDP (an upper bound
    on the PLD's figure, cheap) brackets it, then the Illinois variant of regula falsi on
    log epsilon against log multiplier closes the bracket in a few PLD evaluations.
    ValueError when even a multiplier of 10^4 does not reach the target."""
    import dataclasses

    def epsilon(z: float, accountant: str = params.accountant) -> float:
        q = dataclasses.replace(params, noise_multiplier=z, accountant=accountant)
        return CentralAccountant(q).epsilon_after(rounds)

    lo, hi = 1e-2, 1e4
    if (floor := epsilon(hi)) > target_epsilon:
        raise ValueError(f"no noise multiplier up to {hi:g} gives epsilon {target_epsilon} "
                         f"in {rounds} rounds (at {hi:g}: {floor:.3g}; set target-epsilon to "
                         f"at least {floor * 1.01:.3g}, or a larger delta)")
    while hi / lo > 1.01:  # RDP's multiplier for the target: enough, if not the least
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if epsilon(mid, "rdp") <= target_epsilon else (mid, hi)
    if params.accountant == "rdp":
        return dataclasses.replace(params, noise_multiplier=hi)
    while epsilon(hi) > target_epsilon:  # PLD is below RDP; never trust it blindly
        hi *= 1.1
    lo = hi / 4
    f_lo, f_hi = (math.log(epsilon(lo)) - math.log(target_epsilon),
                  math.log(epsilon(hi)) - math.log(target_epsilon))
    if f_lo <= 0:
        return dataclasses.replace(params, noise_multiplier=lo)
    side = 0
    while hi / lo > 1.001:
        x_lo, x_hi = math.log(lo), math.log(hi)
        x = x_hi - f_hi * (x_hi - x_lo) / (f_hi - f_lo)
        x = min(max(x, x_lo + 1e-4 * (x_hi - x_lo)), x_hi - 1e-4 * (x_hi - x_lo))
        f = math.log(epsilon(math.exp(x))) - math.log(target_epsilon)
        if f <= 0:
            hi, f_hi = math.exp(x), f
            f_lo = f_lo / 2 if side == -1 else f_lo
            side = -1
        else:
            lo, f_lo = math.exp(x), f
            f_hi = f_hi / 2 if side == 1 else f_hi
            side = 1
    return dataclasses.replace(params, noise_multiplier=hi)
