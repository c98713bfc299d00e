"""A client-level one-run audit of central DP-FedAvg with canary clients (Andrew, Kairouz,
Oh, Oprea, McMahan & Suriyakumar, ICLR 2024, "One-shot Empirical Privacy Estimation for
Federated Learning", section 4).

Record canaries inside a client's update cannot audit client-level DP: the client's
update is clipped to C as a whole, so a record moves it by a sliver of C (about 1e-5 of
a coordinate against noise of 2 in a fedpriv run). Andrew et al. add **canary clients**
instead: canary client k sends ``C u_k`` for a random unit vector u_k
(:class:`.canaries.DirectionCanaries`) in every round it takes part in; DP-FedAvg clips
(leaving it unchanged), sums and noises it like any client. Every canary client is
inserted; as many more directions are **held out** (never sent). At the end the auditor
takes the cosine between the model's total change and every direction: the held-out
cosines show what an inserted canary's would be without its client, and the one-shot
estimate (:mod:`.audit_oneshot`: Gaussians of unequal variance fitted to both) gives
epsilon; the equal-variance GDP bound of :mod:`.audit_gdp` is reported beside it.

**What it sees.** The released model's change along u_k is, in units of C, the sum over
rounds of B_r + N(0, z_u^2) with B_r = 1 when the canary took part (every round when every
client takes part; probability q per round under Poisson client sampling): the view of
:mod:`.audit_view` with ``steps`` = rounds, sample rate q, noise multiplier z_u (the noise
on the update sum; with adaptive clipping it is above the accounted z because the
clipped-count's noise is accounted too). With every client in every round it is the
Gaussian mechanism, whose epsilon is the claim's composition (what dp-accounting's PLD
claims, within its discretization; its RDP claims a little more). Fixed-size cohorts
are not audited: a canary client would have to displace a real one, which this
construction does not model.

**Cyclic participation** (``client-sampling = "cyclic"`` or ``"cyclic-poisson"``, any
``central-mechanism``): canary client k belongs to group k mod G and takes part only in its
group's rounds (Poisson-thinned at q for cyclic-poisson), as a real client of that group
would. The final model's noise along u_k is then the sum of the released rounds' correlated
noise, of std z_u ||1^T M|| (M: :meth:`.MatrixMechanism.noise_matrix`'s released rows), so
the view is the same Binomial mixture over the canary's m opportunities at the multiplier
z_u ||1^T M|| / sqrt(m) (q = 1 without thinning: a Gaussian with mu = m / (z_u ||1^T M||)).
The claim of a matrix mechanism without sampling is one Gaussian mechanism, so its GDP mu
is checked as for everyone-every-round.

:class:`CanaryClients` is what the server holds: which canaries take part in a round
(:meth:`CanaryClients.round_updates`, to add to the replies before ``clipped_sum``) and
the audit of the final model (:func:`audit_canary_clients`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from privacy.dp.dpfedavg import DPFedAvgParams

from .audit_gdp import gdp_epsilon, gdp_mu, gdp_mu_lower_bound
from .audit_oneshot import one_shot_estimate
from .audit_suite import oneshot_comparable, view_fractions
from .audit_view import CanaryView
from .canaries import DirectionCanaries

ESTIMATORS = 2  # the one-shot bound and the GDP bound share the confidence


def split(flat: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """A flat vector as arrays of ``shapes`` (the model's, in order)."""
    sizes = [int(np.prod(s)) for s in shapes]
    parts = np.split(np.asarray(flat), np.cumsum(sizes)[:-1])
    return [p.reshape(s) for p, s in zip(parts, shapes, strict=True)]


def flatten(arrays: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """The model's arrays as one float64 vector."""
    if isinstance(arrays, np.ndarray):
        return arrays.astype(np.float64).reshape(-1)
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


@dataclass(frozen=True)
class CanaryClients:
    """``inserted`` canary clients and ``held_out`` directions never sent (the first
    ``inserted`` of ``directions`` are sent), each canary client taking part in a round
    with probability ``sampling_rate`` (1: every round), drawn from ``secret``."""

    directions: DirectionCanaries
    inserted: int
    sampling_rate: float
    secret: int
    groups: int = 0  # cyclic participation: canary k trains when group k mod groups does

    @classmethod
    def for_mechanism(cls, params: DPFedAvgParams, inserted: int, held_out: int, dim: int,
                      seed: int) -> CanaryClients:
        """Canary clients for a DP-FedAvg mechanism: its clipping norm, its sampling."""
        if params.sampling not in ("poisson", "cyclic", "cyclic-poisson") and not params.everyone:
            raise ValueError("canary clients audit DP-FedAvg with Poisson or cyclic client "
                             "sampling or every client every round; a fixed-size cohort "
                             "would need a canary to displace a real client")
        if inserted < 3 or held_out < 3:
            raise ValueError("the audit needs at least 3 canary clients and 3 held-out "
                             "directions")
        thinned = params.sampling in ("poisson", "cyclic-poisson") and not params.everyone
        q = params.fraction if thinned else 1.0
        return cls(DirectionCanaries(inserted + held_out, dim, params.clipping_norm, seed),
                   inserted, q, seed ^ 0x5EC7E7, params.groups if params.cyclic else 0)

    @property
    def held_out(self) -> int:
        return self.directions.count - self.inserted

    def participants(self, server_round: int) -> np.ndarray:
        """The canary clients that take part in ``server_round``."""
        everyone = np.arange(self.inserted)
        if self.groups:
            everyone = everyone[everyone % self.groups == (int(server_round) - 1) % self.groups]
        if self.sampling_rate >= 1:
            return everyone
        rng = np.random.default_rng([self.secret, int(server_round)])
        return everyone[rng.random(everyone.size) < self.sampling_rate]

    def round_updates(self, server_round: int, shapes: Sequence[tuple[int, ...]],
                      norm: float | None = None) -> Iterator[list[np.ndarray]]:
        """The updates of this round's canary clients, shaped like the model, one at a
        time; ``norm``: the round's clipping norm (adaptive clipping moves it)."""
        scale = (norm if norm is not None else self.directions.norm)
        for k in self.participants(server_round):
            yield split(scale * self.directions.direction(int(k)), shapes)

    def round_sum(self, server_round: int, shapes: Sequence[tuple[int, ...]],
                  norm: float | None = None) -> list[np.ndarray]:
        """The sum of this round's canary updates (to add to a securely aggregated sum of
        clipped updates: each canary update already has the clipping norm)."""
        total = [np.zeros(s) for s in shapes]
        for update in self.round_updates(server_round, shapes, norm):
            for acc, a in zip(total, update, strict=True):
                acc += a
        return total

    def statistics(self, model_delta: Sequence[np.ndarray] | np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """The cosines of the model's change with the inserted and the held-out directions."""
        cos = self.directions.cosines(flatten(model_delta))
        return cos[:self.inserted], cos[self.inserted:]

    def view(self, update_noise_multiplier: float, rounds: int,
             noise: np.ndarray | None = None,
             released: Sequence[int] | None = None) -> CanaryView:
        """What the final model shows of the canary client with the most chances to take
        part (:mod:`.audit_view`) over the ``released`` rounds (1-based; default the first
        ``rounds``: a round that released nothing adds neither a canary nor noise);
        ``noise``: the mechanism's noise matrix, one row per round (None: independent
        noise each round)."""
        done = np.asarray(list(released) if released is not None
                          else range(1, rounds + 1), dtype=int)
        if self.groups:
            chances = max(int(np.sum((done - 1) % self.groups == g))
                          for g in range(self.groups))
        else:
            chances = len(done)
        spread = (math.sqrt(len(done)) if noise is None
                  else float(np.linalg.norm(np.asarray(noise)[done - 1].sum(axis=0))))
        return CanaryView(update_noise_multiplier * spread / math.sqrt(max(chances, 1)),
                          self.sampling_rate, max(chances, 1))


def audit_canary_clients(clients: CanaryClients, model_delta: Sequence[np.ndarray] | np.ndarray,
                         params: DPFedAvgParams, rounds: int, claimed_epsilon: float | None,
                         confidence: float = 0.95,
                         released: Sequence[int] | None = None) -> dict[str, Any]:
    """The audit of the released model's change over ``rounds`` released rounds of
    DP-FedAvg (``params``: the mechanism as claimed), against the client-level
    ``claimed_epsilon`` and against the exact epsilon of the view.

    Reports the one-shot estimate and its lower bound (Andrew et al.), the GDP mu bound
    and its epsilon (Nasr et al. 2023), the view's epsilon, the fractions, and the claim
    check (``claim-consistent``: no bound above the claim; the GDP mu only against a
    Gaussian claim, every client every round).
    """
    delta = params.target_delta
    each = 1 - (1 - confidence) / ESTIMATORS
    ins, outs = clients.statistics(model_delta)
    oneshot = one_shot_estimate(ins, outs, delta, each)
    gdp = gdp_mu_lower_bound(ins, outs, each)
    matrix = params.matrix
    view = clients.view(params.update_multiplier, rounds,
                        None if matrix is None else matrix.noise_matrix(), released)
    gaussian = clients.sampling_rate >= 1
    epsilons = {"epsilon-estimate-oneshot": oneshot.epsilon_estimate,
                "epsilon-lower-bound-oneshot": oneshot.epsilon_lower_bound,
                "epsilon-estimate-gdp": gdp_epsilon(gdp.mu_lower_bound, delta)}
    out: dict[str, Any] = {
        "audit": "canary clients (Andrew et al. 2024)", "canary-clients": clients.inserted,
        "held-out": clients.held_out, "rounds": rounds,
        "client-sampling-rate": clients.sampling_rate, **oneshot.record(),
        "mu-lower-bound-gdp": gdp.mu_lower_bound, **epsilons, "delta": delta,
        "confidence": confidence, "per-bound-confidence": each,
        "epsilon-claimed": claimed_epsilon,
        **view_fractions(epsilons, claimed_epsilon, view.epsilon(delta))}
    if claimed_epsilon is None:
        return {**out, "claim-consistent": None, "claim-checked-by": "no claim"}
    checked = {}
    if oneshot_comparable(claimed_epsilon, delta, gaussian, view):
        checked["oneshot"] = oneshot.epsilon_lower_bound > claimed_epsilon
    if gaussian:
        out["mu-claimed"] = gdp_mu(claimed_epsilon, delta)
        checked["gdp"] = gdp.mu_lower_bound > out["mu-claimed"]
    return {**out, "claim-consistent": not any(checked.values()),
            "claim-checked-by": ", ".join(checked) or "nothing comparable",
            "claim-rejected-by": [name for name, over in checked.items() if over]}


def simulate_dpfedavg_audit(z_claimed: float, z_used: float | None = None,
                            canary_clients: int = 1000, held_out: int = 1000,
                            rounds: int = 3, dim: int = 26010, real_clients: int = 20,
                            sampling: str = "fixed", fraction: float = 1.0,
                            clipping_norm: float = 1.0, delta: float = 1e-5,
                            confidence: float = 0.95, accountant: str = "pld",
                            seed: int = 0, mechanism: str = "gaussian", groups: int = 0,
                            bands: int = 0) -> dict[str, Any]:
    """A DP-FedAvg run through the project's mechanism (:class:`DPFedAvg`'s release,
    :func:`clipped_sum`, :class:`CentralAccountant`) with canary clients: ``real_clients``
    send random updates (norm 2C before clipping), the server adds the round's canary
    updates to the replies, clips, sums and noises with ``z_used`` (default: as claimed),
    and the audit compares the final model's change with the epsilon ``z_claimed`` is
    accounted for. ``dim`` defaults to the small CNN's parameter count. ``sampling =
    "cyclic"`` or ``"cyclic-poisson"`` with ``groups`` runs ``mechanism`` (gaussian,
    banded-mf, tree) over cyclic groups, real client i in group i mod groups."""
    from privacy.dp.dpfedavg import CentralAccountant, DPFedAvg, clipped_sum

    def params_at(z: float) -> DPFedAvgParams:
        return DPFedAvgParams(noise_multiplier=z, clipping_norm=clipping_norm,
                              population=real_clients, sampling=sampling, fraction=fraction,
                              delta=delta, accountant=accountant, mechanism=mechanism,
                              groups=groups, bands=bands, rounds=rounds if groups else 0)

    claim, used = params_at(z_claimed), params_at(z_used if z_used is not None else z_claimed)
    clients = CanaryClients.for_mechanism(claim, canary_clients, held_out, dim, seed)
    shapes = [(dim,)]
    rng = np.random.default_rng([seed, 1])
    server = DPFedAvg(used, seed=seed)
    total = np.zeros(dim)
    for r in range(1, rounds + 1):
        eligible = np.arange(real_clients)
        if used.cyclic:
            eligible = eligible[eligible % groups == (r - 1) % groups]
        thinned = sampling in ("poisson", "cyclic-poisson") and not used.everyone
        taking_part = (eligible[rng.random(eligible.size) < used.fraction] if thinned
                       else eligible)
        updates: list[list[np.ndarray]] = []
        for _ in taking_part:
            u = rng.standard_normal(dim)
            updates.append([2 * clipping_norm * u / np.linalg.norm(u)])
        replies = [*updates, *clients.round_updates(r, shapes, server.clipping_norm)]
        clipped, bits = clipped_sum(replies, server.clipping_norm, shapes)
        total += server.release(r, clipped, bits).update[0]
    claimed = CentralAccountant(claim).epsilon_after(rounds)
    return {"noise-multiplier-claimed": z_claimed, "noise-multiplier-used": used.noise_multiplier,
            "dim": dim, "real-clients": real_clients,
            **audit_canary_clients(clients, total, claim, rounds, claimed, confidence)}


def central_noise_for(target_epsilon: float, rounds: int, delta: float = 1e-5,
                      sampling: str = "fixed", fraction: float = 1.0,
                      population: int = 20, accountant: str = "pld") -> float:
    """The noise multiplier z whose DP-FedAvg claim (:class:`CentralAccountant`) after
    ``rounds`` is ``target_epsilon``. Every client every round: the Gaussian mechanism
    composed, z = sqrt(rounds) / mu in closed form (dp-accounting's PLD gives it back
    within its discretization); otherwise bisection on the accountant (slow: seconds a
    step)."""
    from privacy.dp.dpfedavg import CentralAccountant

    def params(z: float) -> DPFedAvgParams:
        return DPFedAvgParams(noise_multiplier=z, clipping_norm=1.0, population=population,
                              sampling=sampling, fraction=fraction, delta=delta,
                              accountant=accountant)

    if params(1.0).everyone and accountant == "pld":
        return float(np.sqrt(rounds) / gdp_mu(target_epsilon, delta))
    lo, hi = 0.05, 1.0
    while CentralAccountant(params(hi)).epsilon_after(rounds) > target_epsilon:
        lo, hi = hi, 2 * hi
    while hi / lo > 1 + 1e-3:
        mid = (lo * hi) ** 0.5
        over = CentralAccountant(params(mid)).epsilon_after(rounds) > target_epsilon
        lo, hi = (mid, hi) if over else (lo, mid)
    return hi


def released_rounds(state: dict[str, Any]) -> list[int]:
    """The released rounds a checkpoint kept (an older one kept only their count: then the
    first rounds, as no round was skipped before rounds could be skipped)."""
    kept = state.get("released-rounds")
    return ([int(r) for r in kept] if kept is not None
            else list(range(1, int(state["rounds"]) + 1)))


class CanaryClientAudit:
    """What the server of a ``dp = "central"`` run keeps for the canary-client audit: the
    canary clients, the model as first sent, the rounds released. The aggregation adds
    :meth:`replies` to each round's replies before ``clipped_sum`` (or :meth:`round_sum`
    to a securely aggregated sum), calls :meth:`released` after each release, and
    :meth:`result` scores the final model."""

    def __init__(self, clients: CanaryClients, params: DPFedAvgParams) -> None:
        self.clients = clients
        self.params = params
        self.start: list[np.ndarray] | None = None
        self.released_rounds: list[int] = []  # the rounds that released a model

    @classmethod
    def for_run(cls, params: DPFedAvgParams, canary_clients: int, held_out: int,
                num_parameters: int, seed: int) -> CanaryClientAudit:
        return cls(CanaryClients.for_mechanism(params, canary_clients, held_out,
                                               num_parameters, seed), params)

    def begin(self, current: Sequence[np.ndarray]) -> None:
        """Remember the model the run started from (the first round's, once)."""
        if self.start is None:
            self.start = [np.array(a, dtype=np.float64, copy=True) for a in current]

    def replies(self, server_round: int, current: Sequence[np.ndarray],
                clipping_norm: float) -> list[list[np.ndarray]]:
        """This round's canary updates (norm = the round's clipping norm)."""
        self.begin(current)
        return list(self.clients.round_updates(server_round, [np.shape(a) for a in current],
                                               clipping_norm))

    def round_sum(self, server_round: int, current: Sequence[np.ndarray],
                  clipping_norm: float) -> list[np.ndarray]:
        self.begin(current)
        return self.clients.round_sum(server_round, [np.shape(a) for a in current],
                                      clipping_norm)

    @property
    def rounds(self) -> int:
        return len(self.released_rounds)

    def released(self, server_round: int) -> None:
        self.released_rounds.append(int(server_round))

    def result(self, final: Sequence[np.ndarray], claimed_epsilon: float | None,
               confidence: float = 0.95) -> dict[str, Any]:
        """The audit of the model's change since :meth:`begin` (see
        :func:`audit_canary_clients`)."""
        if self.start is None or self.rounds == 0:
            raise ValueError("no round was released with canary clients")
        change = [np.asarray(f, dtype=np.float64) - s for f, s in zip(final, self.start,
                                                                     strict=True)]
        return audit_canary_clients(self.clients, change, self.params, self.rounds,
                                    claimed_epsilon, confidence, self.released_rounds)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (the start model goes with the checkpoint's arrays)."""
        return {"rounds": self.rounds, "released-rounds": list(self.released_rounds)}

    def restore(self, state: dict[str, Any], start: Sequence[np.ndarray]) -> None:
        self.released_rounds = released_rounds(state)
        self.start = [np.asarray(a, dtype=np.float64) for a in start]
