"""The malicious server (``server = "malicious"``): trap weights in the observed rounds.

In every round listed in ``leakage-rounds`` the ServerApp sends the clients weights
chosen by an attack instead of the global model (:mod:`privacy.attacks.imprint`: the
binning trap of Fowl et al. 2022, built from the server's own data,
``reference-fraction``); what comes back is observed as usual, and the round's result is
then thrown away, so the federation goes on from the honest model and no accuracy of a
tampered model is reported as the federation's. The ledger marks the round
(``tampered``). Threat model: an active server, which chooses the weights it sends but
not the clients' code or architecture.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from privacy.attacks.imprint import trap_weights
from tasks.config import RunConfig
from tasks.splits import reference_split

from .task import ServerTask

ATTACK = "imprint"


class Tamper:
    """The weights sent in each observed round (a loop's ``tamper``)."""

    def __init__(self, cfg: RunConfig, task: ServerTask) -> None:
        aux = reference_split(cfg)
        if aux is None:  # refused by the config checks; kept for a direct caller
            raise ValueError("server = 'malicious' needs reference-fraction > 0")
        self.rounds = set(cfg.leakage.rounds(cfg.federation.num_server_rounds))
        self.model, self.aux = task.model, aux.x

    def __call__(self, rnd: int, arrays: ArrayRecord) -> tuple[ArrayRecord, str] | None:
        if rnd not in self.rounds:
            return None
        honest = {k: torch.as_tensor(v) for k, v in arrays.to_torch_state_dict().items()}
        trapped, _ = trap_weights(self.model, honest, self.aux)
        return ArrayRecord(trapped), ATTACK
