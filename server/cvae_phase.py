"""Phase 1 of ``anonymizer = "cvae-federated"``: clients train one CVAE together.

Each round the sampled clients train the CVAE on their own embeddings, starting from
the global decoder and their own (private, never shared) encoder, and send back only
the decoder; the server averages decoders with FedAvg. After ``cvae-rounds`` rounds the
final decoder is sent to every client, which samples its release from it (per class,
to its own class counts) and reports the release's privacy scores. Phase 2 is the
usual federated training of the head, on those synthetic embeddings.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from privacy.cvae import CVAE
from strategies import Observed
from strategies.registry import weighted_metrics

from .console import say
from .results import RunFolder


def run_cvae_phase(grid: Grid, cfg: Mapping[str, Any], partition_of: Mapping[int, int],
                   dim: int, num_classes: int, run: RunFolder) -> dict[str, Any]:
    """Train the shared decoder, hand it to every client; return what clients reported."""
    torch.manual_seed(int(cfg["seed"]))
    decoder = CVAE(dim, num_classes, int(cfg["cvae-latent"]), int(cfg["cvae-hidden"])).decoder
    n = len(partition_of)
    strategy = Observed(FedAvg(fraction_train=float(cfg["fraction-train"]), fraction_evaluate=0.0,
                               min_train_nodes=min(int(cfg["min-train-clients"]), n),
                               min_evaluate_nodes=0, min_available_nodes=n,
                               train_metrics_aggr_fn=weighted_metrics),
                        int(cfg["seed"]), partition_of)
    rounds = int(cfg["cvae-rounds"])
    say(f"phase 1: {rounds} rounds of federated CVAE training (only decoders are shared)")

    def progress(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:
            return None
        log = strategy.current
        losses = [c["cvae-loss"] for c in log.clients if "cvae-loss" in c]
        loss = sum(losses) / len(losses) if losses else float("nan")
        run.append_named("cvae.jsonl", {"round": server_round, "cvae-loss": loss,
                                        "clients": len(log.clients),
                                        "round-s": time.perf_counter() - log.started})
        say(f"  cvae round {server_round}/{rounds}: mean client loss {loss:.3f}")
        return MetricRecord({"cvae-loss": loss})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(decoder.state_dict()),
                            num_rounds=rounds, timeout=float(cfg["round-timeout"]),
                            train_config=ConfigRecord({"phase": "cvae"}),
                            evaluate_fn=progress)
    torch.save(result.arrays.to_torch_state_dict(), run.file("cvae_decoder.pt"))
    messages = [Message(RecordDict({"arrays": result.arrays,
                                    "config": ConfigRecord({"phase": "cvae-final"})}),
                        message_type=MessageType.QUERY, dst_node_id=nid)
                for nid in partition_of]
    reports = []
    for reply in grid.send_and_receive(messages, timeout=float(cfg["round-timeout"])):
        if reply.has_error():
            raise RuntimeError(f"a client failed to sample its CVAE release: "
                               f"{reply.error.reason}")
        reports.append(dict(reply.content["metrics"]))
    say("phase 1 done: every client sampled its release from the shared decoder")
    return {"rounds": rounds, "clients": sorted(reports, key=lambda r: r["partition-id"])}
