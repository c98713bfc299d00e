"""What a client trains on when it anonymizes its embeddings, and how private that is.

The client splits its embeddings into members (anonymized, released, trained on) and
a holdout (``privacy-holdout``: never released, only used to score the release),
runs the anonymizer once, and scores the release with :mod:`privacy.metrics`. The
release and its scores are cached on disk (keyed by the embeddings, the anonymizer's
parameters and the seed), so every round and every Ray actor uses the same release.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context

from privacy.anonymizers import Release, anonymize
from privacy.metrics import evaluate
from tasks.datasets import cache_dir
from tasks.splits import Split

# The run-config keys each anonymizer reads (its cache key).
PARAMS = {
    "identity": (), "none": (), "permutation": (),
    "ksame": ("k", "ksame-classwise"),
    "density": ("dbscan-eps", "dbscan-min-samples", "density-outliers", "density-classwise",
                "density-noise"),
    "gaussian": ("noise-epsilon", "noise-delta", "noise-clip"),
    "laplace": ("noise-epsilon", "noise-clip"),
    "random": ("noise-scale",), "mask": ("mask-fraction",), "pca": ("pca-components",),
    "hashing": ("hash-salt",),
    "cvae": ("cvae-latent", "cvae-hidden", "cvae-beta", "cvae-epochs", "cvae-patience",
             "cvae-lr", "cvae-batch-size", "cvae-epsilon"),
}


@dataclass
class Released:
    """Tensors to train on plus the release's privacy scores and mechanism details."""

    x: torch.Tensor
    y: torch.Tensor
    scores: dict[str, Any]
    info: dict[str, Any]

    def metrics(self) -> dict[str, float]:
        """Scores as flat numeric metrics for a Flower MetricRecord (prefix ``anon-``)."""
        out = {f"anon-{k}": float(v) for k, v in self.scores.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for key in ("clusters", "groups", "epsilon", "sigma", "outliers"):
            if isinstance(self.info.get(key), (int, float)):
                out[f"anon-info-{key}"] = float(self.info[key])
        return out


def holdout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Member and holdout row indices of a client's data (seeded)."""
    order = np.random.default_rng(seed).permutation(n)
    cut = int(round(fraction * n))
    if fraction > 0 and n - cut < 2:
        cut = max(0, n - 2)
    return np.sort(order[cut:]), np.sort(order[:cut])


def _key(cfg: Mapping[str, Any], x: np.ndarray, seed: int) -> str:
    name = str(cfg["anonymizer"])
    params = {k: cfg[k] for k in PARAMS.get(name, ())}
    h = hashlib.sha256(np.ascontiguousarray(x).tobytes())
    h.update(json.dumps([name, params, seed, cfg["privacy-holdout"]], sort_keys=True).encode())
    return h.hexdigest()[:32]


def _save(path, release: Release, scores: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
        np.savez(tmp, x=release.x, y=release.y,
                 meta=np.frombuffer(json.dumps({"scores": scores, "info": release.info},
                                               default=float).encode(), dtype=np.uint8))
        os.replace(tmp, path)
    except OSError:
        pass


def _load_cached(path) -> Released:
    with np.load(path) as f:
        meta = json.loads(f["meta"].tobytes().decode())
        return Released(torch.from_numpy(f["x"]), torch.from_numpy(f["y"]), meta["scores"],
                        meta["info"])


def released_data(cfg: Mapping[str, Any], split: Split, seed: int) -> Released:
    """Anonymize this client's embeddings once (cached) and score the release."""
    x = split.x.numpy()
    y = split.y.numpy()
    key = _key(cfg, x, seed)
    path = cache_dir() / "releases" / f"{key}.npz"
    if path.is_file():
        return _load_cached(path)
    members, holdout = holdout_split(len(y), float(cfg["privacy-holdout"]), seed)
    params = {**cfg, "num-classes": split.num_classes}
    release = anonymize(str(cfg["anonymizer"]), x[members], y[members], params, seed)
    scores = evaluate(x[members], release, x[holdout] if len(holdout) else None, seed)
    _save(path, release, scores)
    return Released(torch.from_numpy(release.x), torch.from_numpy(release.y.astype(np.int64)),
                    scores, release.info)


# --------------------------------------------------------------------------- federated CVAE

ENCODER_KEY = "cvae-encoder"  # this client's encoder: kept in Context.state, never sent
DECODER_KEY = "cvae-decoder"  # the final shared decoder, once phase 1 is over


def federated_cvae_round(cfg: Mapping[str, Any], context: Context, split: Split, seed: int,
                         decoder: ArrayRecord) -> tuple[ArrayRecord, dict[str, Any]]:
    """Phase 1: train the CVAE locally from the global decoder; return only the decoder."""
    from privacy.cvae import Scaler, train_cvae

    x, y = split.x.numpy(), split.y.numpy()
    members, _ = holdout_split(len(y), float(cfg["privacy-holdout"]), seed)
    encoder = (context.state.array_records[ENCODER_KEY].to_torch_state_dict()
               if ENCODER_KEY in context.state.array_records else None)
    trained = train_cvae(x[members], y[members], split.num_classes, cfg, seed,
                         epochs=int(cfg["cvae-local-epochs"]),
                         decoder_state=decoder.to_torch_state_dict(), encoder_state=encoder,
                         scaler=Scaler.fit(x[members]))
    state = trained.model.state_dict()
    context.state.array_records[ENCODER_KEY] = ArrayRecord(
        {k: v for k, v in state.items() if not k.startswith("decoder.")})
    return (ArrayRecord(trained.model.decoder.state_dict()),
            {"num-examples": len(members), "cvae-loss": trained.info["train-loss"]})


def federated_cvae_release(cfg: Mapping[str, Any], context: Context, split: Split,
                           seed: int, decoder: ArrayRecord | None = None) -> Released:
    """Sample this client's release from the shared decoder (cached) and score it."""
    from privacy.cvae import CVAE, Scaler, TrainedCVAE, sample_release

    if decoder is not None:
        context.state.array_records[DECODER_KEY] = decoder
    if DECODER_KEY not in context.state.array_records:
        raise RuntimeError("this client has no shared CVAE decoder: the federated CVAE phase "
                           "did not reach it")
    decoder_state = context.state.array_records[DECODER_KEY].to_torch_state_dict()
    x, y = split.x.numpy(), split.y.numpy()
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in decoder_state.values()))
    path = cache_dir() / "releases" / f"{_key(cfg, x, seed)}-{digest.hexdigest()[:16]}.npz"
    if path.is_file():
        return _load_cached(path)
    members, holdout = holdout_split(len(y), float(cfg["privacy-holdout"]), seed)
    model = CVAE(x.shape[1], split.num_classes, int(cfg["cvae-latent"]), int(cfg["cvae-hidden"]))
    model.decoder.load_state_dict(decoder_state)
    trained = TrainedCVAE(model.eval(), Scaler.fit(x[members]), {"federated": True})
    release = sample_release(trained, y[members], seed + 1)
    scores = evaluate(x[members], release, x[holdout] if len(holdout) else None, seed)
    _save(path, release, scores)
    return Released(torch.from_numpy(release.x), torch.from_numpy(release.y.astype(np.int64)),
                    scores, release.info)
