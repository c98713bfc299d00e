"""fedpriv's DP mechanisms as the product runs them, on a dataset D and a neighbour D'.

Each adapter turns a run config into a mechanism for :mod:`privacy.dp.neighbours` (a
callable ``run(which, seed) -> release``) plus the claim the product makes for it, so
that the tester checks the very code path a run takes, not a model of it:

- ``local``: a client's DP-SGD round, ``clients.update.local_update`` (which calls
  ``clients.local_dp.dp_round``) with a fresh Flower ``Context`` each run, on n real
  records of client 0 vs a neighbour (one record added under add/remove, one replaced
  under replace-one). The release is the update (new weights minus the global model) and
  every value the disclosure policy lets the client send in the clear; the claim is the
  client's ledger's epsilon at its delta.
- ``cvae``: the CVAE anonymizer's DP-SGD training (``privacy.anonymize.cvae.train_cvae``)
  on n vs n + 1 member records; the release is the trained weights and the epsilon the
  client reports of it (``anon-info-epsilon``); the claim is that epsilon.
- ``central``: DP-FedAvg on the server (``strategies.central_dp``: the cohort rule,
  ``clipped_sum`` and ``CentralPrivacy.release``) over k - 1 vs k clients' updates, the
  extra one a fixed long vector on one coordinate; claim: ``CentralAccountant``, one
  round.
- ``secagg``: the same under SecAgg+: client-side clipping (``clients.postprocess``),
  Flower's SecAgg+ quantization and its unmasked sum (the masks cancel exactly, so they
  are left out), the server's noise with quantization's slack accounted.

Adapters live here, not in ``privacy/``, because they run the clients', strategies' and
config's code (``privacy`` sits below those layers: tests/test_layers.py). A mechanism of
your own registers in :data:`MECHANISMS` (``fedpriv dp-test --mechanism NAME``), or goes
straight to :func:`privacy.dp.neighbours.test_mechanism`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from privacy.dp.dpfedavg import default_central_delta
from privacy.dp.neighbours import D_PRIME, Claim, Mechanism, NeighbourReport, test_mechanism
from privacy.registry import Registry
from tasks.config import ConfigError, RunConfig

if TYPE_CHECKING:
    import torch


DEFAULT_RECORDS = 50  # records in D for the record-level mechanisms


@dataclass
class NeighbourSetup:
    """A mechanism ready for the tester: what to run, what it claims, what D and D' are."""

    run: Mechanism
    claim: Claim
    name: str
    neighbours: str
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MechanismInfo:
    """What the CLI knows of a mechanism without importing it: a line of help, and whether a
    run config makes a DP claim for it (``claims(cfg)``: the reason it does not, or None)."""

    help: str
    claims: Callable[[RunConfig], str | None]


MECHANISMS: Registry = Registry(
    "DP mechanism", where="experiments.neighbour_mechanisms.MECHANISMS", info=MechanismInfo,
    error=ConfigError,
    signature="(cfg: RunConfig, records: int | None) -> NeighbourSetup, its run(which, seed) "
              "releasing one output on which = 'D' or \"D'\"")
"""The mechanisms ``fedpriv dp-test`` can test, by name (fedpriv's first)."""


def _local_claim(cfg: RunConfig) -> str | None:
    return None if cfg.privacy.dp == "local" else f"dp = {cfg.privacy.dp!r}, not 'local'"


def _central_claim(cfg: RunConfig) -> str | None:
    if cfg.privacy.dp != "central":
        return f"dp = {cfg.privacy.dp!r}, not 'central'"
    if cfg.secagg.protocol != "off":
        return (f"secure-aggregation = {cfg.secagg.protocol!r}: the server's sum is computed "
                "under it (mechanism 'secagg' for SecAgg+)")
    return None


def _secagg_claim(cfg: RunConfig) -> str | None:
    if cfg.privacy.dp != "central":
        return f"dp = {cfg.privacy.dp!r}, not 'central'"
    if cfg.secagg.protocol != "secagg+":
        return f"secure-aggregation = {cfg.secagg.protocol!r}, not 'secagg+'"
    return None


def _cvae_claim(cfg: RunConfig) -> str | None:
    a = cfg.anonymization
    if a.anonymizer != "cvae":
        return f"anonymizer = {a.anonymizer!r}, not 'cvae'"
    if a.cvae_epsilon <= 0:
        return "cvae-epsilon = 0 (the CVAE trains without DP)"
    return None


MECHANISMS.register("local", "experiments.neighbour_mechanisms:local_dpsgd",
                    help="a client's local DP-SGD round (dp = local): n vs n + 1 records",
                    claims=_local_claim)
MECHANISMS.register("secagg", "experiments.neighbour_mechanisms:secagg_dpfedavg",
                    help="DP-FedAvg under SecAgg+ (dp = central, secure-aggregation = "
                         "secagg+): k - 1 vs k clients", claims=_secagg_claim)
MECHANISMS.register("central", "experiments.neighbour_mechanisms:central_dpfedavg",
                    help="DP-FedAvg on the server (dp = central): k - 1 vs k clients",
                    claims=_central_claim)
def _distributed_claim(cfg: RunConfig) -> str | None:
    return None if cfg.privacy.dp == "distributed" else \
        f"dp = {cfg.privacy.dp!r}, not 'distributed'"


MECHANISMS.register("distributed", "experiments.neighbour_mechanisms:distributed_skellam",
                    help="distributed DP (dp = distributed): Skellam shares in the SecAgg+ "
                         "sum, one client's update present vs zeroed", claims=_distributed_claim)
MECHANISMS.register("cvae", "experiments.neighbour_mechanisms:cvae_dpsgd",
                    help="the CVAE anonymizer's DP-SGD (anonymizer = cvae, cvae-epsilon > 0): "
                         "n vs n + 1 records", claims=_cvae_claim)


def no_claim(cfg: RunConfig, mechanism: str | None = None) -> str:
    """The one-paragraph refusal for a configuration that makes no DP claim to test."""
    why = "; ".join(f"{name}: {MECHANISMS.info(name).claims(cfg)}" for name in MECHANISMS
                    if mechanism is None or name == mechanism)
    asked = f" for mechanism {mechanism!r}" if mechanism else ""
    return (f"this configuration makes no differential-privacy claim{asked}, so there is "
            f"nothing to test: a neighbouring-datasets test compares the epsilon a mechanism "
            f"claims with a lower bound measured on D and D', and here ({why}) fedpriv "
            f"claims no epsilon{' for it' if mechanism else ' at all'}. Test a DP "
            "configuration (or another --mechanism), e.g. --set dp=local "
            "--set noise-multiplier=4 (local DP-SGD), --set dp=central (DP-FedAvg), or "
            "anonymizer = cvae with cvae-epsilon > 0.")


def mechanism_for(cfg: RunConfig, mechanism: str | None = None) -> str:
    """The mechanism to test: ``mechanism`` if the config claims DP for it, else the first
    one it does claim DP for; ConfigError (one paragraph) when there is none."""
    if mechanism is not None:
        MECHANISMS.check(mechanism)
        if MECHANISMS.info(mechanism).claims(cfg) is not None:
            raise ConfigError(no_claim(cfg, mechanism))
        return mechanism
    for name in MECHANISMS:
        if MECHANISMS.info(name).claims(cfg) is None:
            return name
    raise ConfigError(no_claim(cfg))


def test_config(cfg: RunConfig, *, mechanism: str | None = None, runs: int = 200,
                records: int | None = None, confidence: float = 0.95, seed: int = 0,
                progress: Callable[[int, int], None] | None = None) -> NeighbourReport:
    """Run the neighbouring-datasets test on the mechanism ``cfg`` describes (see
    :func:`mechanism_for`) with ``records`` records in D (None: the mechanism's default,
    50 records, or for DP-FedAvg num-clients - 1 clients)."""
    name = mechanism_for(cfg, mechanism)
    setup: NeighbourSetup = MECHANISMS.load(name)(cfg, records)
    report = test_mechanism(setup.run, runs=runs, claim=setup.claim, confidence=confidence,
                            seed=seed, name=setup.name, neighbours=setup.neighbours,
                            progress=progress)
    report.notes.extend(setup.notes)
    return report


test_config.__test__ = False  # type: ignore[attr-defined]  (pytest: not a test)


# ---------------------------------------------------------------------- helpers


def _relation(cfg: RunConfig) -> str:
    """The neighbouring relation local DP-SGD states epsilon for (add-remove before the
    ``dp-relation`` key existed)."""
    return str(getattr(cfg.privacy, "dp_relation", "add-remove"))


def _with_seed(cfg: RunConfig, seed: int) -> RunConfig:
    """``cfg`` with another run seed (everything a client draws derives from it)."""
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seed=seed))


def _flat(state: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([(state[k].double() - old[k].double()).reshape(-1).numpy()
                           for k in old])


def _numbers(values: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if k not in skip and isinstance(v, int | float | np.number)}


@contextmanager
def _as_a_client(cfg: RunConfig) -> Iterator[None]:
    """Train as a ClientApp does: ``client-threads`` torch threads (``Client.of``), and
    without Opacus' "First batch is empty" notice (frequent with small Poisson batches)."""
    import torch

    quiet = logging.getLogger("opacus.data_loader")
    threads, level = torch.get_num_threads(), quiet.level
    torch.set_num_threads(cfg.resources.client_threads)
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        quiet.setLevel(level)


def _neighbour_rows(records: int, relation: str, what: str
                    ) -> tuple[dict[str, np.ndarray], str]:
    """Row indices of D (the first ``records`` rows) and D' (one row more under add-remove,
    the last one replaced by the next under replace-one), and that in words."""
    idx = {"D": np.arange(records)}
    if relation == "replace-one":
        idx[D_PRIME] = np.r_[np.arange(records - 1), records]
        return idx, (f"the first {records} {what} vs the same with the last replaced by "
                     "another (replace-one)")
    idx[D_PRIME] = np.arange(records + 1)
    return idx, f"the first {records} {what} vs {records + 1} (add one)"


def _check_records(records: int, available: int, what: str) -> None:
    if records < 2 or records + 1 > available:
        raise ConfigError(f"--records {records}: D needs at least 2 {what} and D' one more, "
                          f"and {available} are available here; choose 2 to "
                          f"{available - 1}.")


# ---------------------------------------------------------------------- local DP-SGD


def local_dpsgd(cfg: RunConfig, records: int | None = None) -> NeighbourSetup:
    """Local DP-SGD as client 0 runs it (``clients.update.local_update``), on ``records``
    of its real training rows (D) vs D + the next row (add-remove) or D with its last row
    replaced by the next (replace-one)."""
    import torch
    from flwr.app import Context, RecordDict

    from clients.local_dp import load_ledger
    from clients.update import Client, local_update
    from privacy.dp.disclosure import IDENTITY, policy
    from tasks.splits import Split, client_split, model_for

    fed, relation = cfg.federation, _relation(cfg)
    records = DEFAULT_RECORDS if records is None else records
    torch.manual_seed(cfg.training.seed)  # the global model the server sends: public
    model, model_name = model_for(cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the client's own rows: local_update makes of them what it trains on (its anonymizer's
    # release, with one), as a ClientApp does
    split = client_split(cfg, 0, fed.num_clients)
    rows_x, rows_y = split.x, split.y
    _check_records(records, len(rows_y), "records")
    idx, neighbours = _neighbour_rows(records, relation, "real records of client 0")
    data = {w: Split(rows_x[torch.from_numpy(i)], rows_y[torch.from_numpy(i)],
                     split.num_classes) for w, i in idx.items()}
    rule = policy("local", cfg.secagg.enabled, cfg.privacy.report_client_metrics)
    ledgers: dict[str, Any] = {}

    def run(which: str, seed: int) -> dict[str, Any]:
        seeded = _with_seed(cfg, seed)
        # a fresh Context: the client's first round (its ledger starts empty)
        context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                          run_config={})
        client = Client(seeded, 0, fed.num_clients, data[which])
        with _as_a_client(cfg):
            new, metrics = local_update(client, context, state, {"server-round": 1})
        update = _flat(new, state) if new is not None else np.zeros(
            sum(v.numel() for v in state.values()))
        ledgers.setdefault(which, load_ledger(context))
        return {"update": update, **_numbers(rule.filter(metrics), IDENTITY)}

    for which in ("D", D_PRIME):  # the claim: what each side's ledger says
        run(which, cfg.training.seed)
    claim = Claim(max(ledgers[w].epsilon() for w in ledgers),
                  max(ledgers[w].delta for w in ledgers),
                  f"{relation}: one record", "the client's DP-SGD ledger after one round, the "
                  "larger of D's and D''s")
    t = cfg.training
    name = (f"local DP-SGD ({model_name}, B = {t.batch_size}, "
            f"{t.local_epochs} local epoch{'s' * (t.local_epochs != 1)}, noise multiplier "
            f"{ledgers['D'].noise_multiplier:.4g}, clipping {cfg.privacy.max_grad_norm:g})")
    return NeighbourSetup(run, claim, name, neighbours)


# ---------------------------------------------------------------------- central DP-FedAvg


def _client_updates(num_parameters: int, others: int, clip: float, seed: int
                    ) -> tuple[list[np.ndarray], np.ndarray]:
    """Fixed updates of the clients in both D and D' (norms from 0.2 C to 2 C: some are
    clipped) and the extra client's of D': 10 C on one coordinate, clipped to C there (a
    canary-like update, the easiest for a black-box test to see; any direction is a
    worst case for the Gaussian's analysis)."""
    rng = np.random.default_rng([seed, 0xC1])
    out = []
    for _ in range(others):
        u = rng.normal(size=num_parameters)
        out.append(u / np.linalg.norm(u) * clip * rng.uniform(0.2, 2.0))
    extra = np.zeros(num_parameters)
    extra[rng.integers(num_parameters)] = 10.0 * clip
    return out, extra


def _shapes(cfg: RunConfig) -> list[tuple[int, ...]]:
    from tasks.splits import model_for

    return [tuple(v.shape) for v in model_for(cfg)[0].state_dict().values()]


def _split(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    sizes = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]
    return [a.reshape(s) for a, s in zip(np.split(flat, sizes), shapes, strict=True)]


def _central(cfg: RunConfig, clients: int | None, secagg: bool,
             population_follows_data: bool = False) -> NeighbourSetup:
    import random

    from privacy.dp.dpfedavg import NEIGHBOURS, CentralAccountant
    from strategies.central_dp import CentralDPAggregation, CentralPrivacy, central_params

    population = cfg.federation.num_clients
    if clients is not None and clients != population - 1:
        raise ConfigError(f"--records {clients}: DP-FedAvg's records are clients, its D' the "
                          f"configured population (num-clients = {population}) and D one "
                          f"client fewer; leave --records out or set num-clients = "
                          f"{clients + 1}.")
    if population < 2:
        raise ConfigError("DP-FedAvg's neighbour test needs num-clients >= 2 (D has one "
                          "client fewer than the population).")
    shapes = _shapes(cfg)
    dim = sum(int(np.prod(s)) for s in shapes)
    slack = 0.0
    if secagg:
        from strategies.protocols.secagg import quantization_slack

        slack = quantization_slack(cfg.secagg, dim)
    p = cfg.privacy
    others, extra = _client_updates(dim, population - 1, p.clipping_norm, cfg.training.seed)
    members = {"D": others, D_PRIME: [*others, extra]}

    def params(which: str) -> Any:
        n = len(members[which]) if population_follows_data else population
        return central_params(cfg, n, slack)

    client_side = p.central_clipping.startswith("client") or secagg

    # under cyclic sampling the mechanism is the whole run (its noise is correlated across
    # rounds): every round is released, each client's update the same in each of its rounds
    rounds = cfg.federation.num_server_rounds if params(D_PRIME).cyclic else 1
    matrix = params(D_PRIME).matrix
    # the Cholesky factor of the rounds' noise covariance (M M^T): solving with it turns
    # the correlated noise back into iid noise, a post-processing the tester may use
    whiten = (np.linalg.cholesky(matrix.noise_matrix() @ matrix.noise_matrix().T)
              if matrix is not None and matrix.kind != "gaussian" else None)

    def run(which: str, seed: int) -> dict[str, Any]:
        privacy = CentralPrivacy(params(which), p.central_clipping, seed)
        aggregation = CentralDPAggregation(privacy, client_side)
        ids = list(range(len(members[which])))
        current = [np.zeros(s, dtype=np.float32) for s in shapes]
        released = []
        for server_round in range(1, rounds + 1):
            aggregation.begin_round(server_round)
            chosen = aggregation.sample(ids, random.Random(seed + 7919 * (server_round - 1)), 0)
            updates = [_split(members[which][i], shapes) for i in chosen]
            if secagg:
                total, bits = _secagg_sum(updates, privacy.clipping_norm, cfg, seed)
            else:
                total, bits = _server_sum(updates, privacy.clipping_norm, shapes)
            new = privacy.release(server_round, current, total, bits)
            released.append(np.concatenate([(a - c).reshape(-1)
                                            for a, c in zip(new, current, strict=True)]))
        out: dict[str, Any] = {"update": np.concatenate(released)}
        if whiten is not None:  # the adversary's best view of correlated noise: iid again
            sums = np.stack(released) * privacy.params.denominator
            out["whitened"] = np.linalg.solve(whiten, sums).reshape(-1)
        if privacy.params.adaptive:
            out["next-clipping-norm"] = privacy.clipping_norm
        return out

    accountant_params = params(D_PRIME)
    eps = max(CentralAccountant(params(w)).epsilon_after(rounds) for w in ("D", D_PRIME))
    claim = Claim(eps, accountant_params.target_delta, NEIGHBOURS,
                  ("CentralAccountant, one round" if rounds == 1 else
                   f"CentralAccountant, {rounds} rounds of {p.central_mechanism} noise, "
                   f"cyclic groups") + (", quantization slack accounted" if secagg else ""))
    where = "under SecAgg+ (client-side clipping, quantized sum)" if secagg else "on the server"
    name = (f"DP-FedAvg {where}: noise multiplier {p.noise_multiplier:g}, clipping "
            f"{p.clipping_norm:g}, {p.client_sampling} sampling, {dim} parameters")
    neighbours = (f"{population - 1} clients' fixed updates vs the same plus one client whose "
                  f"update is 10 C on one coordinate (add one client; the population is "
                  f"{'the clients present' if population_follows_data else 'num-clients'})")
    return NeighbourSetup(run, claim, name, neighbours)


def _server_sum(updates: list[list[np.ndarray]], clip: float,
                shapes: list[tuple[int, ...]]) -> tuple[list[np.ndarray], list[bool]]:
    """What the plain path's server computes (``CentralDPAggregation.combine``)."""
    from privacy.dp.dpfedavg import clipped_sum

    return clipped_sum(updates, clip, shapes)


def _secagg_sum(updates: list[list[np.ndarray]], clip: float, cfg: RunConfig, seed: int
                ) -> tuple[list[np.ndarray], list[bool]]:
    """The sum the server gets under SecAgg+ with central DP: each client clips its update
    (``ClipToNorm``: float32 weights, as sent), Flower's secaggplus_mod quantizes it at weight
    1 with stochastic rounding (numpy's global generator, seeded here), and the workflow
    dequantizes the (unmasked) sum; ``SecAggProtocol.aggregated`` multiplies the average by
    the number of clients."""
    import torch
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    from clients.postprocess import ClipToNorm
    from privacy.dp.dpfedavg import UNCLIPPED_KEY

    s = cfg.secagg
    np.random.seed(seed % (1 << 32))  # Flower's stochastic rounding draws from it
    total_q: list[np.ndarray] | None = None
    bits = []
    for update in updates:
        old = {str(i): torch.zeros(a.shape, dtype=torch.float32) for i, a in enumerate(update)}
        new = {str(i): torch.from_numpy(a.astype(np.float32)) for i, a in enumerate(update)}
        metrics: dict[str, Any] = {}
        clipped = ClipToNorm(clip).apply(old, new, metrics)
        sent = [(clipped[k] - old[k]).numpy() for k in old]  # clients.update.as_update
        bits.append(bool(metrics[UNCLIPPED_KEY]))
        q = [a.astype(np.int64) for a in quantize(sent, s.clipping_range, s.quantization_range)]
        total_q = q if total_q is None else [t + a for t, a in zip(total_q, q, strict=True)]
    assert total_q is not None
    k = len(updates)
    average = dequantize(total_q, s.clipping_range, s.quantization_range)
    average = [(a - (k - 1) * s.clipping_range) / k for a in average]
    return [a.astype(np.float64) * k for a in average], bits


def central_dpfedavg(cfg: RunConfig, records: int | None = None, *,
                     population_follows_data: bool = False) -> NeighbourSetup:
    """Central DP-FedAvg as the server runs it without secure aggregation.

    The population N (hence the denominator) is num-clients on both sides, as the claim
    assumes; ``population_follows_data`` instead gives each side its own client count,
    as a deployment whose population is whoever connects would (strategies.build sizes
    the mechanism from the clients found)."""
    return _central(cfg, records, secagg=False,
                    population_follows_data=population_follows_data)


def secagg_dpfedavg(cfg: RunConfig, records: int | None = None) -> NeighbourSetup:
    """Central DP-FedAvg as the server runs it under SecAgg+."""
    return _central(cfg, records, secagg=True)


def distributed_skellam(cfg: RunConfig, records: int | None = None) -> NeighbourSetup:
    """Distributed DP as the clients and the server run it (each client's
    ``client_vector``, their modular sum, the server's ``server_sum``, FedAvg's division),
    for a round of the configured clients; zero-out neighbours: one client's update (10 C
    on one coordinate, clipped to C) present or zeroed, its noise share there either way."""
    from privacy.dp.distributed import NEIGHBOURS, client_vector, server_sum
    from tasks.distributed_dp import plan_for

    shapes = _shapes(cfg)
    dim = sum(int(np.prod(s)) for s in shapes)
    try:
        plan = plan_for(cfg, dim)
    except ValueError as exc:
        raise ConfigError(f"dp = 'distributed': {exc}") from None
    if records is not None and records != plan.cohort:
        raise ConfigError(f"--records {records}: distributed DP's records are the clients "
                          f"of a round ({plan.cohort} here); leave --records out.")
    others, extra = _client_updates(dim, plan.cohort - 1, plan.clip, cfg.training.seed)

    def run(which: str, seed: int) -> dict[str, Any]:
        rng = np.random.default_rng([seed, 0xD5])
        first = extra if which == "D" else np.zeros(dim)
        total = sum(client_vector(u, plan, seed, rng) for u in [first, *others])
        return {"update": server_sum(total, plan, seed) / plan.cohort}

    delta = cfg.privacy.delta or default_central_delta(cfg.federation.num_clients)
    claim = Claim(plan.epsilon([plan.cohort], delta), delta, NEIGHBOURS,
                  "DistributedPlan.epsilon, one round")
    name = (f"distributed DP (Skellam in SecAgg+): noise multiplier {plan.noise_multiplier:g}, "
            f"clipping {plan.clip:g}, {plan.bits} bits, {plan.cohort} clients, {dim} "
            "parameters")
    neighbours = (f"{plan.cohort - 1} clients' fixed updates plus one whose update is 10 C on "
                  "one coordinate (clipped to C), or zero (zero-out)")
    return NeighbourSetup(run, claim, name, neighbours)


# ---------------------------------------------------------------------- the CVAE


def cvae_dpsgd(cfg: RunConfig, records: int | None = None,
               data: tuple[np.ndarray, np.ndarray] | None = None) -> NeighbourSetup:
    """The CVAE anonymizer's DP-SGD (``train_cvae``) on client 0's member rows as the
    anonymizer gets them (``data``: rows of your own instead), ``records`` of them vs a
    neighbour under the relation the CVAE claims."""
    from privacy.anonymize.cvae import train_cvae

    a = cfg.anonymization
    records = DEFAULT_RECORDS if records is None else records
    if data is None:
        from clients.anonymized import holdout_split
        from tasks.seeding import derive_seed
        from tasks.splits import client_split

        split = client_split(cfg, 0, cfg.federation.num_clients)
        members, _ = holdout_split(len(split.y), a.privacy_holdout,
                                   derive_seed(cfg.training.seed, 0))
        x = split.x.numpy().reshape(len(split.y), -1)[members]
        y, num_classes = split.y.numpy()[members], split.num_classes
    else:
        x, y = np.asarray(data[0], dtype=np.float32), np.asarray(data[1])
        num_classes = int(y.max()) + 1
    _check_records(records, len(y), "records")
    # the relation the CVAE claims: add-remove with a public size, else replace-one (n is
    # public then); before cvae-public-records existed, Opacus' add-remove analysis
    public = getattr(a, "cvae_public_records", None)
    relation = "add-remove" if public is None or public > 0 else "replace-one"
    rows, neighbours = _neighbour_rows(records, relation, "member records")
    params = a.params()
    infos: dict[str, dict[str, Any]] = {}

    def run(which: str, seed: int) -> dict[str, Any]:
        with _as_a_client(cfg):
            i = rows[which]
            trained = train_cvae(x[i], y[i], num_classes, params, seed)
        infos.setdefault(which, trained.info)
        weights = np.concatenate([v.detach().double().reshape(-1).numpy()
                                  for v in trained.model.state_dict().values()])
        # what the client sends of it (clients.anonymized.Released.metrics): its epsilon
        return {"weights": weights, "anon-info-epsilon": float(trained.info["epsilon"])}

    for which in ("D", D_PRIME):
        run(which, cfg.training.seed)
    claim = Claim(max(i["epsilon"] for i in infos.values()),
                  max(i["delta"] for i in infos.values()),
                  f"{infos['D'].get('dp-relation', relation)}: one record",
                  "the CVAE's own accounting (cvae-epsilon), the larger of D's and D''s")
    name = (f"the CVAE anonymizer's DP-SGD ({a.cvae_epochs} epochs, batch {a.cvae_batch_size}, "
            f"cvae-epsilon {a.cvae_epsilon:g})")
    notes = ["The CVAE's min-max scaling is fitted on the client's data and is not covered by "
             "its epsilon (privacy/anonymize/cvae.py says so); the release tested here is the "
             "trained weights, not the scaled samples."]
    return NeighbourSetup(run, claim, name, neighbours, notes)
