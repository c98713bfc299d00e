"""What the reference-model attacks cost: R reference updates trained together in one
torch.func program (privacy.attacks.reference) against the plain PyTorch loop (one model,
torch.optim.SGD, one reference after another), same shapes, measured in the same run.

Shape: the membership sweeps' observed client (the small CNN, 100 MNIST-shaped records,
3 local epochs, batch 16, lr 0.05, momentum 0.5), plain SGD and DP-SGD (per-record
clipping + noise; the loop uses Opacus' PrivacyEngine). Also the update decomposition's
cost for 1,100 candidates. Usage:
    python -m experiments.benchmarks.reference_training [--references 16] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from privacy.attacks.decomposition import decomposition_scores
from privacy.attacks.observation import LocalTraining
from privacy.attacks.reference import ReferenceSetup, train_references
from tasks.models import SmallCNN

N, EPOCHS, BATCH = 100, 3, 16


def _loop(sent: dict, x: torch.Tensor, y: torch.Tensor, t: LocalTraining,
          dp: bool) -> None:
    """The baseline: each reference trained alone with torch.optim (Opacus for DP)."""
    for k in range(len(x)):
        model = SmallCNN((1, 28, 28), 10).to(x.device)  # Opacus wraps each model once
        model.load_state_dict(sent)
        opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum)
        data = torch.utils.data.TensorDataset(x[k], y[k])
        loader = torch.utils.data.DataLoader(data, batch_size=t.batch_size, shuffle=True)
        if dp:
            from opacus import PrivacyEngine

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                private, opt, loader = PrivacyEngine().make_private(
                    module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                    max_grad_norm=1.0)
        else:
            private = model
        for _ in range(t.local_epochs):
            for xb, yb in loader:
                if len(yb) == 0:
                    continue
                opt.zero_grad()
                nn.functional.cross_entropy(private(xb), yb).backward()
                opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--references", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()
    report: dict[str, float] = {}
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = SmallCNN((1, 28, 28), 10).to(device)
    sent = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t = LocalTraining(lr=0.05, momentum=0.5, weight_decay=0.0, local_epochs=EPOCHS,
                      batch_size=BATCH)
    r = args.references
    pool_x, pool_y = torch.randn(r * N + 200, 1, 28, 28), torch.randint(0, 10, (r * N + 200,))
    print(f"device {device}, {r} references of {N} records, {EPOCHS} epochs, batch {BATCH}")
    _warm_up(model, sent, pool_x, pool_y, t, device)
    for dp in (False, True):
        setup = ReferenceSetup(t, N, references=r, dp_noise=1.0 if dp else 0.0,
                               dp_clip=1.0 if dp else 0.0)
        start = time.perf_counter()
        train_references(model, {k: v.to(device) for k, v in sent.items()}, pool_x, pool_y,
                         0, setup)
        _sync(device)
        together = time.perf_counter() - start
        x = pool_x[: r * N].reshape(r, N, 1, 28, 28).to(device)
        y = pool_y[: r * N].reshape(r, N).to(device)
        start = time.perf_counter()
        _loop(sent, x, y, t, dp)
        _sync(device)
        alone = time.perf_counter() - start
        what = "DP-SGD" if dp else "SGD"
        report[f"{what}-together-s"], report[f"{what}-loop-s"] = together, alone
        print(f"{what:6s}: together (torch.func) {together:6.2f} s   plain loop {alone:6.2f} s"
              f"   ratio {together / alone:.2f}x")
    cx, cy = torch.randn(1100, 1, 28, 28).to(device), torch.randint(0, 10, (1100,)).to(device)
    update = {k: 0.01 * torch.randn_like(v) for k, v in sent.items()}
    start = time.perf_counter()
    decomposition_scores(model, {k: v.to(device) for k, v in sent.items()}, update, cx, cy)
    _sync(device)
    report["decomposition-s"] = time.perf_counter() - start
    print(f"update decomposition, 1,100 candidates x 3 points: "
          f"{report['decomposition-s']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def _warm_up(model: nn.Module, sent: dict, pool_x: torch.Tensor, pool_y: torch.Tensor,
             t: LocalTraining, device: torch.device) -> None:
    """One untimed pass of each variant at two references, so that neither timed variant
    pays the first call's costs (CUDA's kernels and handles, Opacus' import, torch.func's
    first trace) for the other."""
    for dp in (False, True):
        setup = ReferenceSetup(t, N, references=2, dp_noise=1.0 if dp else 0.0,
                               dp_clip=1.0 if dp else 0.0)
        train_references(model, {k: v.to(device) for k, v in sent.items()}, pool_x, pool_y,
                         0, setup)
        x = pool_x[: 2 * N].reshape(2, N, 1, 28, 28).to(device)
        _loop(sent, x, pool_y[: 2 * N].reshape(2, N).to(device), t, dp)
    _sync(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
