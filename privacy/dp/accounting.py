"""Record-level DP-SGD accounting for one client, composed over every round it trains in.

DP-SGD (Abadi et al. 2016) with Poisson sampling at a public rate q and noise
multiplier sigma is a sequence of sampled Gaussian mechanisms. A client's guarantee
is over its own records and composes over all its steps in all rounds it takes part
in; rounds in which it is not sampled cost nothing. The history of
(sigma, q, steps) entries is replayed into a fresh accountant to get the cumulative
epsilon: by default dp-accounting's privacy-loss distribution (``pld``: Koskela et al.
2020, Doroshenko et al. 2022; the tightest valid figure, under either neighbouring
relation), or Opacus' RDP (Mironov 2017, Mironov et al. 2019) or PRV (Gopi et al. 2021),
which analyse add/remove neighbours only.

Flower's own Opacus example creates a new PrivacyEngine every round and reports a
one-round epsilon; :class:`ClientLedger` keeps the history across rounds instead (its
state is a plain dict the ClientApp stores in ``Context.state``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import background, shared_memo

ACCOUNTANTS = ("pld", "rdp", "prv")
# add-remove: D' is D with one record more or less; replace-one: one record changed
RELATIONS = ("add-remove", "replace-one")
ACCOUNTANT_NAMES = {"pld": "dp-accounting PLD", "rdp": "Opacus RDP", "prv": "Opacus PRV"}
Entry = tuple[float, float, int]  # (noise multiplier, sample rate, steps)


class BudgetTooSmall(ValueError):
    """No noise multiplier reaches the target epsilon for the planned steps."""


def merge(history: Iterable[Entry]) -> tuple[Entry, ...]:
    """Sum the steps of consecutive entries with the same (sigma, q), as Opacus does."""
    out: list[list[Any]] = []
    for sigma, q, steps in history:
        if out and out[-1][0] == sigma and out[-1][1] == q:
            out[-1][2] += int(steps)
        else:
            out.append([float(sigma), float(q), int(steps)])
    return tuple((s, q, n) for s, q, n in out)


@functools.lru_cache(maxsize=256)
def _rdp_per_step(sigma: float, q: float) -> Any:
    """One sampled Gaussian step's RDP at Opacus' default orders (Mironov et al. 2019).

    It depends on (sigma, q) only, and the fractional orders cost about 50 ms in Python:
    computed once, it is scaled by each entry's steps as Opacus' ``compute_rdp`` does."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp

    return rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1,
                           orders=RDPAccountant.DEFAULT_ALPHAS)


def _rdp_epsilon(history: tuple[Entry, ...], delta: float) -> float:
    """Opacus' ``RDPAccountant.get_epsilon`` (the same sum and conversion, Balle et al.
    2020), with each (sigma, q)'s per-step RDP computed once (:func:`_rdp_per_step`)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp

    total = sum([_rdp_per_step(float(s), float(q)) * n for s, q, n in history])
    eps, _ = rdp.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=total,
                                   delta=delta)
    return float(eps)


def dp_relation(relation: str) -> Any:
    """dp-accounting's ``NeighboringRelation`` for a fedpriv relation name."""
    from dp_accounting import NeighboringRelation

    if relation not in RELATIONS:
        raise ValueError(f"dp-relation must be one of {RELATIONS}, got {relation!r}")
    return (NeighboringRelation.ADD_OR_REMOVE_ONE if relation == "add-remove"
            else NeighboringRelation.REPLACE_ONE)


def check_accountant(accountant: str, relation: str) -> None:
    """Refuse an accountant that has no analysis of ``relation``."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    dp_relation(relation)
    if relation == "replace-one" and accountant != "pld":
        raise ValueError(
            f"accountant = {accountant!r} analyses add/remove neighbours only (Opacus' "
            "accountants), so it cannot give a dp-relation = 'replace-one' guarantee. Use "
            "accountant = 'pld' (dp-accounting's PLD has the replace-one analysis of the "
            "Poisson-subsampled Gaussian), or dp-relation = 'add-remove'.")


def pld_interval(rough_epsilon: float, interval: float = 1e-4) -> float:
    """The PLD's value discretization for a mechanism whose epsilon is about
    ``rough_epsilon``: dp-accounting's default 1e-4 up to epsilon 10, then coarser in
    proportion, rounded up to a power of two times 1e-4. The privacy loss of a Gaussian
    with multiplier sigma spans about 1/sigma^2, so at sigma 0.01 the default grid needs
    10^8 points (the process is killed for memory); the pessimistic estimate stays an
    upper bound on any grid. The powers of two keep a run's grid, and the one-step PLD
    built on it (2 s), the same from round to round while its epsilon grows past 10."""
    if not math.isfinite(rough_epsilon):
        return 1.0
    if rough_epsilon <= 10:
        return interval
    return interval * 2.0 ** math.ceil(math.log2(rough_epsilon / 10))


@functools.lru_cache(maxsize=1024)
def _pld_epsilon(history: tuple[Entry, ...], delta: float, relation: str,
                 interval: float = 1e-4) -> float:
    """dp-accounting's PLD epsilon of the history (pessimistic estimate, an upper bound on
    the true epsilon; ``interval`` is its value discretization, 1e-4 its default, made
    coarser by :func:`pld_interval` for epsilons over 10). What its ``PLDAccountant``
    computes for ``compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)`` per
    entry, step for step, with each entry's one-step PLD built once per process
    (:func:`_one_step_pld`: building it is 80% of the cost; the rounds of a run and its
    clients share it)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_module

    if any(s <= 0 for s, _, _ in history):
        return math.inf
    step = _grid(history, delta, relation, interval)
    pld = pld_module.identity(value_discretization_interval=step)
    for sigma, q, steps in history:
        if q <= 0 or steps <= 0:  # the accountant composes nothing for them
            continue
        if q < 1:
            pld = _composed(pld, _self_composed(
                _one_step_pld(float(sigma), float(q), step, relation), int(steps)))
        else:  # a Gaussian composed `steps` times is one with sigma / sqrt(steps)
            pld = _composed(pld, pld_module.from_gaussian_mechanism(
                standard_deviation=sigma / math.sqrt(int(steps)),
                value_discretization_interval=step,
                neighboring_relation=dp_relation(relation)))
    return float(_epsilon_for_delta(pld, delta))


def _grid(history: tuple[Entry, ...], delta: float, relation: str,
          interval: float = 1e-4) -> float:
    """The value discretization :func:`_pld_epsilon` computes ``history``'s epsilon on:
    :func:`pld_interval` of its RDP epsilon (replace-one's is at most ~2x add/remove's)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
        rough = _rdp_epsilon(history, delta)
    return pld_interval(rough * (2 if relation == "replace-one" else 1), interval)


# dp-accounting walks two loops in Python over a composed PMF's 10^4-10^5 entries (a
# quarter of a round's accounting): the tails a composition truncates, and the losses
# above epsilon. The same sums, in the same order, run here as numpy's sequential
# ``add.accumulate`` (never pairwise), a chunk at a time so that an early exit stays
# early; exponentials and logarithms are the C library's own (``math``), as in the loops.
_CHUNK = 4096


def _composed(a: Any, b: Any) -> Any:
    """``a.compose(b)`` of two PLDs (dp-accounting's default truncation, 1e-15): the same
    PMFs, its dense convolution with :func:`_truncated` for its tail loop."""
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

    def pmfs(one: Any, other: Any) -> Any:
        if isinstance(one, pld_pmf.SparsePLDPmf) and isinstance(other, pld_pmf.SparsePLDPmf):
            return pld_pmf.compose_pmfs(one, other, _TAIL)
        one, other = one.to_dense_pmf(), other.to_dense_pmf()
        one.validate_composable(other)
        from scipy import signal

        probs = signal.fftconvolve(one._probs, other._probs)
        infinity = (one._infinity_mass + other._infinity_mass
                    - one._infinity_mass * other._infinity_mass)
        offset, probs, right = _truncated(probs, _TAIL, one._pessimistic_estimate)
        return pld_pmf.DensePLDPmf(one._discretization, one._lower_loss + other._lower_loss
                                   + offset, probs, infinity + right,
                                   one._pessimistic_estimate)

    remove = pmfs(a._pmf_remove, b._pmf_remove)
    if a._symmetric and b._symmetric:
        return PrivacyLossDistribution(remove)
    return PrivacyLossDistribution(remove, pmfs(a._pmf_add, b._pmf_add))


def _prefix_within(values: Any, threshold: float) -> int:
    """The longest prefix of ``values`` whose running sum (left to right) stays <=
    ``threshold``: dp-accounting's ``_find_prefix_to_truncate``."""
    import numpy as np

    total = 0.0
    for start in range(0, len(values), _CHUNK):
        sums = np.add.accumulate(np.concatenate(([total], values[start:start + _CHUNK])))[1:]
        over = np.flatnonzero(sums > threshold)
        if len(over):
            return start + int(over[0])
        total = sums[-1]
    return len(values)


def _truncated(probs: Any, tail: float, pessimistic: bool) -> tuple[int, Any, float]:
    """dp-accounting's ``_truncate_tails``: (prefix cut, the kept entries with the cut mass
    on the pessimistic side, the mass that goes to infinity)."""
    import numpy as np

    if tail == 0:
        return 0, probs, 0
    left = _prefix_within(probs, tail / 2)
    right = max(len(probs) - _prefix_within(np.flip(probs), tail / 2), left + 1)
    left_mass, right_mass = np.sum(probs[:left]), np.sum(probs[right:])
    kept = probs[left:right]
    if pessimistic:
        kept[0] += left_mass
        return left, kept, right_mass
    kept[-1] += right_mass
    return left, kept, 0


def _epsilon_for_delta(pld: Any, delta: float) -> float:
    """``pld.get_epsilon_for_delta(delta)``, to the bit; dense PMFs without its loop."""
    from dp_accounting.pld import pld_pmf

    def one(pmf: Any) -> float:
        if type(pmf) is not pld_pmf.DensePLDPmf:
            return pmf.get_epsilon_for_delta(delta)
        try:
            return _dense_epsilon(pmf, delta)
        except OverflowError:  # exp(-loss) of a loss below -709 in a chunk: the loop may
            return pmf.get_epsilon_for_delta(delta)  # stop before it, or raise there

    remove = one(pld._pmf_remove)
    return remove if pld._symmetric else max(remove, one(pld._pmf_add))


def _dense_epsilon(pmf: Any, delta: float) -> float:
    """dp-accounting's ``_get_epsilon_for_delta`` over a dense PMF's losses from the top:
    the running masses above each loss (upper, and lower weighted by exp(-loss)) until
    log((upper - delta) / lower) reaches the loss. The comparison is decided by numpy's
    log, and again by ``math.log`` wherever the two could disagree (within 1e-9)."""
    import numpy as np

    if pmf._infinity_mass > delta:
        return math.inf
    step = pmf._discretization
    probs = np.flip(pmf._probs)
    upper = (pmf._lower_loss + len(probs) - 1) * step  # losses: upper, upper - step, ...
    mass_upper, mass_lower, loss = pmf._infinity_mass, 0.0, None
    for start in range(0, len(probs), _CHUNK):
        chunk = probs[start:start + _CHUNK]
        if loss is None:  # itertools.count's floats: each the previous one plus -step
            losses = np.add.accumulate(np.concatenate(([upper], np.full(len(chunk) - 1,
                                                                        -step))))
        else:
            losses = np.add.accumulate(np.concatenate(([loss], np.full(len(chunk),
                                                                       -step))))[1:]
        loss = losses[-1]
        exps = np.fromiter(map(math.exp, (-losses).tolist()), float, len(losses))
        uppers = np.add.accumulate(np.concatenate(([mass_upper], chunk)))
        lowers = np.add.accumulate(np.concatenate(([mass_lower], exps * chunk)))
        before_u, before_l = uppers[:-1], lowers[:-1]  # the masses when each loss is met
        live = (before_u > delta) & (before_l > 0)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = np.where(live, (before_u - delta) / np.where(live, before_l, 1.0), 1.0)
            gap = np.log(ratio) - losses
        stop = live & (gap >= 0)
        unsure = np.flatnonzero(live & (np.abs(gap) <= 1e-9 * np.maximum(1.0, np.abs(losses))))
        for i in unsure:  # decided as the loop decides it
            stop[i] = math.log(ratio[i]) >= losses[i]
        zero = (uppers[1:] >= delta) & (lowers[1:] == 0)  # after adding each entry
        first_stop = int(np.argmax(stop)) if stop.any() else len(chunk)
        first_zero = int(np.argmax(zero)) if zero.any() else len(chunk)
        if first_zero < first_stop:
            return max(0, float(losses[first_zero]))
        if first_stop < len(chunk):
            mass_upper, mass_lower = before_u[first_stop], before_l[first_stop]
            break
        mass_upper, mass_lower = uppers[-1], lowers[-1]
    if mass_upper <= mass_lower + delta:
        return 0
    return math.log((mass_upper - delta) / mass_lower)


@functools.lru_cache(maxsize=256)
def _one_step_pld(sigma: float, q: float, interval: float, relation: str) -> Any:
    """The PLD of one step of the Poisson-subsampled Gaussian, as dp-accounting's
    ``PLDAccountant`` builds it (immutable: composing makes new ones)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_module

    return pld_module.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=interval,
        sampling_prob=q, neighboring_relation=dp_relation(relation))


# dp-accounting's self-composition truncates tails of at most this mass (its default)
_TAIL = 1e-15
# per one-step PMF (by id, the PMF kept alive beside it): its Chernoff orders and
# log-MGFs, which the self-composition's truncation bounds need for any number of steps
_LOG_MGFS: dict[int, tuple[Any, Any, list[float]]] = {}


def _self_composed(pld: Any, num_times: int) -> Any:
    """``pld.self_compose(num_times)``, the same floats as dp-accounting's, with each
    dense PMF's log moment-generating functions (40 ``logsumexp`` over the PMF for the
    Chernoff bounds on what to truncate; they do not depend on ``num_times``) computed
    once per PMF instead of every round: a third of a round's accounting. Any other
    kind of PMF is self-composed by dp-accounting itself."""
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

    def one(pmf: Any) -> Any:
        if type(pmf) is not pld_pmf.DensePLDPmf:
            return pmf.self_compose(num_times, _TAIL)
        lower, probs = _self_convolve(pmf, num_times)
        infinity = _TAIL - math.expm1(num_times * math.log1p(-pmf._infinity_mass))
        return pld_pmf.DensePLDPmf(pmf._discretization, pmf._lower_loss * num_times + lower,
                                   probs, infinity, pmf._pessimistic_estimate)

    remove = one(pld._pmf_remove)
    if pld._symmetric:
        return PrivacyLossDistribution(remove)
    return PrivacyLossDistribution(remove, one(pld._pmf_add))


def _warm_grids(sigma: float, q: float, delta: float, relation: str, first: int,
                last: int) -> None:
    """Build the one-step PLD, and its log-MGFs, of each grid (:func:`pld_interval`)
    that the epsilons after ``first`` to ``last`` steps are computed on."""
    from dp_accounting.pld import pld_pmf

    step, coarsest = (_grid(((sigma, q, n),), delta, relation) for n in (first, last))
    while step <= coarsest:  # powers of two apart: doubling is exact
        pld = _one_step_pld(float(sigma), float(q), step, relation)
        for pmf in {id(p): p for p in (pld._pmf_remove, pld._pmf_add)}.values():
            if type(pmf) is pld_pmf.DensePLDPmf:
                _log_mgfs(pmf)
        step *= 2


def _log_mgfs(pmf: Any) -> tuple[Any, list[float]]:
    """A dense PMF's Chernoff orders and log-MGFs (dp-accounting's ``self_convolve``
    bounds), computed once per PMF."""
    import numpy as np
    from scipy import special

    probs = pmf._probs
    cached = _LOG_MGFS.get(id(pmf))
    if cached is None or cached[0] is not pmf:
        orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(probs)
        cached = _LOG_MGFS[id(pmf)] = (pmf, orders, [
            special.logsumexp(np.arange(len(probs)) * order, b=probs) for order in orders])
    return cached[1], cached[2]


@contextlib.contextmanager
def flushed_subnormals() -> Iterator[None]:
    """Within it, this thread's floating-point unit flushes subnormal results and inputs
    (below 2^-1022, about 2e-308) to zero, as torch's ``set_flush_denormal`` sets it.

    For the self-convolution's ``fft(p) ** n``: the high frequencies of a PMF's spectrum
    raised to the n-th power fall into the subnormal range, where every multiply costs
    the CPU a microcode assist (measured: the power and inverse FFT 2-5x slower, half a
    round's epsilon). What is flushed is 10^290 below the tail mass dp-accounting
    truncates (1e-15) and below the FFT's own rounding of every entry (1e-16 of the total
    mass): the composed PMFs stayed dp-accounting's array for array in every check (the
    tests; 320 PMFs over sigma, q, steps, grids and relations). The setting is the
    thread's own (threads already running, training, are untouched; one started inside
    would inherit it, and none is); a thread that already flushes keeps doing so."""
    import numpy as np
    import torch

    tiny = np.finfo(np.float64).tiny
    already = bool(np.multiply(tiny, 0.5) == 0.0)  # this thread flushes already
    if already or not torch.set_flush_denormal(True):  # not on this CPU: nothing to do
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _self_convolve(pmf: Any, num_times: int) -> tuple[int, Any]:
    """dp-accounting's ``common.self_convolve(pmf._probs, num_times, 1e-15)``, step for
    step, its bounds from the PMF's cached log-MGFs."""
    import numpy as np
    from scipy import fft

    probs = pmf._probs
    orders, log_mgfs = _log_mgfs(pmf)
    lower, upper = 0, (len(probs) - 1) * num_times
    for order, log_mgf in zip(orders, log_mgfs, strict=True):
        bound = (num_times * log_mgf + math.log(2 / _TAIL)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper = min(upper, math.ceil(bound))
        if order < 0:
            lower = max(lower, math.floor(bound))
    length = upper - lower + 1
    fast = fft.next_fast_len(max(length, len(probs)))
    with flushed_subnormals():
        convolved = np.real(fft.ifft(fft.fft(probs, fast) ** num_times))
    return lower, np.array(np.roll(convolved, -lower)[:length])


@functools.lru_cache(maxsize=1024)
def _epsilon(history: tuple[Entry, ...], delta: float, accountant: str,
             relation: str = "add-remove") -> float:
    if not history:
        return 0.0
    check_accountant(accountant, relation)
    return shared_memo.shared(("epsilon", history, delta, accountant, relation),
                              lambda: _compute(history, delta, accountant, relation))


def _compute(history: tuple[Entry, ...], delta: float, accountant: str,
             relation: str) -> float:
    if accountant == "pld":
        return _pld_epsilon(history, delta, relation)
    if accountant == "rdp":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
            return _rdp_epsilon(history, delta)
    from opacus.accountants import create_accountant

    acc = create_accountant(accountant)
    acc.history = [tuple(e) for e in history]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
        return float(acc.get_epsilon(delta))


def epsilon(history: Iterable[Entry], delta: float, accountant: str = "pld",
            relation: str = "add-remove") -> float:
    """Cumulative epsilon of a DP-SGD history at ``delta`` (0 for an empty history) under
    the neighbouring ``relation``.

    Cached per process: simulated clients with the same public parameters share it (one
    computes it while the others, in threads beside it, wait for the cached value). The
    wait is per value: a client asking for this round's epsilon does not queue behind the
    next round's, being computed ahead (:func:`_ahead`) here or in another process.
    """
    key = (merge(history), float(delta), accountant, relation)
    with _lock_for(key):
        return _epsilon(*key)


_LOCKS: dict[tuple, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _lock_for(key: tuple) -> threading.Lock:
    """The lock under which ``key``'s epsilon is computed in this process (one per value;
    dropped with the caches they guard)."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(key)
        if lock is None:
            if len(_LOCKS) >= 4096:  # _epsilon's cache holds 1024: older ones are gone
                _LOCKS.clear()
            lock = _LOCKS[key] = threading.Lock()
        return lock
def _ahead(history: Iterable[Entry], delta: float, accountant: str, relation: str) -> None:
    """:func:`epsilon` on a worker thread, its value left in the cache (an error is left
    for the caller's own call to raise)."""
    background.submit("accounting", epsilon, list(history), delta, accountant, relation)


def way_out(floor: float, accountant: str) -> str:
    """What to change when no noise reaches the target: the floor's epsilon is delta's
    doing (a noise multiplier cannot push epsilon below what delta alone allows)."""
    tighter = "" if accountant == "pld" else ", or accountant = 'pld' (tighter)"
    return (f"Set target-epsilon to at least {floor * 1.01:.3g}, or a larger delta (epsilon "
            f"this small is bounded by delta, not by the noise){tighter}.")


@functools.lru_cache(maxsize=256)
def calibrate_noise(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                    accountant: str = "pld", relation: str = "add-remove") -> float:
    """The smallest noise multiplier that keeps ``steps`` DP-SGD steps within the target.

    A function of public values only, so a run computes it once
    (:mod:`.shared_memo`): the pre-flight check's calibration (~2 s under the PLD) is
    the one the runtime and its clients read back, to the bit."""
    check_accountant(accountant, relation)
    key = ("noise-multiplier", float(target_epsilon), float(delta), float(sample_rate),
           int(steps), accountant, relation)
    return shared_memo.shared(key, lambda: _calibrate(target_epsilon, delta, sample_rate,
                                                      steps, accountant, relation))


def _calibrate(target_epsilon: float, delta: float, sample_rate: float, steps: int,
               accountant: str, relation: str) -> float:
    if accountant == "pld":
        return _calibrate_pld(target_epsilon, delta, sample_rate, steps, relation)
    from opacus.accountants.utils import MAX_SIGMA, get_noise_multiplier

    # Epsilon falls as sigma grows: when Opacus' largest sigma is not enough, say so after
    # one accountant call instead of its ~17 doublings up to that sigma.
    floor = _epsilon(((MAX_SIGMA, sample_rate, steps),), float(delta), accountant)
    if floor > target_epsilon:
        raise BudgetTooSmall(
            f"target-epsilon = {target_epsilon} cannot be met for {steps} steps at sample "
            f"rate {sample_rate:.4g} and delta {delta:.3g}: even a noise multiplier of "
            f"{MAX_SIGMA:.0e} gives epsilon {floor:.3g} under the {accountant} accountant. "
            + way_out(floor, accountant))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Optimal order is the", UserWarning)
            return float(get_noise_multiplier(target_epsilon=target_epsilon,
                                              target_delta=delta, sample_rate=sample_rate,
                                              steps=steps, accountant=accountant))
    except ValueError as exc:
        raise BudgetTooSmall(
            f"target-epsilon = {target_epsilon} cannot be met for {steps} steps at sample "
            f"rate {sample_rate:.4g} and delta {delta:.3g}: {exc}") from exc


def _calibrate_pld(target: float, delta: float, q: float, steps: int, relation: str,
                   rtol: float = 1e-3) -> float:
    """Bisection on sigma to ``rtol`` under dp-accounting's PLD, searched at a coarse
    discretization (1e-3: 7x faster, epsilon within 1e-4 relative) and confirmed at the
    default one, which is what the ledger reports: the multiplier returned meets the
    target as claimed."""
    from opacus.accountants.utils import MAX_SIGMA

    def eps(sigma: float, interval: float = 1e-3) -> float:
        return _pld_epsilon(((sigma, q, steps),), float(delta), relation, interval)

    if eps(MAX_SIGMA) > target:
        raise BudgetTooSmall(
            f"target-epsilon = {target} cannot be met for {steps} steps at sample rate "
            f"{q:.4g} and delta {delta:.3g}: even a noise multiplier of {MAX_SIGMA:.0e} gives "
            f"epsilon {eps(MAX_SIGMA):.3g} under dp-accounting's PLD. "
            + way_out(eps(MAX_SIGMA), "pld"))
    hi = 1.0
    while eps(hi) > target:
        hi *= 2
    lo = hi / 2
    while lo > 1e-3 and eps(lo) <= target:
        hi, lo = lo, lo / 2
    while hi / lo > 1 + rtol:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= target else (mid, hi)
    while eps(hi, 1e-4) > target:
        hi *= 1 + rtol
    return hi


def auto_delta(num_records: int) -> float:
    """The default delta for a client with n records: 1 / (10 n), well below 1 / n."""
    return 1.0 / (10 * num_records)


def clients_per_round(num_clients: int, fraction: float, min_clients: int) -> int:
    """How many clients Flower's strategies sample each round (their own formula)."""
    return min(max(int(num_clients * fraction), min_clients), num_clients)


def planned_rounds(num_rounds: int, fraction: float, min_clients: int,
                   num_clients: int) -> int:
    """Rounds a client expects to train in, given how many clients Flower samples per round."""
    per_round = clients_per_round(num_clients, fraction, min_clients)
    return max(1, math.ceil(num_rounds * per_round / num_clients))


@dataclass
class ClientLedger:
    """One client's DP-SGD parameters and the steps it has taken, across rounds."""

    noise_multiplier: float
    sample_rate: float
    delta: float
    accountant: str = "pld"
    budget: float = 0.0  # total epsilon allowed; 0 = no limit
    history: list[Entry] = field(default_factory=list)
    # round -> digest of what the client trained on in it (see :meth:`is_replay`)
    released: dict[int, str] = field(default_factory=dict)
    relation: str = "add-remove"

    def epsilon(self, extra_steps: int = 0) -> float:
        """Epsilon spent so far, or after ``extra_steps`` more steps."""
        entries = list(self.history)
        if extra_steps:
            entries.append((self.noise_multiplier, self.sample_rate, extra_steps))
        return epsilon(entries, self.delta, self.accountant, self.relation)

    def epsilon_ahead(self, extra_steps: int) -> None:
        """Start computing :meth:`epsilon` after ``extra_steps`` more steps on a worker
        thread (the round's training runs meanwhile); the later call finds it cached."""
        entries = [*self.history, (self.noise_multiplier, self.sample_rate, extra_steps)]
        _ahead(entries, self.delta, self.accountant, self.relation)

    def warm(self, steps_per_round: int, rounds: int) -> None:
        """Compute what this ledger's epsilons over ``rounds`` rounds of
        ``steps_per_round`` steps ask for first: the first round's epsilon and, under
        the PLD accountant, the one-step PLD (with its log-MGFs) of every grid the
        rounds reach. For a process about to fork the clients' workers: they inherit
        all of it instead of each building it (a one-step PLD is ~0.4 s of CPU)."""
        if steps_per_round <= 0 or rounds <= 0:
            return
        self.epsilon(steps_per_round)
        if self.accountant == "pld" and 0 < self.sample_rate < 1:
            _warm_grids(self.noise_multiplier, self.sample_rate, self.delta, self.relation,
                        steps_per_round, steps_per_round * rounds)

    def would_exceed(self, steps: int) -> bool:
        return self.budget > 0 and self.epsilon(steps) > self.budget * (1 + 1e-9)

    def record(self, steps: int, server_round: int | None = None, digest: str = "") -> None:
        """Account ``steps`` more steps; with a ``digest``, remember what round
        ``server_round``'s release was computed from."""
        if steps > 0:
            self.history = list(merge([*self.history,
                                       (self.noise_multiplier, self.sample_rate, steps)]))
        if server_round is not None and digest:
            self.released[int(server_round)] = digest

    def is_replay(self, server_round: int, digest: str) -> bool:
        """Whether round ``server_round`` was already trained from exactly these inputs.

        A run resumed after a crash asks again for a round whose update a client may
        already have sent. Training is a deterministic function of the global model, the
        run config, the seed derived from them and the client's data (on CPU, without
        ``secure-rng``), so the same ``digest`` means the same output: sending it again
        reveals nothing new and costs no privacy. Any other input is a new release.
        """
        return bool(digest) and self.released.get(int(server_round)) == digest

    @property
    def steps(self) -> int:
        return sum(e[2] for e in self.history)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and scalars, storable in a Flower ConfigRecord."""
        return {"noise-multiplier": self.noise_multiplier, "sample-rate": self.sample_rate,
                "delta": self.delta, "accountant": self.accountant, "budget": self.budget,
                "history-sigma": [float(e[0]) for e in self.history],
                "history-q": [float(e[1]) for e in self.history],
                "history-steps": [int(e[2]) for e in self.history],
                "released-rounds": [int(r) for r in self.released],
                "released-digests": list(self.released.values()),
                "relation": self.relation}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClientLedger:
        history = list(zip(d.get("history-sigma", []), d.get("history-q", []),
                           d.get("history-steps", []), strict=True))
        released = dict(zip(d.get("released-rounds", []), d.get("released-digests", []),
                            strict=True))
        return cls(float(d["noise-multiplier"]), float(d["sample-rate"]), float(d["delta"]),
                   str(d["accountant"]), float(d["budget"]),
                   [(float(s), float(q), int(n)) for s, q, n in history],
                   {int(r): str(k) for r, k in released.items()},
                   str(d.get("relation", "add-remove")))
