"""One local round: what a client trains on, how (SGD, FedProx, DP-SGD), what it reports.

Every training message layout (Flower's Message API and the legacy FitIns of SecAgg+)
goes through :func:`local_update`; the ClientApp's handlers only unpack and pack.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Context

from privacy.attacks.canaries import GradientCanaries, canary_inclusion
from privacy.screening import screen
from tasks import model_pool
from tasks.allocator import keep_freed_memory
from tasks.config import RunConfig, validate
from tasks.messages import DATA_PATH
from tasks.seeding import canary_seeds, derive_seed
from tasks.splits import (
    Split,
    client_split,
    expected_partition_size,
    model_for,
    model_inputs,
    own_split,
    own_test_split,
)
from tasks.training import (
    client_optimizer,
    convolutions_channels_last,
    make_loader,
    resolve_device,
    train_epochs,
)

from . import together
from .anonymized import federated_cvae_release, holdout_split, online_sample, released_data
from .local_dp import LocalDPError, dp_round, release_digest
from .postprocess import update_steps


@dataclass(frozen=True)
class Client:
    """What every handler starts from: the typed config, this node's partition and data."""

    cfg: RunConfig
    partition_id: int
    num_partitions: int
    data: Split
    own_data: bool = False

    @classmethod
    def of(cls, context: Context) -> Client:
        cfg = validate(context.run_config)
        torch.set_num_threads(cfg.resources.client_threads)
        keep_freed_memory()  # once per process (a Ray actor's too)
        pid = int(context.node_config["partition-id"])
        n = int(context.node_config["num-partitions"])
        own = context.node_config.get(DATA_PATH)
        return cls(cfg, pid, n, own_split(cfg, str(own)) if own else client_split(cfg, pid, n),
                   bool(own))

    @property
    def seed(self) -> int:
        """This client's seed for everything fixed for the run (its release, its holdout)."""
        return derive_seed(self.cfg.training.seed, self.partition_id)

    def round_seed(self, server_round: int) -> int:
        """The public seed of this client's training in ``server_round`` (the run's)."""
        return derive_seed(self.cfg.training.seed, server_round, self.partition_id)

    def evaluation_data(self) -> Split:
        """What federated evaluation scores the global model on: a natural client's own
        held-out rows (LEAF's per-user test split), else its training rows."""
        own = None if self.own_data else own_test_split(self.cfg, self.partition_id,
                                                        self.num_partitions)
        return self.data if own is None else own

    def model_keys(self) -> list[str]:
        """The global model's state-dict keys, in order (the legacy layout has no names)."""
        return list(model_for(self.cfg)[0].state_dict())

    def model(self, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """The run's model holding ``state`` (from this process's idle models, if any)."""
        return model_pool.take(self.cfg, state)

    def public_records(self) -> int:
        """N, the public record count local DP-SGD's schedule comes from under add/remove
        (:mod:`privacy.dp.public`): ``dp-public-records``, or the run's expected partition
        size, a function of the configuration only (0 under replace-one: n is public)."""
        p = self.cfg.privacy
        if p.dp_relation != "add-remove":
            return 0
        if p.public_records:
            return p.public_records
        if self.own_data:
            raise LocalDPError(
                "this SuperNode serves its own data, so the run cannot derive a public record "
                "count for local DP-SGD's schedule from the dataset: set dp-public-records "
                "(the size every client's schedule assumes, fixed before the data), or "
                "dp-relation = 'replace-one' to treat each client's record count as public.")
        return expected_partition_size(self.cfg, self.num_partitions)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the model reads it (e.g. hashed embeddings, with the hashing anonymizer)."""
        return model_inputs(self.cfg, x)


def training_data(client: Client, context: Context
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """What this client trains on: its partition, or (with an anonymizer) its release —
    or, with local DP and ``dp-train-data = original``, its original member records —
    and its release's scores. An observed client trains on only the first rows
    (:func:`observed_rows`)."""
    x, y, scores = _own_rows(client, context)
    n = observed_rows(client.cfg, client.partition_id, client.num_partitions, len(y))
    return x[:n], y[:n], scores


def heldout_rows(client: Client, context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """An observed client's rows it never trains on: the membership attacks' non-members,
    from the same distribution as its members (the scoring side only)."""
    x, y, _ = _own_rows(client, context)
    n = observed_rows(client.cfg, client.partition_id, client.num_partitions, len(y))
    return x[n:], y[n:]


def observed_rows(cfg: RunConfig, partition_id: int, num_partitions: int, size: int) -> int:
    """How many of its ``size`` rows a client trains on: all of them, unless it is observed
    for the leakage study (with ``leakage-clients = 'aggregate'``, every client is) —
    then ``observed-examples`` of them, or all but the ``leakage-holdout`` share (kept
    back as non-members for membership inference)."""
    lk = cfg.leakage
    clients = lk.clients(num_partitions)  # None: the aggregate, so everyone is observed
    if not lk.enabled or (clients is not None and partition_id not in clients):
        return size
    if lk.observed_examples:
        return min(lk.observed_examples, size)
    return max(1, size - int(round(size * lk.leakage_holdout)))


def audit_canaries(cfg: RunConfig, partition_id: int, num_partitions: int, num_params: int
                   ) -> tuple[GradientCanaries, np.ndarray] | None:
    """The audit's canaries of an observed client and which of them it includes (each
    with probability 1/2: the client's secret, shared only with the scorer); None when
    the client is not audited."""
    lk = cfg.leakage
    if not (lk.enabled and lk.canaries and partition_id in (lk.clients(num_partitions) or [])):
        return None
    public, secret = canary_seeds(cfg.training.seed, partition_id)
    return (GradientCanaries.make(lk.canaries, num_params, cfg.privacy.max_grad_norm, public),
            canary_inclusion(lk.canaries, secret))


def with_canary_rows(x: torch.Tensor, y: torch.Tensor, included: np.ndarray
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The data plus one placeholder row per canary, and every row's id: -1 for a real
    record, k for included canary k, -2 for a canary left out. A left-out canary's row
    adds no loss and no gradient (under Poisson sampling it is as if absent), so the
    record count, and with it DP-SGD's sampling rate, steps and the disclosed number of
    examples, does not depend on the secret inclusion."""
    ids = torch.from_numpy(np.where(included, np.arange(len(included)), -2)).long()
    x = torch.cat([x, torch.zeros(len(ids), *x.shape[1:], dtype=x.dtype)])
    ids = torch.cat([torch.full((len(y),), -1, dtype=torch.long), ids])
    return x, torch.cat([y, torch.zeros(len(included), dtype=y.dtype)]), ids


def _own_rows(client: Client, context: Context
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    cfg, data = client.cfg, client.data
    a = cfg.anonymization
    if not a.enabled:
        return data.x, data.y, {}
    if a.anonymizer == "cvae-federated":  # sampled from the shared decoder (phase 1)
        released = federated_cvae_release(a, context, data, client.seed)
    else:
        released = released_data(a, data, client.seed)
    if cfg.privacy.dp == "local" and cfg.privacy.dp_train_data == "original":
        members, _ = holdout_split(len(data.y), a.privacy_holdout, client.seed)
        return client.features(data.x[members]), data.y[members], released.metrics()
    return released.x, released.y, released.metrics()


class OnlineSamples:
    """``cvae-online``'s training data: each pass over it (one local epoch) is a fresh
    sample of the client's CVAE, so one ``train_epochs`` call keeps FedProx's anchor."""

    def __init__(self, client: Client, server_round: int, seed: int) -> None:
        self.client, self.round, self.seed, self.epoch = client, server_round, seed, 0

    def __iter__(self):
        a, t = self.client.cfg.anonymization, self.client.cfg.training
        x, y = online_sample(a, self.client.data, self.client.seed, self.round, self.epoch)
        self.epoch += 1
        return iter(make_loader(x, y, t.batch_size, self.seed + self.epoch))


def local_update(client: Client, context: Context, state: Mapping[str, torch.Tensor],
                 round_config: Mapping[str, Any], secret_seed: int | None = None
                 ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """Train the global model received (``state``) on this client's data.

    Its randomness (batch order, dropout, DP noise) comes from (seed, round, partition),
    or from ``secret_seed`` when the client's contribution record gave one
    (:mod:`clients.contributions`: a server cannot replay what it cannot predict).

    Returns the new state dict (None when the client declines: its DP budget is spent,
    or its ``client-screen`` refuses the weights)
    and the metrics to report (the disclosure mod decides which of them leave the
    client). With ``dp = "local"`` training is DP-SGD and the metrics carry the client's
    cumulative epsilon; then the run's update steps apply (:mod:`clients.postprocess`:
    pruning, clipping to the norm the server sent).
    """
    cfg, t = client.cfg, client.cfg.training
    server_round = int(round_config["server-round"])
    device = resolve_device(cfg.resources.device)
    seed = client.round_seed(server_round) if secret_seed is None else secret_seed
    model = client.model(state)  # built or reused: seeded after, so the same either way
    # the CPU generator (torch.manual_seed would also queue a seed for every lazily
    # initialized device, formatting a stack trace each time: 1 ms a message)
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    if screen(cfg.privacy.client_screen, model) is not None:
        # the weights look like a trap: no training, no update (the screen's reason is a
        # function of the weights, which the server holds)
        return None, {"partition-id": client.partition_id, "screen-refused": 1}
    x, y, release_scores = training_data(client, context)
    audit = audit_canaries(cfg, client.partition_id, client.num_partitions,
                           sum(p.numel() for p in model.parameters()))
    ids, hook = None, None
    if audit is not None:
        x, y, ids = with_canary_rows(x, y, audit[1])
        hook = audit[0].inject
    metrics: dict[str, Any] = {"partition-id": client.partition_id, **release_scores,
                               "num-examples": len(y)}
    start = time.perf_counter()
    reusable = True  # whether the model goes back to the pool as built
    if cfg.privacy.dp == "local":
        public = client.public_records()
        outcome = dp_round(cfg, context, model, x, y, client.num_partitions, seed, device,
                           ids=ids, canaries=hook, server_round=server_round,
                           digest=release_digest(cfg, server_round, state, device),
                           public_records=public)
        if public:  # FedAvg's weight: the public size, not the private n
            metrics["num-examples"] = public
        metrics.update(outcome.metrics())
        if outcome.result is None:  # budget exhausted: no update, no privacy spent
            return None, metrics
        result, model, reusable = outcome.result, outcome.model, outcome.reusable
    elif (cohort := together.current()) is not None and cfg.resources.train_together:
        # the round's clients train as one batched program (tasks.cohort_training); the
        # config refuses what it does not do (FedProx, canaries, cvae-online, local DP)
        from tasks.cohort_training import CohortTraining

        result = cohort.join(model, x, y, seed, CohortTraining.of(t), device)
    else:
        loader = OnlineSamples(client, server_round, seed) \
            if cfg.anonymization.anonymizer == "cvae-online" else \
            make_loader(x, y, t.batch_size, seed, ids)
        optimizer = client_optimizer(convolutions_channels_last(model, device), t)
        result = train_epochs(model, loader, optimizer, t.local_epochs, device,
                              proximal_mu=float(round_config.get("proximal-mu", 0.0)),
                              canaries=hook, max_steps=t.local_steps)
    metrics.update({"train-loss": result.loss, "train-accuracy": result.accuracy,
                    "train-steps": result.steps,
                    "train-time-s": time.perf_counter() - start})
    # copies: the model goes back to the pool for the next message
    new_state = {k: v.detach().clone() if v.device.type == "cpu" else v.detach().cpu()
                 for k, v in model.state_dict().items()}
    if reusable:  # (Opacus' own modes leave their hooks on the model)
        model_pool.give(cfg, model)
    for step in update_steps(cfg, round_config):  # pruning, client-side clipping
        new_state = step.apply(state, new_state, metrics)
    return new_state, metrics


def as_update(new_state: Mapping[str, torch.Tensor] | None, old: list[np.ndarray]
              ) -> list[np.ndarray]:
    """New weights minus old, in ``old``'s order (zeros when the client declined)."""
    if new_state is None:
        return [np.zeros_like(a) for a in old]
    return [v.numpy() - a for v, a in zip(new_state.values(), old, strict=True)]
