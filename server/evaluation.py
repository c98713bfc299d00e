"""The server's own evaluation of each global model on its held-out data.

Every round: loss, accuracy and multiclass AUROC (one-vs-rest, macro; Di Salvo et al.
2024 score their probes so) on the test split, and, with ``validation-fraction``, on a
validation split kept for model selection (the round with the lowest validation loss is
the reported model: early stopping). At the end, with ``test-noise``, the reported model
is scored again on test inputs plus Gaussian noise of each standard deviation (the same
paper's robustness protocol).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn

from tasks.files import write_atomic
from tasks.results.ledger import RoundRecord
from tasks.seeding import derive_seed
from tasks.splits import Split
from tasks.training import convolutions_channels_last, logits_of


def auroc(y: np.ndarray, probs: np.ndarray) -> float | None:
    """Macro one-vs-rest AUROC; None when the labels hold a single class.

    Each class's AUROC is its Mann-Whitney statistic (Hanley & McNeil 1982: the chance a
    random positive outscores a random negative, ties counting one half), the area
    scikit-learn's ``roc_auc_score`` integrates: equal to it to float rounding
    (tests/test_probe.py), without its 1.3 s import on every run's first evaluation.
    """
    present = np.unique(y)
    if len(present) < 2 or not np.isfinite(probs).all():  # one class, or a diverged model
        return None
    if len(present) == 2:
        return _mann_whitney(y == present[1], probs[:, present[1]])
    # classes absent from y are left out (their one-vs-rest AUROC is undefined)
    cols = probs[:, present] / probs[:, present].sum(1, keepdims=True)
    return float(np.mean([_mann_whitney(y == c, cols[:, j]) for j, c in enumerate(present)]))


def _mann_whitney(positive: np.ndarray, scores: np.ndarray) -> float:
    """AUROC of ``scores`` for the ``positive`` rows: U / (positives x negatives), from
    ranks with ties given their average rank."""
    order = np.argsort(scores, kind="stable")
    ordered = scores[order]
    starts = np.r_[0, np.flatnonzero(np.diff(ordered)) + 1]  # each run of equal scores
    ends = np.r_[starts[1:], len(ordered)]
    ranks = np.empty(len(ordered))
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)  # 1-based, averaged
    pos = int(positive.sum())
    neg = len(positive) - pos
    return float((ranks[positive].sum() - pos * (pos + 1) / 2) / (pos * neg))


def score(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
          device: torch.device) -> dict[str, float | None]:
    """Mean cross-entropy, accuracy and AUROC of ``model`` on (x, y)."""
    logits = logits_of(model, x, batch_size, device)
    loss = float(nn.functional.cross_entropy(logits, y, reduction="mean"))
    probs = torch.softmax(logits, 1).numpy()
    return {"loss": loss, "accuracy": float((logits.argmax(1) == y).float().mean()),
            "auroc": auroc(y.numpy(), probs)}


class CentralEvaluator:
    """Loads a global model into a copy of ``model`` and scores it on the test (and
    validation) split.

    The copy's convolutions are channels-last on the CPU (oneDNN's kernels: the small
    CNN's evaluation on 1,000 images about 1.5x faster; the same values to float
    rounding), ``model`` itself is left as it is. After the loop ``self.model`` holds the
    last model evaluated: the final global model (:meth:`state_dict` gives it in
    contiguous layout).
    """

    def __init__(self, model: nn.Module, test: Split, batch_size: int,
                 device: torch.device, validation: Split | None = None) -> None:
        self.model = convolutions_channels_last(copy.deepcopy(model), device)
        self.test = test
        self.validation = validation
        self.batch_size = batch_size
        self.device = device

    def __call__(self, arrays: ArrayRecord) -> dict[str, float]:
        self.model.load_state_dict(arrays.to_torch_state_dict())
        out = {k: v for k, v in score(self.model, self.test.x, self.test.y, self.batch_size,
                                      self.device).items() if v is not None}
        if self.validation is not None:
            val = score(self.model, self.validation.x, self.validation.y, self.batch_size,
                        self.device)
            out.update({f"validation-{k}": v for k, v in val.items() if v is not None})
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model last evaluated, every tensor contiguous (NCHW): what model.pt holds."""
        return {k: v.contiguous() for k, v in self.model.state_dict().items()}

    def robustness(self, arrays: ArrayRecord, sigmas: tuple[float, ...], seed: int
                   ) -> list[dict[str, float | None]]:
        """The model ``arrays`` on the test inputs plus N(0, sigma^2) noise, per sigma
        (seeded, so every run of a sweep sees the same noise)."""
        self.model.load_state_dict(arrays.to_torch_state_dict())
        out = []
        for i, sigma in enumerate(sigmas):
            gen = torch.Generator().manual_seed(derive_seed(seed, 0x5E, i))
            noisy = self.test.x + sigma * torch.randn(self.test.x.shape, generator=gen)
            out.append({"sigma": sigma, **score(self.model, noisy, self.test.y,
                                                self.batch_size, self.device)})
        return out


class ModelSelection:
    """A round hook keeping the model with the lowest validation loss (early stopping).

    The selected model is also written to ``checkpoint/selected.npz`` (atomically) so
    that a resumed run selects over all its rounds, not only those after the resume.
    """

    def __init__(self, run_dir: Path, records: list[RoundRecord]) -> None:
        self.path = run_dir / "checkpoint" / "selected.npz"
        scored = [r for r in records if "validation-loss" in r.test]
        best = min(scored, key=lambda r: r.test["validation-loss"], default=None)
        self.record: RoundRecord | None = best
        self.arrays: ArrayRecord | None = None
        if best is not None and self.path.is_file():
            with np.load(self.path) as f:
                self.arrays = ArrayRecord({k: Array(f[k]) for k in f.files})

    def after_round(self, record: RoundRecord, arrays: ArrayRecord, result: Any) -> None:
        loss = record.test.get("validation-loss")
        if loss is None or not np.isfinite(loss) or (
                self.record is not None and loss >= self.record.test["validation-loss"]):
            return
        self.record, self.arrays = record, arrays
        self.path.parent.mkdir(parents=True, exist_ok=True)
        values = {k: v.numpy() for k, v in arrays.items()}
        write_atomic(self.path, lambda f: np.savez(f, **values))

    def finish(self) -> None:
        pass
