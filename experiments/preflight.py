"""Checks that need the data, run by the CLI before any SuperLink or Ray process starts.

They run in a short-lived child process (:func:`preflight_isolated`, running
:mod:`experiments.checks`): importing torch costs about 0.5 GB, which the CLI would
otherwise hold for the whole run.
"""

from __future__ import annotations

import json
import subprocess
import sys
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


def preflight_isolated(cfg: RunConfig) -> Preflight:
    """:func:`experiments.checks.preflight` in a child process; its ConfigError is raised here."""
    # stderr goes straight to the terminal: progress such as backbone training shows live
    proc = subprocess.run([sys.executable, "-m", "experiments.checks"], text=True,
                          input=json.dumps(cfg.flat()), stdout=subprocess.PIPE)
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if "error" in answer:
        raise ConfigError(answer["error"])
    if proc.returncode != 0 or "result" not in answer:
        raise RuntimeError(f"the pre-flight check crashed (exit code {proc.returncode}); its "
                           "error is printed above")
    return Preflight(**answer["result"])
