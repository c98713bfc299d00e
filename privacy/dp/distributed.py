"""Distributed DP inside secure aggregation: the client's integer encoding, the Skellam
noise share, the server's decode, and the accounting of the noisy modular sum.

Each client clips its update, rotates it (randomized Hadamard, public sign seed), scales
and randomly rounds it to integers, adds its own share of integer noise and reduces mod
2^bits; secure aggregation reveals only the modular sum. The noise shares of the n'
honest survivors add up to the central noise:

* Skellam (Agarwal, Kairouz & Liu, NeurIPS 2021, "The Skellam Mechanism for
  Differentially Private Federated Learning" [AKL]): shares are Poisson - Poisson, and a
  sum of Skellams is exactly a Skellam, so the RDP of the sum has a closed form;
* distributed discrete Gaussian (Kairouz, Liu & Steinke, ICML 2021, "The Distributed
  Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation" [KLS]): a
  sum of discrete Gaussians is close to one, with the gap paid by the tau term. Only
  its accounting is here (no sampler).

Threat model of the accounting: the server is active and picks the cohorts, so no
sampling amplification is claimed (q = 1 for every round a client takes part in, counted
by the client). The relation is zero-out (one client's update replaced by zero, every
share present); replace-one doubles both sensitivities. n' is the survivors' shares
minus the t colluding clients', whose noise the server can subtract.

Plain arguments in, plain numbers (or numpy arrays) out.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Integer orders: [AKL]'s closed form is stated for integer alpha.
ORDERS: tuple[int, ...] = tuple(range(2, 129)) + (160, 192, 256, 384, 512, 1024)
DEFAULT_WRAP_PROB = 1e-4  # TFF's modclip_prob: k = sqrt(2) erfcinv(1e-4) ~ 3.89 std devs


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float, np.integer, np.floating))
                and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}.")


def _shares(n_shares: int, colluding: int) -> int:
    """Honest noise shares n' = n_shares - colluding, refusing t >= n_shares."""
    if int(n_shares) != n_shares or n_shares < 1:
        raise ValueError(f"n_shares must be a positive integer, got {n_shares!r}.")
    if int(colluding) != colluding or colluding < 0:
        raise ValueError(f"colluding must be a non-negative integer, got {colluding!r}.")
    if colluding >= n_shares:
        raise ValueError(
            f"colluding = {colluding} >= n_shares = {n_shares}: the server together with the "
            "colluding clients can subtract every noise share in the sum, so no distributed "
            "noise protects an honest client and the distributed-DP accounting does not apply. "
            "Reduce the assumed collusion or require more surviving clients per round.")
    return int(n_shares - colluding)


# ---------------------------------------------------------------- rotation and rounding


def padded_dim(d: int) -> int:
    """The Hadamard dimension: d padded to the next power of two."""
    if int(d) != d or d < 1:
        raise ValueError(f"dimension must be a positive integer, got {d!r}.")
    return 1 << (int(d) - 1).bit_length()


def _fwht(a: np.ndarray) -> np.ndarray:
    """Orthonormal fast Walsh-Hadamard transform (symmetric and its own inverse)."""
    n = a.size
    out = a.astype(np.float64, copy=True)
    h = 1
    while h < n:
        blocks = out.reshape(-1, 2, h)
        out = np.stack((blocks[:, 0] + blocks[:, 1], blocks[:, 0] - blocks[:, 1]),
                       axis=1).reshape(-1)
        h *= 2
    return out / math.sqrt(n)


def _signs(dim: int, sign_seed: int) -> np.ndarray:
    return np.random.default_rng(sign_seed).choice(np.array([-1.0, 1.0]), size=dim)


def rotate(x: np.ndarray, sign_seed: int) -> np.ndarray:
    """Randomized Hadamard rotation H D x / sqrt(dim) of x zero-padded to a power of two
    ([KLS] Sec. 4: flattens the vector so that every coordinate is about ||x|| / sqrt(d)).
    ``sign_seed`` is public (the same for every client in a round). Preserves the L2 norm."""
    flat = np.asarray(x, dtype=np.float64).ravel()
    dim = padded_dim(flat.size)
    padded = np.zeros(dim)
    padded[:flat.size] = flat
    return _fwht(_signs(dim, sign_seed) * padded)


def unrotate(y: np.ndarray, sign_seed: int, d: int) -> np.ndarray:
    """The inverse of :func:`rotate`, truncated to the original dimension ``d``."""
    y = np.asarray(y, dtype=np.float64).ravel()
    if y.size != padded_dim(d):
        raise ValueError(f"rotated vector has {y.size} entries, expected {padded_dim(d)}.")
    return (_signs(y.size, sign_seed) * _fwht(y))[:d]


def rounded_l2_bound(scaled_clip: float, dim: int, beta: float = 0.0) -> float:
    """L2 bound on a vector of norm <= ``scaled_clip`` after (conditional) randomized
    rounding to Z^dim ([KLS] Thm 1 / Prop 22; [AKL] Sec. 4): c + sqrt(dim) always (each
    coordinate moves by < 1); with beta > 0 also sqrt(c^2 + dim/4 + sqrt(2 ln(1/beta))
    (c + sqrt(dim)/2)), which :func:`randomized_round` enforces by re-rounding."""
    _positive(scaled_clip=scaled_clip, dim=dim)
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}.")
    bound = scaled_clip + math.sqrt(dim)
    if beta > 0:
        bound = min(bound, math.sqrt(scaled_clip ** 2 + dim / 4 + math.sqrt(2 * math.log(1 / beta))
                                     * (scaled_clip + math.sqrt(dim) / 2)))
    return bound


def rounded_l1_bound(l2_bound: float, dim: int) -> float:
    """L1 bound of an integer vector with L2 norm <= ``l2_bound``: ||v||_1 <= ||v||_2
    min(sqrt(dim), ||v||_2), since every non-zero coordinate has |v_j| >= 1."""
    _positive(l2_bound=l2_bound, dim=dim)
    return l2_bound * min(math.sqrt(dim), l2_bound)


def randomized_round(x: np.ndarray, rng: np.random.Generator, beta: float = 0.0,
                     l2_bound: float | None = None, max_tries: int = 10_000) -> np.ndarray:
    """Unbiased randomized rounding to int64, re-drawn until ||result||_2 <= ``l2_bound``
    when beta > 0 (conditional rounding, [KLS] Alg. 1; the expected number of draws is
    <= 1/(1 - beta)). beta = 0: a single pass (the bound c + sqrt(d) then holds surely)."""
    x = np.asarray(x, dtype=np.float64)
    floor = np.floor(x)
    frac = x - floor
    for _ in range(max_tries):
        out = (floor + (rng.random(x.shape) < frac)).astype(np.int64)
        if beta == 0 or l2_bound is None or np.linalg.norm(out) <= l2_bound:
            return out
    raise RuntimeError(f"conditional rounding did not meet the L2 bound in {max_tries} draws.")


def encode(update: np.ndarray, clip: float, scale: float, sign_seed: int,
           rng: np.random.Generator, beta: float = 0.0) -> np.ndarray:
    """A client's integer vector (before noise): flatten, clip to L2 <= ``clip``, rotate
    (:func:`rotate`), multiply by ``scale`` (= 1/gamma) and round (:func:`randomized_round`)
    to int64 of length :func:`padded_dim`. Its L2 norm is at most
    ``rounded_l2_bound(scale * clip, dim, beta)``. Deterministic given ``rng``."""
    _positive(clip=clip, scale=scale)
    flat = np.asarray(update, dtype=np.float64).ravel()
    norm = float(np.linalg.norm(flat))
    if norm > clip:
        flat = flat * (clip / norm)
    dim = padded_dim(flat.size)
    bound = rounded_l2_bound(scale * clip, dim, beta)
    return randomized_round(scale * rotate(flat, sign_seed), rng, beta, bound)


def skellam_share(size: int, local_variance: float, rng: np.random.Generator) -> np.ndarray:
    """One client's Skellam noise share, Poisson(v/2) - Poisson(v/2) per coordinate
    (variance v = ``local_variance``, integer units; with [AKL]'s Sk(mu, mu) for the
    aggregate of n shares, v/2 = mu/n). n' shares sum to Skellam of variance n' v exactly.

    ``rng`` must be seeded from a client-secret CSPRNG (e.g.
    ``np.random.Generator(np.random.Philox(key=secrets.randbits(128)))``), never from a
    public or configured training seed: noise the server can predict is no noise."""
    _positive(local_variance=local_variance)
    lam = local_variance / 2
    return (rng.poisson(lam, size) - rng.poisson(lam, size)).astype(np.int64)


def to_modular(v: np.ndarray, bits: int) -> np.ndarray:
    """v mod 2^bits in [0, 2^bits) (what a client hands to secure aggregation)."""
    return np.mod(np.asarray(v, dtype=np.int64), np.int64(1) << bits)


def centre(v: np.ndarray, bits: int) -> np.ndarray:
    """v mod 2^bits mapped into [-2^(bits-1), 2^(bits-1))."""
    m = np.int64(1) << bits
    half = np.int64(1) << (bits - 1)
    return np.mod(np.asarray(v, dtype=np.int64) + half, m) - half


def decode(total: np.ndarray, bits: int, scale: float, sign_seed: int, d: int) -> np.ndarray:
    """The server's estimate of the sum of clipped updates from the (modular) integer sum:
    centre mod 2^bits, divide by ``scale``, inverse rotation, drop the padding. A
    coordinate that wrapped around is lost (utility, not privacy: the modular reduction
    is post-processing of the noisy sum)."""
    _positive(scale=scale)
    return unrotate(centre(total, bits).astype(np.float64) / scale, sign_seed, d)


# ---------------------------------------------------------------- modulus


def wrap_stddevs(wrap_prob: float = DEFAULT_WRAP_PROB) -> float:
    """k with P(|N(0,1)| > k) = wrap_prob: k = sqrt(2) erfcinv(wrap_prob)."""
    from scipy.special import erfcinv  # scipy: imported lazily (heavy)

    if not 0 < wrap_prob < 1:
        raise ValueError(f"wrap_prob must be in (0, 1), got {wrap_prob!r}.")
    return float(math.sqrt(2) * erfcinv(wrap_prob))


def sum_coordinate_std(n_clients: int, scaled_clip: float, dim: int,
                       local_variance: float) -> float:
    """Std of one coordinate of the integer sum ([KLS] Sec. 4.4 / Eq. 61): the rotation
    spreads n aligned clipped vectors to about n c / sqrt(dim) per coordinate, and each
    client adds its rounding (<= 1/4) and noise variance."""
    return math.sqrt((n_clients * scaled_clip) ** 2 / dim
                     + n_clients * (0.25 + local_variance))


def check_bits(bits: int, n_clients: int, scaled_clip: float, dim: int,
               local_variance: float, wrap_prob: float = DEFAULT_WRAP_PROB) -> None:
    """Refuse a modulus 2^bits that the sum overflows too often: requires k stds of a sum
    coordinate (k from ``wrap_prob``) to fit in [-2^(bits-1), 2^(bits-1)), and
    n * 2^bits < 2^63 so the int64 sum cannot overflow."""
    if int(bits) != bits or not 2 <= bits <= 62:
        raise ValueError(f"bits must be an integer in [2, 62], got {bits!r}.")
    if int(n_clients) != n_clients or n_clients < 1:
        raise ValueError(f"n_clients must be a positive integer, got {n_clients!r}.")
    _positive(scaled_clip=scaled_clip, dim=dim, local_variance=local_variance)
    k = wrap_stddevs(wrap_prob)
    std = sum_coordinate_std(n_clients, scaled_clip, dim, local_variance)
    if 2 * k * std > 2.0 ** bits or n_clients * 2.0 ** bits >= 2.0 ** 63:
        raise ValueError(
            f"bits = {bits} is too small for this cohort: a coordinate of the sum of "
            f"{n_clients} clients (scaled clip {scaled_clip:g}, dimension {dim}, local noise "
            f"variance {local_variance:g}) has standard deviation about {std:.4g}, and "
            f"{k:.3g} of them each side (wrap-around probability {wrap_prob:g} per "
            f"coordinate) needs {2 * k * std:.4g} > 2^{bits} = {2 ** bits} values. The "
            "modular sum would wrap around and destroy the update. Use more bits, a smaller "
            "scale, or fewer clients per aggregate.")


def scale_for_bits(bits: int, n_clients: int, clip: float, dim: int, local_std: float,
                   wrap_prob: float = DEFAULT_WRAP_PROB) -> float:
    """The largest scale s (= 1/gamma) that :func:`check_bits` accepts, for a local noise
    std ``local_std`` in the update's units (so s * local_std in integer units); the
    papers' heuristic ([KLS] Sec. 4.4): s = sqrt(2^(2b) - n k^2) / (2k sqrt(c^2 n^2/d +
    n sigma^2))."""
    _positive(clip=clip, dim=dim, local_std=local_std)
    k = wrap_stddevs(wrap_prob)
    room = 2.0 ** (2 * bits) - n_clients * k * k
    if room <= 0:
        raise ValueError(
            f"bits = {bits} is too small for {n_clients} clients: their rounding errors "
            f"alone need {k:.3g} stds of {math.sqrt(n_clients / 4):.3g} each side.")
    return math.sqrt(room) / (2 * k * math.sqrt(clip * clip * n_clients ** 2 / dim
                                                 + n_clients * local_std ** 2))


# ---------------------------------------------------------------- accounting


def skellam_rdp(orders: Sequence[float], l2: float, l1: float, variance: float) -> np.ndarray:
    """RDP of the Skellam mechanism with (integer-unit) sensitivities ``l2``, ``l1`` and
    total variance ``variance`` ([AKL] Cor. 4.1, in scaled units): alpha l2^2/(2 var) +
    min(((2 alpha - 1) l2^2 + 6 l1)/(4 var^2), 3 l1/(2 var)), for integer alpha."""
    _positive(l2=l2, l1=l1, variance=variance)
    a = np.asarray(orders, dtype=np.float64)
    return (a * l2 ** 2 / (2 * variance)
            + np.minimum(((2 * a - 1) * l2 ** 2 + 6 * l1) / (4 * variance ** 2),
                         3 * l1 / (2 * variance)))


def ddg_tau(local_std: float, n_shares: int) -> float:
    """[KLS] Thm 1: tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k/(k+1)), the price of
    the sum of n discrete Gaussians N_Z(0, sigma^2) not being exactly one."""
    return 10 * sum(math.exp(-2 * math.pi ** 2 * local_std ** 2 * k / (k + 1))
                    for k in range(1, int(n_shares)))


def ddg_branches(l2: float, l1: float, local_std: float, n_shares: int,
                 dim: int) -> list[tuple[float, float]]:
    """[KLS] Prop 14 / Thm 1 as three (rho, xi) zCDP-with-offset curves (RDP
    xi + rho alpha each; the mechanism's curve is their minimum) for the sum of
    ``n_shares`` N_Z(0, local_std^2) with sensitivities ``l2``, ``l1`` in a ``dim``-dim
    integer space."""
    _positive(l2=l2, l1=l1, local_std=local_std, dim=dim)
    if local_std < 0.5:
        raise ValueError(f"local_std = {local_std:g} < 1/2 integer units: outside the regime "
                         "in which this module applies [KLS]'s tau bound; use a larger scale "
                         "or more noise.")
    tau = ddg_tau(local_std, n_shares)
    s = math.sqrt(n_shares) * local_std
    return [(l2 ** 2 / (2 * s ** 2), tau * dim),
            ((l2 ** 2 / s ** 2 + 2 * tau * l1 / s + tau ** 2 * dim) / 2, 0.0),
            ((l2 / s + tau * math.sqrt(dim)) ** 2 / 2, 0.0)]


def skellam_branches(l2: float, l1: float, variance: float) -> list[tuple[float, float]]:
    """[AKL]'s curve (:func:`skellam_rdp`) as the minimum of two zCDP-with-offset curves:
    rho = l2^2 (1 + 1/var)/(2 var), xi = (6 l1 - l2^2)/(4 var^2), and rho = l2^2/(2 var),
    xi = 3 l1/(2 var). A negative xi is raised to 0 (a valid, slightly looser bound:
    dp-accounting refuses xi < 0)."""
    _positive(l2=l2, l1=l1, variance=variance)
    return [(l2 ** 2 * (1 + 1 / variance) / (2 * variance),
             max(0.0, (6 * l1 - l2 ** 2) / (4 * variance ** 2))),
            (l2 ** 2 / (2 * variance), 3 * l1 / (2 * variance))]


def _compose(branches: list[tuple[float, float]], rounds: int, delta: float,
             orders: Sequence[float]) -> tuple[float, float, float]:
    """min over branches of dp-accounting's RDP epsilon of ``rounds`` ZCDpEvents: valid
    because every round has the same curve, so the minimum over branches commutes with
    the sum over rounds and with the conversion's minimum over orders."""
    # dp_accounting: imported lazily (heavy)
    from dp_accounting import SelfComposedDpEvent, ZCDpEvent
    from dp_accounting.rdp import RdpAccountant

    if int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}.")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}.")
    best = (math.inf, float(delta), math.nan)
    for rho, xi in branches:
        acc = RdpAccountant(orders=list(orders))
        acc.compose(SelfComposedDpEvent(ZCDpEvent(rho=rho, xi=xi), int(rounds)))
        eps, order = acc.get_epsilon_and_optimal_order(delta)
        if eps < best[0]:
            best = (float(eps), float(delta), float(order))
    return best


def skellam_epsilon(l2: float, l1: float, local_variance: float, n_shares: int,
                    rounds: int, delta: float, colluding: int = 0,
                    orders: Sequence[float] = ORDERS) -> tuple[float, float, float]:
    """(epsilon, delta, order) of the distributed Skellam sum over ``rounds``
    participations ([AKL]): ``n_shares - colluding`` honest shares of variance
    ``local_variance`` each (integer units) protect a client whose rounded vector has
    sensitivities ``l2``, ``l1`` (:func:`rounded_l2_bound`, :func:`rounded_l1_bound`).
    No sampling amplification (q = 1): an active server picks the cohorts."""
    honest = _shares(n_shares, colluding)
    _positive(local_variance=local_variance)
    return _compose(skellam_branches(l2, l1, honest * local_variance), rounds, delta, orders)


def ddg_epsilon(l2: float, l1: float, local_std: float, n_shares: int, dim: int,
                rounds: int, delta: float, colluding: int = 0,
                orders: Sequence[float] = ORDERS) -> tuple[float, float, float]:
    """(epsilon, delta, order) of the distributed discrete Gaussian sum over ``rounds``
    participations ([KLS] Thm 1, with the tau term): ``n_shares - colluding`` honest
    shares N_Z(0, local_std^2) (integer units) in dimension ``dim``. No sampling
    amplification (q = 1): an active server picks the cohorts."""
    honest = _shares(n_shares, colluding)
    return _compose(ddg_branches(l2, l1, local_std, honest, dim), rounds, delta, orders)




# ---------------------------------------------------------------- a run's plan


@dataclass(frozen=True)
class DistributedPlan:
    """Everything client and server must agree on, a function of the configuration and the
    model's size only (both sides compute it): the clip C, the bit width, the scale s
    (:func:`scale_for_bits`), each client's Skellam variance in integer units (the total
    noise std z C, in integer units s z C, split over the cohort's honest shares), the
    integer sensitivities and the colluding clients t assumed."""

    clip: float
    noise_multiplier: float
    bits: int
    dim: int  # the model's parameter count
    padded: int  # the Hadamard dimension
    cohort: int  # clients a round (the planned shares)
    colluding: int
    scale: float
    local_variance: float
    l2: float
    l1: float

    @classmethod
    def make(cls, clip: float, noise_multiplier: float, bits: int, dim: int, cohort: int,
             colluding: int, wrap_prob: float = DEFAULT_WRAP_PROB) -> DistributedPlan:
        """The plan, or ValueError saying what does not fit (the bits, the collusion)."""
        _positive(clip=clip, noise_multiplier=noise_multiplier)
        honest = _shares(cohort, colluding)
        if int(cohort).bit_length() > 32 - int(bits):
            raise ValueError(f"{cohort} clients x 2^{bits} does not stay below 2^32, the "
                             "modulus SecAgg+ sums in: use at most "
                             f"{32 - int(cohort).bit_length()} bits.")
        padded = padded_dim(dim)
        sigma = noise_multiplier * clip  # the total noise std on the sum, update units
        # a hair under the heuristic's largest scale, which leaves out the rounding's
        # variance (check_bits counts it)
        scale = 0.999 * scale_for_bits(bits, cohort, clip, padded,
                                       sigma / math.sqrt(honest), wrap_prob)
        local_variance = (scale * sigma) ** 2 / honest
        l2 = rounded_l2_bound(scale * clip, padded)
        if l2 > 1.5 * scale * clip:
            raise ValueError(
                f"distributed-bits = {bits} leaves a scale of {scale:.3g} for {cohort} clients: "
                f"the rounding to integers adds up to sqrt({padded}) = {math.sqrt(padded):.0f} "
                f"to a clipped update of {scale * clip:.3g} integer units, more than half its "
                "length, and the noise would have to cover it. Use more bits (up to 24), "
                "fewer clients a round or a smaller noise-multiplier.")
        check_bits(bits, cohort, scale * clip, padded, local_variance, wrap_prob)
        return cls(clip, noise_multiplier, bits, dim, padded, cohort, colluding, scale,
                   local_variance, l2, rounded_l1_bound(l2, padded))

    def epsilon(self, shares: Sequence[int], delta: float,
                orders: Sequence[float] = ORDERS) -> float:
        """A client's epsilon after the rounds it took part in, ``shares[i]`` clients'
        noise in round i's sum (fewer than planned when some dropped): each round a
        Skellam mechanism of variance (shares - t) * local variance ([AKL]), composed in
        dp-accounting's RDP accountant, without amplification. 0 before any round; inf
        when the colluders' noise is all there was."""
        from dp_accounting import ZCDpEvent
        from dp_accounting.rdp import RdpAccountant

        if not shares:
            return 0.0
        if min(shares) <= self.colluding:
            return math.inf
        best = math.inf
        for branch in range(2):  # one curve per branch for every round: each is valid
            acc = RdpAccountant(orders=list(orders))
            for n in shares:
                rho, xi = skellam_branches(self.l2, self.l1,
                                           (n - self.colluding) * self.local_variance)[branch]
                acc.compose(ZCDpEvent(rho=rho, xi=xi))
            best = min(best, float(acc.get_epsilon(delta)))
        return best

    def describe(self) -> dict[str, float | int]:
        return {"clipping-norm": self.clip, "noise-multiplier": self.noise_multiplier,
                "bits": self.bits, "scale": self.scale, "cohort": self.cohort,
                "colluding": self.colluding, "local-variance": self.local_variance,
                "sensitivity-l2": self.l2, "sensitivity-l1": self.l1}


def secret_generator() -> np.random.Generator:
    """A generator seeded from the OS's CSPRNG: a client's noise and rounding, which no
    configured seed may predict."""
    return np.random.Generator(np.random.Philox(key=secrets.randbits(128)))


def client_vector(update: np.ndarray, plan: DistributedPlan, sign_seed: int,
                  rng: np.random.Generator) -> np.ndarray:
    """What one client hands to secure aggregation: its update clipped, rotated, scaled,
    rounded, plus its Skellam share, centred mod 2^bits (int64, ``plan.padded`` long)."""
    v = encode(update, plan.clip, plan.scale, sign_seed, rng)
    v = v + skellam_share(v.size, plan.local_variance, rng)
    return centre(v, plan.bits)


def server_sum(total: np.ndarray, plan: DistributedPlan, sign_seed: int) -> np.ndarray:
    """The noisy sum of clipped updates (float, ``plan.dim`` long) from the modular sum."""
    return decode(np.asarray(total, dtype=np.int64), plan.bits, plan.scale, sign_seed,
                  plan.dim)


def sign_seed(seed: int, server_round: int) -> int:
    """The round's public rotation seed (the same for every client and the server)."""
    return int(np.random.SeedSequence([int(seed), int(server_round), 0x5A]).generate_state(1)[0])


NEIGHBOURS = ("zero-out: one client's update replaced by zero (the client still takes part "
              "and adds its noise share); replace-one costs at most twice the sensitivity")


__all__: Sequence[str] = [
    "DEFAULT_WRAP_PROB", "NEIGHBOURS", "ORDERS", "DistributedPlan", "centre", "check_bits",
    "client_vector", "ddg_branches", "ddg_epsilon", "ddg_tau", "decode", "encode",
    "padded_dim", "randomized_round", "rotate", "rounded_l1_bound",
    "rounded_l2_bound", "scale_for_bits", "secret_generator", "server_sum", "sign_seed",
    "skellam_branches", "skellam_epsilon", "skellam_rdp", "skellam_share",
    "sum_coordinate_std", "to_modular", "unrotate", "wrap_stddevs"]
