"""Checks that need the data, run by the CLI before any SuperLink or Ray process starts.

They run in another process (:func:`preflight_isolated`, running
:mod:`experiments.preflight.checks`): importing torch costs about 0.5 GB, which the CLI would
otherwise hold for the whole run. Where the in-process runtime's child already waits for
the run (:class:`experiments.runtime.inprocess_link.InProcessLink`), it checks them, with
torch, the apps and Opacus imported once for both (about 2 s of CPU saved a plain run,
3.7 s a local-DP run); else a short-lived child of their own does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tasks.config import ConfigError, RunConfig


@dataclass
class Preflight:
    dataset: str
    model: str
    parameters: int
    sizes: list[int]
    cuda: bool
    privacy: str = ""
    label_counts: list[list[int]] | None = None  # ground truth, per client


# how the runtime's child marks the line that answers a pre-flight request (its other
# lines are its progress and notes)
ANSWER = "[fedpriv-preflight] "


class Checker(Protocol):
    """A process already running that answers pre-flight requests (the in-process
    runtime's child): ``check(given)`` is :func:`_child`'s (answer, exit code)."""

    def check(self, given: object) -> tuple[dict, int]: ...


def _child(given: object, env: Mapping[str, str] | None) -> tuple[dict, int]:
    # stderr goes straight to the terminal: progress such as backbone training shows live
    proc = subprocess.run([sys.executable, "-m", "experiments.preflight.checks"], text=True,
                          input=json.dumps(given), stdout=subprocess.PIPE,
                          env={**os.environ, **env} if env else None)
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    return answer, proc.returncode


def _preflight(answer: dict, code: int) -> Preflight:
    if "error" in answer:
        raise ConfigError(answer["error"])
    if "crash" in answer:
        raise RuntimeError(f"the pre-flight check crashed: {answer['crash']}")
    if code != 0 or "result" not in answer:
        raise RuntimeError(f"the pre-flight check crashed (exit code {code}); its error is "
                           "printed above")
    return Preflight(**answer["result"])


def _ask(given: object, env: Mapping[str, str] | None, checker: Checker | None
         ) -> tuple[dict, int]:
    return checker.check(given) if checker is not None else _child(given, env)


def preflight_isolated(cfg: RunConfig, env: Mapping[str, str] | None = None,
                       checker: Checker | None = None) -> Preflight:
    """:func:`experiments.preflight.checks.preflight` in ``checker`` (the runtime's waiting
    child), else in a child process (``env`` added to its environment: the runtime's
    shared privacy values, :meth:`InProcessLink.memo_env`); its ConfigError is raised
    here."""
    return _preflight(*_ask(cfg.flat(), env, checker))


def preflight_many(cfgs: Sequence[RunConfig], env: Mapping[str, str] | None = None,
                   checker: Checker | None = None) -> list[Preflight | Exception]:
    """The pre-flight check of every config in one process (``checker``, else a child of
    their own: torch imported once): per config its :class:`Preflight`, or the
    ConfigError / RuntimeError it raised."""
    answer, code = _ask([c.flat() for c in cfgs], env, checker)
    results = answer.get("results") or [{}] * len(cfgs)
    out: list[Preflight | Exception] = []
    for one in results:
        try:
            out.append(_preflight(one, code))
        except (ConfigError, RuntimeError) as exc:
            out.append(exc)
    return out
