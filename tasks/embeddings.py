"""Frozen feature extractors and cached embeddings.

With ``features = "embeddings"`` clients never train on pixels: a frozen backbone
turns each image into a vector, clients anonymize those vectors, and the federation
trains a small head on what they release. The backbone is either

- a torchvision ResNet-18 with a weights file the user names (``backbone-weights``,
  e.g. ImageNet weights; 512-d features from the global pool), or
- the offline default: a CNN fedpriv trains itself on data no client holds, either a
  stratified ``public-fraction`` of the training set that is then withheld from the
  clients (``backbone-data = "public-split"``) or another dataset's training set
  (``backbone-data = "fashion-mnist"``, say). The run records which.

Backbones are cached by everything that determines them; embeddings are cached per
backbone, dataset and index set (one file per client partition, one for the test
set), so a simulated client computes its embeddings once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .cache import array_digest, cache_path, save_atomic
from .config import DataConfig, EmbeddingsConfig
from .datasets import DatasetBundle, load_dataset, public_mask
from .errors import ConfigError
from .progress import Bar
from .registry import BACKBONES
from .training import evaluate, make_loader, sgd, train_epochs

CODE = ["tasks.embeddings", "tasks.models", "tasks.training", "tasks.datasets"]


@dataclass(frozen=True)
class BackboneSpec:
    """Everything that determines a backbone (and so its cache key)."""

    dataset: tuple  # (name, data-dir, download) of the dataset being embedded
    arch: str
    dim: int
    data: str  # "public-split", another dataset's name, or "weights"
    public_fraction: float
    epochs: int
    weights: str  # path of a weights file, or ""
    trained_on: str = ""  # fingerprint of the images the backbone learns from

    def key_parts(self) -> list:
        """What the backbone's content depends on (its cache key, with the code version)."""
        extra = _file_digest(self.weights) if self.weights else ""
        return [*self.dataset[:2], self.arch, self.dim, self.data, self.public_fraction,
                self.epochs, extra, self.trained_on]


def _file_digest(path: str) -> str:
    st = os.stat(path)
    return _digest(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    """SHA-256 of a file, computed once per process for each (path, mtime, size)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fingerprint(data: DatasetBundle) -> str:
    """Which training set was actually loaded: e.g. the embedded MNIST subset or the full one."""
    labels = hashlib.sha256(np.ascontiguousarray(data.y_train).tobytes()).hexdigest()[:16]
    return f"{data.source}|{len(data.y_train)}|{labels}"


def backbone_spec(emb: EmbeddingsConfig, data: DataConfig) -> BackboneSpec:
    weights = emb.backbone_weights
    arch = emb.backbone
    dataset = (data.dataset, data.data_dir, data.download)
    raw = load_dataset(*dataset)
    dataset = (raw.name, *dataset[1:])
    if arch == "auto":
        arch = "resnet18" if weights or raw.input_shape[-1] >= 32 else "cnn"
    if raw.kind != "image":
        raise ConfigError(f"features = 'embeddings' needs an image dataset; {raw.name} is "
                          "already tabular (use features = 'raw').")
    if weights:
        path = Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"backbone-weights {weights!r} does not exist. Name a torchvision "
                              "ResNet-18 state-dict file (e.g. resnet18-f37072fd.pth), or leave "
                              "it empty to train a backbone on public data.")
        if arch != "resnet18":
            raise ConfigError(f"backbone-weights is read as a torchvision ResNet-18; backbone = "
                              f"{arch!r} cannot load it. Use backbone = 'resnet18' or 'auto'.")
        return BackboneSpec(dataset, arch, 512, "weights", 0.0, 0, str(path.resolve()))
    source = emb.backbone_data
    learns_from = raw if source == "public-split" else load_dataset(source, *dataset[1:])
    return BackboneSpec(dataset, arch, emb.embedding_dim, source, emb.public_fraction,
                        emb.backbone_epochs, "", _fingerprint(learns_from))


# --------------------------------------------------------------------------- backbones


class EmbeddingNet(nn.Module):
    """A convolutional trunk, an embedding layer (the features) and a classifier for training."""

    def __init__(self, arch: str, in_shape: tuple[int, ...], dim: int, num_classes: int):
        super().__init__()
        trunk = BACKBONES.load(arch)(in_shape, num_classes)
        with torch.no_grad():
            flat = trunk(torch.zeros(2, *in_shape)).flatten(1).shape[1]
        self.trunk = trunk
        self.embed = nn.Sequential(nn.Flatten(), nn.Linear(flat, dim), nn.ReLU())
        self.head = nn.Linear(dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(self.trunk(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class TorchvisionResNet18(nn.Module):
    """torchvision's ImageNet ResNet-18 as a frozen 512-d feature extractor."""

    MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

    def __init__(self, weights: str, data: DatasetBundle):
        super().__init__()
        from torchvision.models import resnet18  # the ImageNet architecture, not tasks.models'

        self.net = resnet18()
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated, not a torch file, or pickled code
            raise ConfigError(
                f"backbone-weights {weights!r} cannot be read as a PyTorch state dict "
                f"(torch.load raised {type(exc).__name__}: the file is truncated, not one "
                "torch.save wrote, or holds objects other than tensors). Give a "
                "torchvision ResNet-18 weights file such as resnet18-f37072fd.pth, saved "
                "with torch.save(model.state_dict(), path).") from None
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        try:
            self.net.load_state_dict(state)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"backbone-weights {weights!r} does not match torchvision's "
                              f"ResNet-18: {str(exc)[:400]}") from None
        self.net.fc = nn.Identity()
        self.data_mean = torch.tensor(data.mean).view(1, -1, 1, 1)
        self.data_std = torch.tensor(data.std).view(1, -1, 1, 1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.data_std + self.data_mean  # back to [0, 1] pixels
        if x.shape[1] == 1:
            x = x.repeat(1, 3, 1, 1)
        mean = torch.tensor(self.MEAN).view(1, 3, 1, 1)
        std = torch.tensor(self.STD).view(1, 3, 1, 1)
        return self.net((x - mean) / std)


def _progress(text: str) -> None:
    print(f"[fedpriv] {text}", file=sys.stderr, flush=True)


def _ticking(batches: Iterable[Any], bar: Bar) -> Iterator[Any]:
    """``batches``, advancing ``bar`` as each one is trained on."""
    for batch in batches:
        yield batch
        bar.advance()


def _train_backbone(spec: BackboneSpec, raw: DatasetBundle) -> tuple[nn.Module, dict]:
    """Train an EmbeddingNet on data no client holds; return it with a description."""
    if spec.data == "public-split":
        if spec.public_fraction <= 0:
            raise ConfigError("backbone-data = 'public-split' needs public-fraction > 0 (the "
                              "share of the training set no client gets).")
        mask = public_mask(raw.y_train, spec.public_fraction)
        pub = replace(raw, x_train=raw.x_train[mask], y_train=raw.y_train[mask])
        where = f"the public {spec.public_fraction:.0%} split of {raw.name} ({mask.sum():,} images)"
    else:
        pub = load_dataset(spec.data, *spec.dataset[1:])
        if pub.input_shape != raw.input_shape:
            raise ConfigError(f"backbone-data = {spec.data!r} has inputs {pub.input_shape}, but "
                              f"{raw.name} has {raw.input_shape}; pick a dataset of the same "
                              "shape or 'public-split'.")
        where = f"{pub.name}'s training set ({len(pub.y_train):,} images), another dataset"
    torch.manual_seed(0)
    net = EmbeddingNet(spec.arch, raw.input_shape, spec.dim, pub.num_classes)
    x, y = pub.to_tensor(pub.x_train), torch.from_numpy(pub.y_train)
    opt = sgd(net, 0.05, 0.9)
    batches = -(-len(y) // 128)
    with Bar(f"backbone {spec.arch} training, {spec.epochs} epoch(s) (batches)",
             spec.epochs * batches, eager=True) as bar:
        for epoch in range(spec.epochs):
            loader = make_loader(x, y, 128, epoch)
            res = train_epochs(net, _ticking(loader, bar), opt, 1, torch.device("cpu"))
            bar.advance(0, description=f"backbone {spec.arch} training, epoch {epoch + 1} of "
                                       f"{spec.epochs} done, train accuracy {res.accuracy:.3f}")
    if spec.epochs:
        _progress(f"backbone {spec.arch} trained on {where}: {spec.epochs} epoch(s), train "
                  f"accuracy {res.accuracy:.3f}")
    net.eval()
    info = {"backbone": spec.arch, "embedding-dim": spec.dim, "trained-on": where,
            "public-train-accuracy": res.accuracy if spec.epochs else None}
    if pub.name == raw.name:
        _, acc = evaluate(net, raw.to_tensor(raw.x_test), torch.from_numpy(raw.y_test), 512,
                          torch.device("cpu"))
        info["public-model-test-accuracy"] = acc
    return net, info


def _cache_path(spec: BackboneSpec) -> Path:
    return cache_path("backbones", ".pt", spec.key_parts(), CODE)


def _weights_info(spec: BackboneSpec) -> dict:
    return {"backbone": "torchvision resnet18", "embedding-dim": 512, "weights": spec.weights,
            "trained-on": "the weights file's data"}


def backbone_info(spec: BackboneSpec) -> dict:
    """What the backbone is and what it was trained on, without loading it when cached."""
    if spec.weights:
        return _weights_info(spec)
    sidecar = _cache_path(spec).with_suffix(".json")
    if sidecar.is_file():
        return json.loads(sidecar.read_text())
    return load_backbone(spec)[1]


@functools.lru_cache(maxsize=2)
def load_backbone(spec: BackboneSpec) -> tuple[nn.Module, dict]:
    """The frozen backbone for a spec: from the cache, a weights file, or trained now.

    Whichever way it comes, it draws from a random stream of its own, so what the caller
    draws next (e.g. the global model's initial weights) does not depend on whether the
    backbone was cached."""
    with torch.random.fork_rng(devices=[]):
        return _load_backbone(spec)


def _load_backbone(spec: BackboneSpec) -> tuple[nn.Module, dict]:
    raw = load_dataset(*spec.dataset)
    if spec.weights:
        return TorchvisionResNet18(spec.weights, raw).eval(), _weights_info(spec)
    path = _cache_path(spec)
    if path.is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            net = EmbeddingNet(spec.arch, raw.input_shape, spec.dim, saved["classes"])
            net.load_state_dict(saved["state"])
            return net.eval(), saved["info"]
        except Exception:  # a damaged cache entry is a miss: train the backbone again
            path.unlink(missing_ok=True)
    net, info = _train_backbone(spec, raw)
    save_atomic(path, lambda tmp: torch.save(
        {"state": net.state_dict(), "classes": net.head.out_features, "info": info}, tmp))
    save_atomic(path.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(info)))
    return net, info


@torch.no_grad()
def embed(net: nn.Module, data: DatasetBundle, x: np.ndarray, batch: int = 512) -> np.ndarray:
    out = [net.features(data.to_tensor(x[i:i + batch])).float().numpy()
           for i in range(0, len(x), batch)]
    return np.concatenate(out) if out else np.zeros((0, 1), np.float32)


def cached_embeddings(spec: BackboneSpec, data: DatasetBundle, x: np.ndarray) -> np.ndarray:
    """Embeddings of ``x`` (a client's partition, or the test set), computed once."""
    path = cache_path("embeddings", ".npy", [spec.key_parts(), array_digest(x)], CODE)
    if path.is_file():
        return np.load(path)
    net, _ = load_backbone(spec)
    emb = embed(net, data, x)
    save_atomic(path, lambda tmp: np.save(tmp, emb))
    return emb
