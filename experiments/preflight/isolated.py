"""Checks that need the data, run by the CLI before any SuperLink or Ray process starts.

They run in a short-lived child process (:func:`preflight_isolated`, running
:mod:`experiments.preflight.checks`): importing torch costs about 0.5 GB, which the CLI would
otherwise hold for the whole run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


def preflight_isolated(cfg: RunConfig, env: Mapping[str, str] | None = None) -> Preflight:
    """:func:`experiments.preflight.checks.preflight` in a child process (``env`` added to
    its environment: the runtime's shared privacy values, :meth:`InProcessLink.memo_env`);
    its ConfigError is raised here."""
    return _preflight(*_child(cfg.flat(), env))


def preflight_many(cfgs: Sequence[RunConfig], env: Mapping[str, str] | None = None
                   ) -> list[Preflight | Exception]:
    """The pre-flight check of every config in one child process (torch imported once):
    per config its :class:`Preflight`, or the ConfigError / RuntimeError it raised."""
    answer, code = _child([c.flat() for c in cfgs], env)
    results = answer.get("results") or [{}] * len(cfgs)
    out: list[Preflight | Exception] = []
    for one in results:
        try:
            out.append(_preflight(one, code))
        except (ConfigError, RuntimeError) as exc:
            out.append(exc)
    return out
