"""Every seed of a run and the rule that picks each round's clients, in one place.

One run ``seed`` fixes the partitioning, the model initialisation, client sampling and
every client's shuffling; the derived seeds below keep those streams independent. The
sampling rule is Flower's own (``random.sample`` over the node ids), applied to node
ids ordered by partition id with Python's ``random`` seeded per round, so the same
seed samples the same clients whatever ids the runtime gave the nodes; Poisson
sampling draws each client independently from the same stream.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

# held while the server seeds and draws from the process' global generators (``random``,
# numpy's, torch's): a sweep's cells side by side (server.cells) draw in turn, each as
# it would alone
GLOBAL_RNG = threading.RLock()


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that depends on every part (run seed, round, partition...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


def sampling_seed(seed: int, server_round: int, phase: int) -> int:
    """The seed of Python's ``random`` when clients are sampled (phase 0 train, 1 evaluate)."""
    return seed * 1_000_003 + server_round * 2 + phase


def seed_sampling(seed: int, server_round: int, phase: int) -> None:
    """Seed Python's ``random`` just before a strategy samples (Flower samples with it)."""
    random.seed(sampling_seed(seed, server_round, phase))


def sampling_rng(seed: int, server_round: int, phase: int = 0) -> random.Random:
    """The same stream as :func:`seed_sampling`, as a private generator."""
    return random.Random(sampling_seed(seed, server_round, phase))


def sample_cohort(ordered: Sequence[int], rng: Any, size: int = 0,
                  rate: float | None = None) -> list[int]:
    """The clients of one round, from node ids ordered by partition.

    A fixed-size cohort is ``rng.sample(ordered, size)`` (``size`` 0: everyone, in
    random order), exactly Flower's rule; with a ``rate`` each client is taken
    independently with that probability (Poisson sampling). ``rng`` is Python's
    ``random`` after :func:`seed_sampling`, or :func:`sampling_rng`.
    """
    if rate is not None:
        return [c for c in ordered if rng.random() < rate]
    return rng.sample(list(ordered), min(size or len(ordered), len(ordered)))


def canary_seeds(seed: int, partition_id: int) -> tuple[int, int]:
    """(public, secret) seeds of a client's audit canaries: their contents are the
    auditor's own records, which of them were inserted only the client and the scorer
    know."""
    return derive_seed(seed, partition_id, 0xCA), derive_seed(seed, partition_id, 0x5EC)
