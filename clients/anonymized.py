"""What a client trains on when it anonymizes its embeddings, and how private that is.

The client splits its embeddings into members (anonymized, released, trained on) and
a holdout (``privacy-holdout``: never released, only used to score the release),
runs the anonymizer once, and scores the release with
:mod:`privacy.analysis.release_metrics`. The release and its scores are cached (keyed
by the embeddings, the anonymizer's parameter dataclass, the seed, the holdout share
and the code that computes them), so every round and every Ray actor uses the same
release.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context

from privacy.analysis.release_metrics import evaluate
from privacy.anonymize import ANONYMIZERS, Release, anonymize
from tasks.cache import array_digest, cache_path, save_atomic
from tasks.config import AnonymizationConfig
from tasks.progress import Bar
from tasks.splits import Split

CODE = ["privacy.anonymize.registry", "privacy.anonymize.ksame", "privacy.anonymize.density",
        "privacy.anonymize.noise", "privacy.anonymize.transforms", "privacy.anonymize.cvae",
        "privacy.analysis.release_metrics", "privacy.analysis.distances",
        "clients.anonymized"]


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


def _path(a: AnonymizationConfig, x: np.ndarray, seed: int, extra: str = "") -> Path:
    parts = [a.anonymizer, a.params(), seed, a.privacy_holdout, array_digest(x), extra]
    return cache_path("releases", ".npz", parts, [*CODE, ANONYMIZERS.module(a.anonymizer)])


def _save(path: Path, release: Release, scores: dict) -> None:
    meta = json.dumps({"scores": scores, "info": release.info}, default=float).encode()
    save_atomic(path, lambda tmp: np.savez(tmp, x=release.x, y=release.y,
                                           meta=np.frombuffer(meta, dtype=np.uint8)))


def _load_cached(path: Path, shape: tuple[int, ...] | None = None) -> Released:
    with np.load(path) as f:
        meta = json.loads(f["meta"].tobytes().decode())
        x = f["x"] if shape is None else f["x"].reshape(-1, *shape)
        return Released(torch.from_numpy(x), torch.from_numpy(f["y"]), meta["scores"],
                        meta["info"])


def _scored(x: np.ndarray, members: np.ndarray, holdout: np.ndarray, release: Release,
            seed: int, path: Path) -> Released:
    scores = evaluate(x[members], release, x[holdout] if len(holdout) else None, seed)
    _save(path, release, scores)
    return Released(torch.from_numpy(release.x), torch.from_numpy(release.y.astype(np.int64)),
                    scores, release.info)


def released_data(a: AnonymizationConfig, split: Split, seed: int) -> Released:
    """Anonymize this client's embeddings once (cached) and score the release."""
    x, y = split.x.numpy(), split.y.numpy()
    path = _path(a, x, seed)
    shape = x.shape[1:]
    if path.is_file():
        return _load_cached(path, shape)
    members, holdout = holdout_split(len(y), a.privacy_holdout, seed)
    x = x.reshape(len(x), -1)  # raw images are anonymized and scored as flat vectors
    if a.anonymizer == "cvae-online":  # the model is kept: it is sampled again every epoch
        from privacy.anonymize.cvae import sample_release

        release = sample_release(_client_cvae(a, split, seed), y[members], seed + 1)
    else:
        release = _anonymized(a, x[members], y[members], seed, split.num_classes)
    released = _scored(x, members, holdout, release, seed, path)
    released.x = released.x.reshape(len(released.x), *shape)
    return released


def _anonymized(a: AnonymizationConfig, x: np.ndarray, y: np.ndarray, seed: int,
                num_classes: int) -> Release:
    """The anonymizer's release of (x, y); training a CVAE shows a progress bar."""
    if a.anonymizer != "cvae":
        return anonymize(a.anonymizer, x, y, a.params(), seed, num_classes)
    from privacy.anonymize.cvae import EPOCH_DONE

    with Bar(f"CVAE training, {len(y):,} rows (epochs; early stopping)", a.cvae_epochs) as bar:
        token = EPOCH_DONE.set(bar.advance)
        try:
            return anonymize(a.anonymizer, x, y, a.params(), seed, num_classes)
        finally:
            EPOCH_DONE.reset(token)


def _client_cvae(a: AnonymizationConfig, split: Split, seed: int):
    """This client's CVAE, trained as ``cvae`` trains it (same seed, same data), cached."""
    from privacy.anonymize.cvae import CVAE, TrainedCVAE, fit_scaler, train_cvae

    x, y = split.x.numpy(), split.y.numpy()
    members, _ = holdout_split(len(y), a.privacy_holdout, seed)
    scaler = fit_scaler(x[members])
    path = _path(a, x, seed, "model")
    if path.is_file():
        model = CVAE(x.shape[1], split.num_classes, a.cvae_latent, a.cvae_hidden)
        with np.load(path) as f:
            model.load_state_dict({k: torch.from_numpy(f[k]) for k in f.files})
        return TrainedCVAE(model.eval(), scaler, {})
    with Bar(f"CVAE training, {len(members):,} rows (epochs; early stopping)",
             a.cvae_epochs) as bar:
        trained = train_cvae(x[members], y[members], split.num_classes, a.params(), seed,
                             scaler=scaler, on_epoch=bar.advance)
    state = {k: v.numpy() for k, v in trained.model.state_dict().items()}
    save_atomic(path, lambda tmp: np.savez(tmp, **state))
    return trained


def online_sample(a: AnonymizationConfig, split: Split, seed: int, server_round: int,
                  epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cvae-online``: a fresh synthetic dataset for one local epoch (Di Salvo et al. 2024,
    online variant): as many items as the client's members, labels drawn from its class
    distribution, each sampled from its CVAE; seeded by (client, round, epoch)."""
    trained = _client_cvae(a, split, seed)
    y = split.y.numpy()
    members, _ = holdout_split(len(y), a.privacy_holdout, seed)
    counts = np.bincount(y[members], minlength=split.num_classes)
    step = int(np.random.SeedSequence([seed, server_round, epoch]).generate_state(1)[0])
    rng = np.random.default_rng(step)
    labels = np.sort(rng.choice(split.num_classes, size=len(members), p=counts / counts.sum()))
    gen = torch.Generator().manual_seed(step)
    x = trained.scaler.inverse_transform(
        trained.model.sample(torch.from_numpy(labels), gen).numpy())
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(labels.astype(np.int64))


# --------------------------------------------------------------------------- federated CVAE

ENCODER_KEY = "cvae-encoder"  # this client's encoder: kept in Context.state, never sent
DECODER_KEY = "cvae-decoder"  # the final shared decoder, once phase 1 is over


def federated_cvae_round(a: AnonymizationConfig, context: Context, split: Split, seed: int,
                         decoder: ArrayRecord) -> tuple[ArrayRecord, dict[str, Any]]:
    """Phase 1: train the CVAE locally from the global decoder; return only the decoder."""
    # the CVAE module loads scikit-learn's scaler: only runs with a CVAE import it
    from privacy.anonymize.cvae import fit_scaler, train_cvae

    x, y = split.x.numpy(), split.y.numpy()
    members, _ = holdout_split(len(y), a.privacy_holdout, seed)
    encoder = (context.state.array_records[ENCODER_KEY].to_torch_state_dict()
               if ENCODER_KEY in context.state.array_records else None)
    with Bar(f"CVAE local training, {len(members):,} rows (epochs)",
             a.cvae_local_epochs) as bar:
        trained = train_cvae(x[members], y[members], split.num_classes, a.params(), seed,
                             epochs=a.cvae_local_epochs,
                             decoder_state=decoder.to_torch_state_dict(), encoder_state=encoder,
                             scaler=fit_scaler(x[members]), on_epoch=bar.advance)
    state = trained.model.state_dict()
    context.state.array_records[ENCODER_KEY] = ArrayRecord(
        {k: v for k, v in state.items() if not k.startswith("decoder.")})
    return (ArrayRecord(trained.model.decoder.state_dict()),
            {"num-examples": len(members), "cvae-loss": trained.info["train-loss"]})


def federated_cvae_release(a: AnonymizationConfig, context: Context, split: Split,
                           seed: int, decoder: ArrayRecord | None = None) -> Released:
    """Sample this client's release from the shared decoder (cached) and score it."""
    from privacy.anonymize.cvae import CVAE, TrainedCVAE, fit_scaler, sample_release  # as above

    if decoder is not None:
        context.state.array_records[DECODER_KEY] = decoder
    if DECODER_KEY not in context.state.array_records:
        raise RuntimeError("this client has no shared CVAE decoder: the federated CVAE phase "
                           "did not reach it")
    decoder_state = context.state.array_records[DECODER_KEY].to_torch_state_dict()
    x, y = split.x.numpy(), split.y.numpy()
    digest = array_digest(np.concatenate([v.numpy().ravel() for v in decoder_state.values()]))
    path = _path(a, x, seed, digest)
    if path.is_file():
        return _load_cached(path)
    members, holdout = holdout_split(len(y), a.privacy_holdout, seed)
    model = CVAE(x.shape[1], split.num_classes, a.cvae_latent, a.cvae_hidden)
    model.decoder.load_state_dict(decoder_state)
    trained = TrainedCVAE(model.eval(), fit_scaler(x[members]), {"federated": True})
    return _scored(x, members, holdout, sample_release(trained, y[members], seed + 1), seed,
                   path)
