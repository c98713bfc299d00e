"""The malicious server (``server = "malicious"``): trap weights in the observed rounds.

In every round listed in ``leakage-rounds`` the ServerApp sends the clients weights
chosen by an attack instead of the global model (:mod:`privacy.attacks.imprint`: the
binning trap of Fowl et al. 2022, built from the server's own data,
``reference-fraction``; behind a CNN's convolutions, with conv weights that make the
trunk's features invertible: :func:`privacy.attacks.feature_inversion.invertible_trunk`).
What comes back is observed as usual, and the round's result is then thrown away, so the
federation goes on from the honest model and no accuracy of a tampered model is reported
as the federation's. The ledger marks the round (``tampered``). Threat model: an active
server, which chooses the weights it sends but not the clients' code or architecture.
It also knows the round's aggregation protocol (it runs it), and scales the trap so that
a client's update fills what that protocol carries: for SecAgg+, half the clipping range
after the client's weight scaling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord

from privacy.attacks.feature_inversion import invertible_trunk
from privacy.attacks.imprint import calibrate_gain, trap_layers, trap_weights, with_gain
from tasks.config import RunConfig
from tasks.splits import reference_split

from .observe import local_training
from .task import ServerTask

ATTACK = "imprint"
PROBE = 256  # the server's records that set the invertible trunk's biases


class Tamper:
    """The weights sent in each observed round (a loop's ``tamper``)."""

    def __init__(self, cfg: RunConfig, task: ServerTask,
                 protocol: Mapping[str, Any] | None = None) -> None:
        aux = reference_split(cfg)
        if aux is None:  # refused by the config checks; kept for a direct caller
            raise ValueError("server = 'malicious' needs reference-fraction > 0")
        self.rounds = set(cfg.leakage.rounds(cfg.federation.num_server_rounds))
        self.model, self.aux = task.model, aux
        self.training = local_training(cfg)
        # the records a client trains on in an observed round, as the server configured it
        self.records = cfg.leakage.observed_examples or cfg.training.batch_size
        self.limit = carried(protocol or {}, cfg.leakage.observed_examples)
        self.seed = cfg.training.seed
        self.disguise = (cfg.training.seed if cfg.leakage.server_trap == "binning-disguised"
                         else None)

    def __call__(self, rnd: int, arrays: ArrayRecord) -> tuple[ArrayRecord, str] | None:
        if rnd not in self.rounds:
            return None
        honest = {k: torch.as_tensor(v) for k, v in arrays.to_torch_state_dict().items()}
        if not trap_layers(self.model).raw:  # behind convolutions: make them invertible
            honest = invertible_trunk(self.model, honest, probe=self.aux.x[:PROBE],
                                      seed=self.seed)
        # built once at gain 1 (the disguise leaves every unit's records, so the gradient,
        # as it was), then scaled to what the protocol carries
        plain, trap = trap_weights(self.model, honest, self.aux.x, disguise=self.disguise)
        n = min(self.records, len(self.aux.x))
        gain = calibrate_gain(self.model, plain, trap, self.aux.x[:n], self.aux.y[:n],
                              self.training, self.limit)
        return ArrayRecord(with_gain(plain, trap, gain)), ATTACK


def carried(protocol: Mapping[str, Any], records: int) -> float:
    """The largest update coordinate the server wants from one client: half of SecAgg+'s
    clipping range once the client scales its update by records / max-weight (the server
    chose both; without ``observed-examples`` it assumes the largest weight); 1 otherwise
    (CKKS and plain updates carry it with room to spare)."""
    if protocol.get("protocol") != "SecAgg+":
        return 1.0
    weight = float(protocol["max-weight"])
    ratio = min(records, weight) / weight if records else 1.0
    return 0.5 * float(protocol["clipping-range"]) / ratio
