"""Processes fedpriv starts, stopped by the PIDs it recorded — never by name."""

from __future__ import annotations

import subprocess
import time

import psutil


def tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its live descendants (psutil guards against PID reuse)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stop_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM a process we started and every descendant; SIGKILL what is left after ``grace``."""
    procs = tree(proc.pid)
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    # Children may have been born between the snapshot and SIGTERM.
    alive += [p for p in tree(proc.pid) if p not in alive]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
