"""Keeping what the server observes of its clients, for the leakage attacks.

In the rounds and for the clients ``leakage-rounds`` and ``leakage-clients`` name, the
hook saves exactly what a real server holds (:class:`privacy.attacks.observation.
Observation`): the weights it sent, the weights that came back (the DP-SGD noise
included), the round's training configuration and what the client disclosed. Under
secure aggregation there is nothing per client: it saves the aggregate, labelled as
such. Other rounds cost nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord

from privacy.attacks.observation import LocalTraining, Observation
from strategies.rounds import RoundResult
from tasks.config import RunConfig
from tasks.results.ledger import RoundRecord

from .console import say

FOLDER = "observations"


def local_training(cfg: RunConfig) -> LocalTraining:
    """How every client trains in a round, as the server configures it."""
    t = cfg.training
    mu = cfg.federation.proximal_mu if cfg.federation.strategy == "fedprox" else 0.0
    return LocalTraining(t.lr, t.momentum, t.weight_decay, t.local_epochs, t.batch_size, mu)


def _numpy(arrays: ArrayRecord) -> dict[str, Any]:
    return {k: v.numpy() for k, v in arrays.to_torch_state_dict().items()}


class ObservationHook:
    """Saves observations of the configured rounds and clients into ``<run>/observations``."""

    def __init__(self, cfg: RunConfig, run_dir: Path, num_clients: int,
                 input_shape: tuple[int, ...], num_classes: int, mean: tuple[float, ...],
                 std: tuple[float, ...], kind: str) -> None:
        lk = cfg.leakage
        self.rounds = set(lk.rounds(cfg.federation.num_server_rounds))
        self.clients = lk.clients(num_clients)  # None: the aggregate
        self.folder = run_dir / FOLDER
        self.common = {"training": local_training(cfg), "input_shape": tuple(input_shape),
                       "num_classes": num_classes, "mean": tuple(mean), "std": tuple(std),
                       "kind": kind}

    def after_round(self, record: RoundRecord, arrays: ArrayRecord,
                    result: RoundResult) -> None:
        if (record.round not in self.rounds or result.sent is None or record.refused
                or not record.clients):
            return  # a refused round, or one no client trained in, made nothing to observe
        sent = _numpy(result.sent)
        released = _numpy(result.arrays if result.arrays is not None else arrays)
        saved = []
        if self.clients is None:
            # a malicious server reads what it held, before central DP's clip and noise
            held = (_numpy(result.collected.held(result.sent))
                    if record.tampered and result.collected is not None else released)
            Observation(record.round, None, sent, held, num_examples=None,
                        released=released, tampered=record.tampered,
                        **self.common).save(self.folder)
            saved.append("the aggregate")
        for reply in result.replies if self.clients is not None else []:
            if reply.partition_id in self.clients and reply.arrays is not None:
                n = reply.metrics.get("num-examples")
                Observation(record.round, reply.partition_id, sent, _numpy(reply.arrays),
                            num_examples=None if n is None else int(n),
                            disclosed=dict(reply.metrics), released=released,
                            tampered=record.tampered, **self.common).save(self.folder)
                saved.append(f"client {reply.partition_id}")
        if saved:
            say(f"  round {record.round}: observed {', '.join(saved)} (observations/)")

    def finish(self) -> None:
        return None
