"""Phase 1 of ``anonymizer = "cvae-federated"``: clients train one CVAE together.

Each round the sampled clients train the CVAE on their own embeddings, starting from
the global decoder and their own (private, never shared) encoder, and send back only
the decoder; the server averages decoders with FedAvg. After ``cvae-rounds`` rounds the
final decoder is sent to every client, which samples its release from it (per class,
to its own class counts) and reports the release's privacy scores. Phase 2 is the
usual federated training of the head, on those synthetic embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from privacy.anonymize.cvae import CVAE
from strategies.aggregation import FlowerAggregation
from strategies.build import common_args
from strategies.grid import FederationGrid
from strategies.protocols.plain import PlainProtocol
from strategies.runner import RoundRunner
from tasks import messages
from tasks.config import RunConfig
from tasks.progress import track
from tasks.results.folder import RunFolder

from .console import say


def run_cvae_phase(grid: Grid, cfg: RunConfig, partition_of: Mapping[int, int], dim: int,
                   num_classes: int, run: RunFolder) -> dict[str, Any]:
    """Train the shared decoder, hand it to every client; return what clients reported."""
    a, fed = cfg.anonymization, cfg.federation
    torch.manual_seed(cfg.training.seed)
    decoder = CVAE(dim, num_classes, a.cvae_latent, a.cvae_hidden).decoder
    strategy = FedAvg(**{**common_args(fed, len(partition_of)), "fraction_evaluate": 0.0,
                         "min_evaluate_nodes": 0})
    grid = grid if isinstance(grid, FederationGrid) else FederationGrid(grid, partition_of)
    rounds = RoundRunner(PlainProtocol(grid, partition_of, cfg.training.seed, fed.round_timeout,
                                       action=messages.CVAE_FIT),
                         FlowerAggregation(strategy), {})
    say(f"phase 1: {a.cvae_rounds} rounds of federated CVAE training (only decoders are "
        "shared)")
    arrays = ArrayRecord(decoder.state_dict())
    for rnd in track(range(1, a.cvae_rounds + 1), "CVAE phase 1: rounds", eager=True):
        result = rounds.run_round(rnd, arrays)
        arrays = result.arrays or arrays
        log = result.log
        losses = [c["cvae-loss"] for c in log.clients if "cvae-loss" in c]
        loss = sum(losses) / len(losses) if losses else float("nan")
        run.append_jsonl("cvae.jsonl", {"round": rnd, "cvae-loss": loss,
                                        "clients": len(log.clients),
                                        "round-s": (log.train_done or 0.0) - log.started})
        say(f"  cvae round {rnd}/{a.cvae_rounds}: mean client loss {loss:.3f}")
    torch.save(arrays.to_torch_state_dict(), run.file("cvae_decoder.pt"))
    out = [Message(RecordDict({"arrays": arrays, "config": ConfigRecord()}),
                   message_type=messages.CVAE_RELEASE, dst_node_id=nid) for nid in partition_of]
    reports = []
    for reply in grid.send_and_receive(out, timeout=fed.round_timeout):
        if reply.has_error():
            raise RuntimeError(f"a client failed to sample its CVAE release: "
                               f"{reply.error.reason}")
        reports.append(dict(reply.content["metrics"]))
    say("phase 1 done: every client sampled its release from the shared decoder")
    return {"rounds": a.cvae_rounds,
            "clients": sorted(reports, key=lambda r: r.get("partition-id", -1))}
