"""The scoring side of the leakage study: what an observed client really trained on.

Only this module reads a client's real data, its held-back rows and its canaries; the
attacks (:mod:`privacy.attacks`) never see what it returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, RecordDict

from clients.update import Client, audit_canaries, heldout_rows, training_data
from privacy.attacks.canaries import GradientCanaries
from privacy.attacks.observation import Observation
from server.task import ServerTask
from tasks.config import ConfigError, RunConfig
from tasks.results.folder import read_run_info
from tasks.results.ledger import read_ledger
from tasks.seeding import derive_seed
from tasks.splits import client_split


@dataclass
class Truth:
    """The scoring side's ground truth for one observation (never passed to an attack)."""

    x: torch.Tensor  # the records the client trained on (the audit's canaries aside)
    y: torch.Tensor
    members: tuple[torch.Tensor, torch.Tensor]  # a sample of them
    nonmembers: tuple[torch.Tensor, torch.Tensor]  # held-out rows of the same distribution
    canaries: tuple[GradientCanaries, np.ndarray] | None  # the canaries, which were included



def _own_data_clients(run_dir: Path) -> set[int]:
    path = run_dir / "partitions.json"
    if not path.is_file():
        return set()
    clients = json.loads(path.read_text()).get("clients", [])
    return {int(c["partition-id"]) for c in clients if c.get("own-data")}


def truth_for(cfg: RunConfig, obs: Observation, task: ServerTask, run_dir: Path) -> Truth:
    """What the observed client really trained on (the scoring side only)."""
    info = read_run_info(run_dir)
    n = int(info.get("num-clients", cfg.federation.num_clients))
    if obs.client is None:  # the aggregate: the clients whose updates are in it
        record = {r.round: r for r in read_ledger(run_dir)}.get(obs.round)
        failed = {f.get("partition-id") for f in record.failures} if record else set()
        pids = ([p for p in record.sampled if p not in failed] if record
                else list(range(n)))
    else:
        pids = [obs.client]
    own = _own_data_clients(run_dir) & set(pids)
    if own:
        raise ConfigError(
            f"client(s) {', '.join(map(str, sorted(own)))} trained on their host's own data "
            "(data-path), which the scorer never sees: their leakage cannot be scored against "
            "ground truth. Run the leakage study on a shared dataset's partitions.")
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    rng = np.random.default_rng(derive_seed(cfg.training.seed, obs.round, 0x3E))
    xs, ys, members, nonmembers = [], [], [], []
    # as many members as non-members from each client (unless mia-nonmembers asks for
    # more), so that the two sets have the same mix of clients (and of their label
    # distributions): only membership tells them apart
    per_client = max(1, cfg.leakage.mia_candidates // len(pids))
    nonmember_share = max(1, (cfg.leakage.mia_nonmembers or cfg.leakage.mia_candidates)
                          // len(pids))
    for pid in pids:
        client = Client(cfg, pid, n, client_split(cfg, pid, n))
        x, y, _ = training_data(client, context)
        hx, hy = heldout_rows(client, context)
        xs.append(x)
        ys.append(y)
        k = min(per_client, len(y), len(hy))
        if cfg.leakage.mia_nonmembers:  # asked for: as many as the held-out rows allow
            j = min(nonmember_share, len(hy))
            k = min(per_client, len(y))
        else:  # as many members as non-members from each client
            j = k
        m, h = rng.choice(len(y), k, replace=False), rng.choice(len(hy), j, replace=False)
        members.append((x[m], y[m]))
        nonmembers.append((hx[h], hy[h]))
    canaries = None if obs.client is None else audit_canaries(
        cfg, obs.client, n, sum(p.numel() for p in task.model.parameters()))

    def cat(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])

    return Truth(torch.cat(xs), torch.cat(ys), cat(members), cat(nonmembers), canaries)
