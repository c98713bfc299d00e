"""One client's DP-SGD round: budget check, private training, cumulative accounting.

The client's privacy ledger (noise multiplier, sample rate, delta, and the history of
steps it has taken) lives in ``Context.state`` under ``"dp-sgd"``, so it survives
across rounds in simulation and on real SuperNodes, and rounds in which the client is
not sampled cost nothing. Everything DP-SGD's release depends on besides the update
(sampling rate, steps, normaliser, sigma, delta) comes from the configuration and a
public size (:mod:`privacy.dp.public`), never from the client's own record count under
add/remove neighbours.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, Context

from privacy.dp.accounting import (
    BudgetTooSmall,
    ClientLedger,
    auto_delta,
    calibrate_noise,
    planned_rounds,
)
from privacy.dp.dpsgd import make_private, resolve_mode
from privacy.dp.public import PublicSchedule, schedule_for
from tasks.config import RunConfig
from tasks.seeding import derive_seed
from tasks.splits import expected_partition_size, model_name
from tasks.training import (
    CanaryHook,
    TrainResult,
    client_optimizer,
    convolutions_channels_last,
    make_loader,
    round_steps,
    train_epochs,
)

STATE_KEY = "dp-sgd"


class LocalDPError(ValueError):
    """This client's DP-SGD settings cannot work (delta too large, budget too small)."""


def schedule(cfg: RunConfig, public_records: int, num_records: int) -> PublicSchedule:
    """This client's DP-SGD schedule under the run's relation (:mod:`privacy.dp.public`)."""
    return schedule_for(cfg.privacy.dp_relation, cfg.training.batch_size, public_records,
                        num_records)


def new_ledger(cfg: RunConfig, plan: PublicSchedule, num_clients: int) -> ClientLedger:
    """Fix this client's (sigma, q, delta) for the whole run, before its first round, from
    the public schedule ``plan`` only."""
    p, fed = cfg.privacy, cfg.federation
    q, n = plan.sample_rate, plan.records
    delta = p.delta or auto_delta(n)
    if delta >= 1.0 / n:
        raise LocalDPError(
            f"delta = {delta:g} is not below 1/N = {1 / n:g} for N = {n} records "
            f"({'the public size, dp-public-records' if plan.relation == 'add-remove' else 'n'}):"
            " such a delta allows leaking a whole record. Use delta = 0 (automatic 1/(10 N)) "
            "or a smaller value.")
    if p.target_epsilon > 0:
        rounds = planned_rounds(fed.num_server_rounds, fed.fraction_train,
                                fed.min_train_clients, num_clients)
        t = cfg.training
        steps = rounds * round_steps(t.local_epochs, plan.steps_per_epoch, t.local_steps)
        try:
            sigma = calibrate_noise(p.target_epsilon, delta, q, steps, p.accountant,
                                    plan.relation)
        except BudgetTooSmall as exc:
            raise LocalDPError(str(exc)) from exc
    else:
        sigma = p.noise_multiplier
    return ClientLedger(sigma, q, delta, p.accountant, p.target_epsilon,
                        relation=plan.relation)


def warm_accounting(cfg: RunConfig, num_partitions: int) -> None:
    """Compute here what every client's accounting of the run asks for first: the noise
    multiplier (calibrated, with a target epsilon: ~2 s), the one-step PLDs of the grids
    the planned rounds reach (~0.4 s each) and the first round's epsilon. A runtime
    calls it before forking its client workers, which then inherit the results instead
    of each computing them in its first rounds. Only where the schedule is public before
    any data (add/remove, the public size from the configuration); a setting that cannot
    work is left for the clients to report."""
    p, fed = cfg.privacy, cfg.federation
    if p.dp != "local" or p.dp_relation != "add-remove":
        return
    try:
        ledger, per_round = public_ledger(cfg, num_partitions)
    except LocalDPError:
        return
    rounds = planned_rounds(fed.num_server_rounds, fed.fraction_train, fed.min_train_clients,
                            num_partitions)
    ledger.warm(per_round, rounds)


def public_ledger(cfg: RunConfig, num_partitions: int) -> tuple[ClientLedger, int]:
    """The ledger a client starts from when its schedule is fixed by the public size
    (``dp-public-records``, else the expected partition size), and its steps a round."""
    t = cfg.training
    public = cfg.privacy.public_records or expected_partition_size(cfg, num_partitions)
    plan = schedule(cfg, public, public)
    return (new_ledger(cfg, plan, num_partitions),
            round_steps(t.local_epochs, plan.steps_per_epoch, t.local_steps))


def load_ledger(context: Context) -> ClientLedger | None:
    if STATE_KEY not in context.state.config_records:
        return None
    return ClientLedger.from_dict(dict(context.state.config_records[STATE_KEY]))


def save_ledger(context: Context, ledger: ClientLedger) -> None:
    context.state.config_records[STATE_KEY] = ConfigRecord(ledger.to_dict())


@dataclass
class DPRound:
    """The outcome of one DP-SGD round (``result`` is None when the budget stopped it)."""

    ledger: ClientLedger
    result: TrainResult | None
    model: torch.nn.Module | None
    reusable: bool = False  # the model is as built (book-keeping): it may go back to the pool

    def metrics(self) -> dict[str, Any]:
        out = {"epsilon": self.ledger.epsilon(), "delta": self.ledger.delta,
               "noise-multiplier": self.ledger.noise_multiplier,
               "sample-rate": self.ledger.sample_rate, "dp-steps": self.ledger.steps}
        if self.result is None:
            out["dp-skipped"] = 1
        return out


@functools.lru_cache(maxsize=64)
def _training_config_json(cfg: RunConfig) -> str:
    """The run config's keys that can change training, as :func:`release_digest` hashes
    them (converting the frozen config costs 1.6 ms: once per config, not per round)."""
    config = {k: v for k, v in asdict(cfg).items() if k not in ("results", "resources")}
    return json.dumps(config, sort_keys=True, default=str)


def release_digest(cfg: RunConfig, server_round: int, state: Mapping[str, torch.Tensor],
                   device: torch.device) -> str:
    """What a round's DP-SGD release is computed from: the round, the global model and
    every run-config key that can change training (not where results go, not how many
    threads). Empty when training is not reproducible (GPU kernels, ``secure-rng``), so
    that a repeated round is always accounted again (:meth:`ClientLedger.is_replay`)."""
    if cfg.privacy.secure_rng or device.type != "cpu":
        return ""
    h = hashlib.sha256()
    # json.dumps([server_round, config]) without converting the config every round
    h.update(f"[{json.dumps(server_round)}, {_training_config_json(cfg)}]".encode())
    for key, value in state.items():
        h.update(key.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def spare_core(cfg: RunConfig) -> bool:
    """Whether a client has a core its torch threads leave free: the runtimes give each
    client ``client-cpus`` cores, all busy when they are its ``client-threads``. Only
    then is DP-SGD's next noise drawn ahead on a worker thread (the same draws either
    way: a federated round with every core training was 8% slower with it)."""
    return cfg.resources.client_cpus > cfg.resources.client_threads


NOISE_STREAM = 0x401  # DP-SGD's noise: a generator of the client's own, apart from batches


def dp_round(cfg: RunConfig, context: Context, model: torch.nn.Module, x: torch.Tensor,
             y: torch.Tensor, num_clients: int, seed: int, device: torch.device,
             ids: torch.Tensor | None = None, canaries: CanaryHook | None = None,
             server_round: int | None = None, digest: str = "",
             public_records: int = 0) -> DPRound:
    """Train ``model`` privately for ``local-epochs`` unless that would exceed the budget.

    With audit ``canaries`` (rows with ``ids`` >= 0) the per-sample gradients are
    materialized (Opacus' hooks mode, whatever grad-sample-mode says) so that each
    canary row's gradient can be set before clipping and noise. A round this client
    already trained from the same inputs (``digest``, after a resumed crash) is
    recomputed without being accounted twice: its output is the one already sent.
    ``public_records`` is N under add/remove (:mod:`privacy.dp.public`; 0 is allowed only
    under replace-one, where the client's own n is public)."""
    t = cfg.training
    if cfg.privacy.dp_relation == "add-remove" and public_records < 1:
        raise LocalDPError("local DP under dp-relation = 'add-remove' needs a public record "
                           "count (dp-public-records) for DP-SGD's schedule: set it, or use "
                           "dp-relation = 'replace-one' to treat each client's n as public.")
    plan = schedule(cfg, public_records, len(y))
    ledger = load_ledger(context) or new_ledger(cfg, plan, num_clients)
    per_epoch = plan.steps_per_epoch
    planned = round_steps(t.local_epochs, per_epoch, t.local_steps)
    replay = server_round is not None and ledger.is_replay(server_round, digest)
    if not replay and ledger.would_exceed(planned):
        save_ledger(context, ledger)
        return DPRound(ledger, None, None)
    mode = ("hooks" if canaries is not None
            else resolve_mode(cfg.privacy.grad_sample_mode, model_name(cfg)))
    if mode == "bookkeeping":  # channels-last convolutions: Opacus' own modes misread them
        convolutions_channels_last(model, device)
    optimizer = client_optimizer(model, t, for_opacus=True)
    private = make_private(model, optimizer, make_loader(x, y, t.batch_size, seed, ids),
                           noise_multiplier=ledger.noise_multiplier,
                           max_grad_norm=cfg.privacy.max_grad_norm, grad_sample_mode=mode,
                           seed=seed, noise_seed=derive_seed(seed, NOISE_STREAM),
                           accountant=ledger.accountant,
                           secure=cfg.privacy.secure_rng, schedule=plan, device=device,
                           draw_ahead=spare_core(cfg))
    drift = abs(private.sample_rate - ledger.sample_rate)
    if private.steps_per_epoch != per_epoch or drift > 1e-12:
        raise RuntimeError(f"Opacus sampled {private.steps_per_epoch} batches at rate "
                           f"{private.sample_rate}, expected {per_epoch} at {ledger.sample_rate}")
    if not replay:  # the epsilon this round will report, computed while it trains
        ledger.epsilon_ahead(planned)
    result = train_epochs(private.model, private.loader, private.optimizer, t.local_epochs,
                          device, criterion=private.criterion, canaries=canaries,
                          max_steps=t.local_steps)
    taken = private.history()
    if [(s, q) for s, q, _ in taken] != [(ledger.noise_multiplier, ledger.sample_rate)] or \
            sum(n for _, _, n in taken) != planned:
        raise RuntimeError(f"Opacus accounted {taken}, expected {planned} steps at "
                           f"({ledger.noise_multiplier}, {ledger.sample_rate})")
    if not replay:
        ledger.record(planned, server_round, digest)
        # the next round's epsilon, if it trains as this one did: started now, it has a
        # whole round of the federation's time to finish (exact either way: a round that
        # trains otherwise computes its own); none after the run's last round
        if server_round is None or server_round < cfg.federation.num_server_rounds:
            ledger.epsilon_ahead(planned)
    save_ledger(context, ledger)
    return DPRound(ledger, result, private.module(), private.reusable)
