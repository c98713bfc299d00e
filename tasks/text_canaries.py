"""Canary lines planted in clients' text (the Secret Sharer: Carlini et al., USENIX
Security 2019; in federated training, Thakkar et al. 2020): which canaries, who holds them,
and the training examples they add.

Everything here is a function of the run config: the secrets come from the run's seed,
the holders are drawn with it, so the server that measures exposure and every client
agree on them without a message. A holder adds its canaries' lines to its own text as
LEAF makes examples of any line (:mod:`tasks.shakespeare`): one example per character,
after 80 spaces; ``repetitions`` copies of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from privacy.attacks.exposure import Canary, make_canaries

from .config import RunConfig
from .seeding import derive_seed
from .shakespeare import SEQ_LEN, encode

SECRET_STREAM = 0x5EC2  # the seed stream the secrets and holders are drawn from


@dataclass(frozen=True)
class Planted:
    """One canary, how often each holder repeats it, and its holders (partition ids)."""

    canary: Canary
    repetitions: int
    holders: tuple[int, ...]


def planted(cfg: RunConfig) -> list[Planted]:
    """The run's canaries (``secret-canaries`` of them, dealt to ``secret-repetitions`` in
    turn), each held by ``secret-clients`` partitions drawn with the run's seed."""
    mem = cfg.memorization
    if not mem.enabled:
        return []
    seed = derive_seed(cfg.training.seed, SECRET_STREAM)
    canaries = make_canaries(mem.secret_canaries, mem.secret_length, seed)
    reps = mem.repetitions()
    rng = np.random.default_rng(derive_seed(seed, 1))
    return [Planted(c, reps[i % len(reps)], tuple(sorted(int(h) for h in rng.choice(
        cfg.federation.num_clients, size=mem.secret_clients, replace=False))))
        for i, c in enumerate(canaries)]


def line_examples(line: str) -> tuple[np.ndarray, np.ndarray]:
    """LEAF's examples of one line: (80 ids before each character, that character), for
    every character of the line and its line end."""
    block = encode(" " * SEQ_LEN + line + "\n")
    view = np.lib.stride_tricks.sliding_window_view(block, SEQ_LEN)
    n = len(block) - SEQ_LEN
    return view[:n].copy(), block[SEQ_LEN:].astype(np.int64)


def canary_rows(plants: list[Planted], partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The examples ``partition_id`` adds to its text: each canary it holds, repeated;
    empty arrays when it holds none."""
    xs, ys = [], []
    for p in plants:
        if partition_id in p.holders:
            x, y = line_examples(p.canary.text)
            xs += [x] * p.repetitions
            ys += [y] * p.repetitions
    if not xs:
        return np.zeros((0, SEQ_LEN), dtype=np.uint8), np.zeros(0, dtype=np.int64)
    return np.concatenate(xs), np.concatenate(ys)
