"""Processes fedpriv starts, stopped by the PIDs it recorded — never by name."""

from __future__ import annotations

import subprocess
import threading
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


class MemorySampler:
    """Samples the summed RSS of process trees in a background thread; reports the peak."""

    def __init__(self, pids_fn, interval: float = 0.2) -> None:
        self._pids_fn = pids_fn
        self._interval = interval
        self._stop = threading.Event()
        self.peak_bytes = 0
        self.peak_processes = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            total, seen = 0, set()
            for pid in self._pids_fn():
                for p in tree(pid):
                    if p.pid in seen:
                        continue
                    seen.add(p.pid)
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_processes = total, len(seen)
            self._stop.wait(self._interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
