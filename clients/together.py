"""A round's clients trained together (``train-together``): the ClientApps meet at training.

The in-process runtime delivers a plain round's training messages to their ClientApps at
once, each in a thread of its own, inside :func:`gathering`. Every ClientApp runs as
always (its mods, its data, its update steps, its reply) up to its local training, where
it :meth:`Cohort.join`\\ s the round's cohort instead of training alone. When every client
of the round has joined, or finished without training (it declined, or raised), one
batched program trains them all (:func:`tasks.cohort_training.train_cohort`: the
sequential loop's result up to float rounding) and each ClientApp goes on with its own
model. Outside a gathering (Ray, real SuperNodes, secure rounds) there is no cohort and
clients train alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tasks.training import TrainResult


@dataclass
class _Job:
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    seed: int
    training: Any  # tasks.cohort_training.CohortTraining (the same for the whole round)
    device: torch.device
    result: tuple[dict[str, torch.Tensor], TrainResult] | BaseException | None = None


class Cohort:
    """The clients of one delivery: ``size`` threads, each training at most once."""

    def __init__(self, size: int) -> None:
        self.expected = size
        self.jobs: dict[int, _Job] = {}
        self.done = threading.Condition()
        self.trained = False

    def join(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int,
             training: Any, device: torch.device) -> TrainResult:
        """Train ``model`` on (x, y) (batches drawn with ``seed``, as
        :func:`tasks.training.make_loader` draws them) with the round's cohort."""
        job = _Job(model, x, y, seed, training, device)
        with self.done:
            self.jobs[threading.get_ident()] = job
            self._maybe_train()
            while job.result is None:
                self.done.wait()
        if isinstance(job.result, BaseException):
            raise RuntimeError(f"the round's batched training failed: {job.result}") \
                from job.result
        state, result = job.result
        model.load_state_dict(state)
        return result

    def finished(self) -> None:
        """A thread's ClientApp returned: if it never joined, the cohort stops waiting
        for it."""
        with self.done:
            if threading.get_ident() not in self.jobs:
                self.expected -= 1
                self._maybe_train()

    def _maybe_train(self) -> None:
        """Train everyone once every expected client has joined (holding the lock)."""
        if self.trained or len(self.jobs) < self.expected or not self.jobs:
            return
        from tasks.cohort_training import train_cohort

        self.trained = True
        jobs = list(self.jobs.values())
        try:
            out = train_cohort(jobs[0].model, [j.model.state_dict() for j in jobs],
                               [(j.x, j.y) for j in jobs], [j.seed for j in jobs],
                               jobs[0].training, jobs[0].device)
            for job, res in zip(jobs, out, strict=True):
                job.result = res
        except Exception as exc:  # every waiting client fails with the cause
            for job in jobs:
                job.result = exc
        self.done.notify_all()


_current: Cohort | None = None


def current() -> Cohort | None:
    """The cohort this round's clients meet in, if the runtime gathered them."""
    return _current


@contextlib.contextmanager
def gathering(size: int) -> Iterator[Cohort]:
    """A cohort for ``size`` ClientApps the caller is about to run in threads."""
    global _current
    cohort = Cohort(size)
    _current = cohort
    try:
        yield cohort
    finally:
        _current = None
