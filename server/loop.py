"""The server's round loop: any round runner, explicit stop conditions, and per-round hooks
(plots, leakage observation, model selection, checkpoints)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from flwr.app import ArrayRecord

from strategies.rounds import RoundResult
from strategies.runner import RoundRunner
from tasks.results.ledger import RoundRecord

from .console import say
from .recorder import RoundRecorder

Evaluate = Callable[[ArrayRecord], dict[str, float]]
StopBefore = Callable[[int], "str | None"]  # round about to run -> why not, or None
StopAfter = Callable[[RoundRecord], "str | None"]  # round just recorded -> why stop, or None
# a malicious server's weights for a round (and the attack's name), or None: send the model
Tamper = Callable[[int, ArrayRecord], "tuple[ArrayRecord, str] | None"]


class RoundHook(Protocol):
    """Called after every recorded round, and once when the loop ends."""

    def after_round(self, record: RoundRecord, arrays: ArrayRecord,
                    result: RoundResult) -> None: ...

    def finish(self) -> None: ...


@dataclass
class LoopOutcome:
    arrays: ArrayRecord  # the final global model
    stopped_early: str | None  # why the loop ended before its last round, if it did


def run_rounds(runner: RoundRunner, initial: ArrayRecord, num_rounds: int,
               evaluate: Evaluate, recorder: RoundRecorder, *,
               hooks: Sequence[RoundHook] = (), stop_before: Sequence[StopBefore] = (),
               stop_after: Sequence[StopAfter] = (), start: int = 1,
               tamper: Tamper | None = None) -> LoopOutcome:
    """Evaluate the initial model, then run, evaluate and record rounds until done or stopped.

    ``start`` > 1: a resumed run, ``initial`` being the checkpointed model of round
    ``start - 1`` (already evaluated and recorded). ``tamper``: in the rounds it answers,
    the clients are sent its weights instead, and the round's result is discarded (the
    federation keeps the honest model; the hooks see the round's result)."""
    arrays = initial
    if start == 1:
        recorder.initial(evaluate(arrays))
    else:
        recorder.resumed(start)
    reason = None
    try:
        for rnd in range(start, num_rounds + 1):
            if reason := _first(stop(rnd) for stop in stop_before):
                break
            trap = tamper(rnd, arrays) if tamper is not None else None
            result = runner.run_round(rnd, arrays if trap is None else trap[0])
            if trap is None:
                arrays = result.arrays or arrays
            else:
                result.log.tampered = trap[1]
            start = time.perf_counter()
            test = evaluate(arrays)
            record = recorder.record(result.log, test, time.perf_counter() - start)
            for hook in hooks:
                hook.after_round(record, arrays, result)
            if reason := _first(stop(record) for stop in stop_after):
                break
    except BaseException:
        _finish_quietly(hooks)  # the error that stopped the loop is the one reported
        raise
    for hook in hooks:
        hook.finish()
    return LoopOutcome(arrays, reason)


def _finish_quietly(hooks: Sequence[RoundHook]) -> None:
    """Let every hook finish after a failure; a hook that fails too (e.g. a plot on the
    same full disk) is mentioned, never raised in place of the first error."""
    for hook in hooks:
        try:
            hook.finish()
        except Exception as also:
            say(f"warning: while stopping, {type(hook).__name__} failed too: "
                f"{type(also).__name__}: {also}")


def _first(reasons) -> str | None:
    return next((r for r in reasons if r), None)


def target_accuracy_reached(target: float) -> StopAfter:
    """Stop once the server's test accuracy reaches ``target`` (0: never)."""
    def stop(record: RoundRecord) -> str | None:
        if target and record.accuracy >= target:
            return (f"test accuracy {record.accuracy:.4f} reached target-accuracy {target} at "
                    f"round {record.round}")
        return None

    return stop


DIVERGED_FACTOR = 10.0  # a loss this many times the initial model's has exploded


def diverged(record: RoundRecord, initial_loss: float | None) -> str | None:
    """Why ``record``'s model diverged, or None: a non-finite test or train loss (NaN or
    infinite weights give one), or a test or train loss above ``DIVERGED_FACTOR`` times
    the initial model's test loss (for 10 classes that is about ln 10 = 2.3, and even an
    overfit model stays far below 23). A tampered round's train loss is the trap's, not
    the model's, and is not read."""
    test = float(record.test.get("loss", math.nan))
    train = None if record.tampered else record.train.get("loss")
    start = initial_loss if initial_loss is not None and math.isfinite(initial_loss) else None
    if not math.isfinite(test):
        return f"the test loss is {test}"
    if train is not None and not math.isfinite(float(train)):
        return f"the clients' train loss is {float(train)}"
    if start and test > DIVERGED_FACTOR * start:
        return (f"the test loss {test:.4g} is over {DIVERGED_FACTOR:.0f}x the initial model's "
                f"{start:.4g}")
    if start and train is not None and float(train) > DIVERGED_FACTOR * start:
        return (f"the clients' train loss {float(train):.4g} is over {DIVERGED_FACTOR:.0f}x "
                f"the initial model's test loss {start:.4g}")
    return None


class DivergenceWatch:
    """A round hook that notices the first round whose model diverged (:func:`diverged`):
    it says so on the terminal and records the round and cause (``on_diverged``) for
    run.json and summary.md. The run goes on: a study may mean to run a setting that
    cannot learn (heavy noise), and its epsilon and rounds must stay what was asked."""

    def __init__(self, initial_loss: Callable[[], float | None],
                 on_diverged: Callable[[int, str], None]) -> None:
        self.initial_loss = initial_loss
        self.on_diverged = on_diverged
        self.seen = False

    def after_round(self, record: RoundRecord, arrays: ArrayRecord,
                    result: RoundResult) -> None:
        if self.seen:
            return
        cause = diverged(record, self.initial_loss())
        if cause is not None:
            self.seen = True
            say(f"warning: the model diverged at round {record.round}: {cause}. Lower lr; "
                "with dp = 'central', add less noise per update (more clients a round, a "
                "smaller clipping-norm, a lower noise-multiplier)")
            self.on_diverged(record.round, cause)

    def finish(self) -> None:
        pass
