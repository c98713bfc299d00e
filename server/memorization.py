"""The Secret Sharer's exposure of the run's canaries in the global model, every round.

Exposure (Carlini et al., USENIX Security 2019) is log2 of the candidate space less log2
of the canary's rank among all candidate secrets by the model's log-perplexity: about 1
bit for a secret ranked at random (rank |R|/2), log2 |R| for one the model ranks first.
Thakkar et al. (2020) measured it on federated next-word models, where user-level DP and
clipping cut it. The server
knows the canaries (they come from the run's seed, :mod:`tasks.text_canaries`): this is
the experimenter's measurement of memorization, not an attack on a secret it lacks.

Each round appends one line per canary to ``exposure.jsonl`` and keeps the candidates'
log-perplexities in ``exposure/round-NNNN.npz``, from which the rank can be recomputed
independently; ``plots/exposure.png`` draws exposure against round per repetition count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn

from privacy.attacks.exposure import measure
from tasks.config import RunConfig
from tasks.files import append_line, write_atomic
from tasks.results.exposure import LEDGER, plot_exposure, read_exposure
from tasks.results.ledger import RoundRecord
from tasks.seeding import derive_seed
from tasks.text_canaries import SECRET_STREAM, Planted, planted

EXACT_UP_TO = 10**4  # candidate spaces ranked exhaustively; larger ones extrapolated
# kept in exposure/round-NNNN.npz rather than in the ledger's lines
BULKY = ("sample_secrets", "sample_log_perplexity", "candidates_log_perplexity")


class ExposureMeter:
    """A round hook: each planted canary's exposure in the round's global model."""

    def __init__(self, cfg: RunConfig, run_dir: Path, model: nn.Module, title: str,
                 device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.model = model
        self.title = title
        self.device = device or torch.device("cpu")
        self.plants: list[Planted] = planted(cfg)

    def after_round(self, record: RoundRecord, arrays: ArrayRecord, result: Any) -> None:
        self.model.load_state_dict(arrays.to_torch_state_dict())
        mem = self.cfg.memorization
        seed = derive_seed(self.cfg.training.seed, SECRET_STREAM, record.round)
        found = measure(self.model, [p.canary for p in self.plants],
                        samples=mem.secret_samples, exact_up_to=EXACT_UP_TO, seed=seed)
        arrays_out: dict[str, np.ndarray] = {}
        for i, (plant, row) in enumerate(zip(self.plants, found, strict=True)):
            arrays_out[f"canary{i}-sample"] = np.asarray(row["sample_log_perplexity"])
            arrays_out[f"canary{i}-sample-secrets"] = np.asarray(row["sample_secrets"])
            if "candidates_log_perplexity" in row:
                arrays_out[f"canary{i}-all"] = np.asarray(row["candidates_log_perplexity"])
            append_line(self.run_dir / LEDGER, json.dumps({
                "round": record.round, "canary": i, "repetitions": plant.repetitions,
                "holders": list(plant.holders),
                **{k.replace("_", "-"): v for k, v in row.items() if k not in BULKY}}))
        out = self.run_dir / "exposure" / f"round-{record.round:04d}.npz"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, lambda f: np.savez(f, **arrays_out))

    def finish(self) -> None:
        rows = read_exposure(self.run_dir)
        if rows:
            plot_exposure(self.run_dir / "plots" / "exposure.png", rows,
                          f"{self.title}: canary exposure", float(rows[0]["space"]))
