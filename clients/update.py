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

from privacy.anonymize import public_transform
from privacy.dp.dpfedavg import CLIP_KEY, UNCLIPPED_KEY, clip
from tasks.config import RunConfig, validate
from tasks.seeding import derive_seed
from tasks.splits import Split, client_split, model_for
from tasks.training import make_loader, resolve_device, sgd, train_epochs

from .anonymized import federated_cvae_release, holdout_split, released_data
from .local_dp import dp_round


@dataclass(frozen=True)
class Client:
    """What every handler starts from: the typed config, this node's partition and data."""

    cfg: RunConfig
    partition_id: int
    num_partitions: int
    data: Split

    @classmethod
    def of(cls, context: Context) -> Client:
        cfg = validate(context.run_config)
        torch.set_num_threads(cfg.resources.client_threads)
        pid = int(context.node_config["partition-id"])
        n = int(context.node_config["num-partitions"])
        return cls(cfg, pid, n, client_split(cfg, pid, n))

    @property
    def seed(self) -> int:
        """This client's seed for everything fixed for the run (its release, its holdout)."""
        return derive_seed(self.cfg.training.seed, self.partition_id)

    def model_keys(self) -> list[str]:
        """The global model's state-dict keys, in order (the legacy layout has no names)."""
        return list(model_for(self.cfg)[0].state_dict())

    def model(self, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        model, _ = model_for(self.cfg)
        model.load_state_dict(state)
        return model

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the model reads it (e.g. hashed embeddings, with the hashing anonymizer)."""
        a = self.cfg.anonymization
        transform = public_transform(a.anonymizer, a.params(), int(x.shape[1])) \
            if self.cfg.embeddings.enabled else None
        return x if transform is None else torch.from_numpy(transform(x.numpy()))


def training_data(client: Client, context: Context
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """What this client trains on: its partition, or (with an anonymizer) its release —
    or, with local DP and ``dp-train-data = original``, its original member records."""
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


def local_update(client: Client, context: Context, state: Mapping[str, torch.Tensor],
                 round_config: Mapping[str, Any]
                 ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """Train the global model received (``state``) on this client's data.

    Returns the new state dict (None when the client declines: its DP budget is spent)
    and the metrics to report (the disclosure mod decides which of them leave the
    client). With ``dp = "local"`` training is DP-SGD and the metrics carry the client's
    cumulative epsilon; with central DP and client-side clipping the update is clipped
    to the norm the server sent.
    """
    cfg, t = client.cfg, client.cfg.training
    server_round = int(round_config["server-round"])
    device = resolve_device(cfg.resources.device)
    seed = derive_seed(t.seed, server_round, client.partition_id)
    torch.manual_seed(seed)

    model = client.model(state)
    x, y, release_scores = training_data(client, context)
    metrics: dict[str, Any] = {"partition-id": client.partition_id, **release_scores,
                               "num-examples": len(y)}
    start = time.perf_counter()
    if cfg.privacy.dp == "local":
        outcome = dp_round(cfg, context, model, x, y, client.num_partitions, seed, device)
        metrics.update(outcome.metrics())
        if outcome.result is None:  # budget exhausted: no update, no privacy spent
            return None, metrics
        result, model = outcome.result, outcome.model
    else:
        loader = make_loader(x, y, t.batch_size, seed)
        optimizer = sgd(model, t.lr, t.momentum, t.weight_decay)
        result = train_epochs(model, loader, optimizer, t.local_epochs, device,
                              proximal_mu=float(round_config.get("proximal-mu", 0.0)))
    metrics.update({"train-loss": result.loss, "train-accuracy": result.accuracy,
                    "train-steps": result.steps,
                    "train-time-s": time.perf_counter() - start})
    new_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if cfg.privacy.dp == "central" and CLIP_KEY in round_config:  # client-side clipping
        norm = float(round_config[CLIP_KEY])
        names = list(new_state)
        old = [state[k].cpu().numpy() for k in names]
        update, before = clip([new_state[k].numpy() - o for k, o in zip(names, old,
                                                                       strict=True)], norm)
        metrics.update({"update-norm": before, UNCLIPPED_KEY: int(before <= norm)})
        new_state = {k: torch.from_numpy((o + u).astype(o.dtype))
                     for k, o, u in zip(names, old, update, strict=True)}
    return new_state, metrics


def as_update(new_state: Mapping[str, torch.Tensor] | None, old: list[np.ndarray]
              ) -> list[np.ndarray]:
    """New weights minus old, in ``old``'s order (zeros when the client declined)."""
    if new_state is None:
        return [np.zeros_like(a) for a in old]
    return [v.numpy() - a for v, a in zip(new_state.values(), old, strict=True)]
