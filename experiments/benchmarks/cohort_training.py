"""Benchmark: a round's clients trained one after the other against together in one
``torch.func`` program (:mod:`tasks.cohort_training`), plain SGD, one local epoch.

Cohorts of 10 and 50 clients x 400 images (28x28, one channel; random pixels: the
time does not depend on them), batch 32, lr 0.05, momentum 0.5, each client from its
own weights. The two variants take turns in each repeat; medians are printed.

    python -m experiments.benchmarks.cohort_training                  # CPU, 2 threads
    python -m experiments.benchmarks.cohort_training --device cuda
    python -m experiments.benchmarks.cohort_training --dp          # DP-SGD both ways
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from privacy.dp.dpsgd import make_private
from tasks.cohort_training import CohortDP, CohortTraining, train_cohort
from tasks.models import build_model
from tasks.training import make_loader, resolve_device, sgd, train_epochs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _to_cpu(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: v.detach().cpu() for n, v in model.state_dict().items()}


def bench(model_name: str, clients: int, images: int, training: CohortTraining,
          device: torch.device, repeats: int, dp: CohortDP | None = None) -> dict[str, float]:
    """Median seconds of one epoch for the whole cohort, sequential and batched (with
    ``dp``: DP-SGD, sequentially through make_private's book-keeping mode)."""
    g = torch.Generator().manual_seed(0)
    states = []
    for k in range(clients):
        torch.manual_seed(k)
        states.append(build_model(model_name, (1, 28, 28), 10).state_dict())
    data = [(torch.randn(images, 1, 28, 28, generator=g),
             torch.randint(0, 10, (images,), generator=g)) for _ in range(clients)]
    data_dev = [(x.to(device), y.to(device)) for x, y in data]
    seeds = list(range(clients))
    template = build_model(model_name, (1, 28, 28), 10)

    def sequential() -> None:
        model = build_model(model_name, (1, 28, 28), 10).to(device)
        for k in range(clients):
            model.load_state_dict(states[k])
            opt = sgd(model, training.lr, training.momentum, training.weight_decay)
            loader = make_loader(*data_dev[k], training.batch_size, seeds[k])
            if dp is None:
                train_epochs(model, loader, opt, training.local_epochs, device)
                _to_cpu(model)  # what a client sends, as train_cohort returns it
                continue
            private = make_private(model, opt, loader, noise_multiplier=dp.noise_multiplier,
                                   max_grad_norm=dp.max_grad_norm,
                                   grad_sample_mode="bookkeeping", seed=seeds[k])
            train_epochs(private.model, private.loader, private.optimizer,
                         training.local_epochs, device, criterion=private.criterion)
            model = private.module()
            _to_cpu(model)

    def together() -> None:
        train_cohort(template, states, data_dev, seeds, training, device, dp=dp)

    times: dict[str, list[float]] = {"sequential": [], "together": []}
    for r in range(repeats + 1):  # the first round warms up
        for name, fn in (("sequential", sequential), ("together", together)):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if r:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description="sequential vs batched cohort training")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="small-cnn")
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--images", type=int, nargs="+", default=[400, 50])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dp", action="store_true",
                        help="DP-SGD (noise multiplier 1, clipping norm 1) instead of SGD")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    training = CohortTraining(lr=0.05, batch_size=32, local_epochs=1, momentum=0.5)
    rows, report = [], []
    for images in args.images:
        for clients in args.clients:
            res = bench(args.model, clients, images, training, device, args.repeats,
                        CohortDP(1.0, 1.0) if args.dp else None)
            ratio = res["together"] / res["sequential"]
            report.append({"clients": clients, "images": images, **res, "ratio": ratio})
            rows.append(f"{clients:>4} clients x {images:>4} images  sequential "
                        f"{res['sequential']:.3f} s  together {res['together']:.3f} s  "
                        f"together/sequential {ratio:.2f}x")
            print(rows[-1], flush=True)
    print(f"({args.model}, {'DP-SGD' if args.dp else 'SGD'}, {device}, {args.threads} "
          f"threads, median of {args.repeats})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
