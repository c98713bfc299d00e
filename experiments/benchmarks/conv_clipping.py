"""Benchmark: a convolution's share of a book-keeping DP-SGD step, per layer shape, by the
two exact ways (the ghost norm, instantiated per-example gradients) against SGD's own
weight gradient, and whether ``bookkeeping.ghost_cheaper`` picks the faster way.

Each shape times, on one thread, the weight's part of the backward: the per-example
squared norms plus the clipped sum (ghost: Goodfellow 2015, Li et al. 2022; instantiated:
the per-example gradients, Opacus' way made batched), and plain SGD's weight gradient
(``torch.nn.grad.conv2d_weight``). The ways take turns in each repeat; the median is
printed, with the picked way's time over SGD's (the floor). The default shapes are the
MNIST CNNs' layers and a CIFAR ResNet-18's stages.

    python -m experiments.benchmarks.conv_clipping [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from privacy.dp.bookkeeping import _conv_ghost, _conv_instantiated, ghost_cheaper


@dataclass(frozen=True)
class Shape:
    """One convolution: batch, channels in and out, kernel, stride, padding, input side."""

    name: str
    batch: int
    c_in: int
    c_out: int
    kernel: int
    stride: int
    padding: int
    side: int

    def layer(self) -> nn.Conv2d:
        return nn.Conv2d(self.c_in, self.c_out, self.kernel, self.stride, self.padding)

    @property
    def out_side(self) -> int:
        return (self.side + 2 * self.padding - self.kernel) // self.stride + 1


SHAPES = [
    Shape("ResNet-18 stage 4", 32, 512, 512, 3, 1, 1, 4),
    Shape("ResNet-18 stage 3", 32, 256, 256, 3, 1, 1, 8),
    Shape("ResNet-18 stage 3, strided", 32, 128, 256, 3, 2, 1, 16),
    Shape("ResNet-18 stage 3 shortcut", 32, 128, 256, 1, 2, 0, 16),
    Shape("ResNet-18 stage 2", 32, 128, 128, 3, 1, 1, 16),
    Shape("McMahan CNN conv 2", 64, 32, 64, 5, 1, 2, 14),
    Shape("small CNN conv 2", 64, 16, 32, 4, 2, 0, 13),
]


def ways(shape: Shape) -> dict[str, Callable[[], object]]:
    """The three computations for ``shape``, on fixed random inputs."""
    gen = torch.Generator().manual_seed(0)
    m = shape.layer()
    a = torch.randn(shape.batch, shape.c_in, shape.side, shape.side, generator=gen)
    g = torch.randn(shape.batch, shape.c_out, shape.out_side, shape.out_side, generator=gen)
    w = torch.rand(shape.batch, generator=gen)

    def clip(make: Callable) -> Callable[[], object]:
        def run() -> object:
            layer = make(m, a, g)
            return layer.sq.sum(), layer.clipped(w)
        return run

    return {"ghost": clip(_conv_ghost), "instantiated": clip(_conv_instantiated),
            "sgd": lambda: torch.nn.grad.conv2d_weight(a, m.weight.shape, g, m.stride,
                                                       m.padding)}


def measure(shape: Shape, repeats: int) -> dict[str, float]:
    """Median milliseconds of each way, the ways taking turns."""
    runs = ways(shape)
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    print(f"{'layer':28} {'T':>4} {'K':>5} {'SGD ms':>8} {'ghost ms':>9} {'inst. ms':>9}"
          f" {'rule':>6} {'faster':>6} {'picked/SGD':>10}")
    rows = []
    for shape in SHAPES:
        t = measure(shape, args.repeats)
        positions, kernel = shape.out_side ** 2, shape.kernel ** 2 * shape.c_in
        rule = "ghost" if ghost_cheaper(positions, kernel, shape.c_out) else "inst."
        faster = "ghost" if t["ghost"] < t["instantiated"] else "inst."
        picked = t["ghost"] if rule == "ghost" else t["instantiated"]
        print(f"{shape.name:28} {positions:4d} {kernel:5d} {t['sgd']:8.1f} {t['ghost']:9.1f}"
              f" {t['instantiated']:9.1f} {rule:>6} {faster:>6} {picked / t['sgd']:9.2f}x")
        rows.append({"layer": shape.name, "rule": rule, "faster": faster, **t})
    agree = sum(r["rule"] == r["faster"] for r in rows)
    print(f"the rule picks the faster way for {agree} of {len(rows)} shapes")
    return rows


if __name__ == "__main__":
    main()
