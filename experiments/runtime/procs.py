"""Processes fedpriv starts, stopped by the PIDs it recorded — never by name."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC_STAT = os.path.exists("/proc/self/stat")


def started(pid: int) -> float:
    """When process ``pid`` started, in seconds since boot (Linux's /proc/PID/stat): fixed
    for the process' life, so an equal value means the same process and not a reused PID.
    psutil's create_time adds the boot time read anew each call, which moves with the wall
    clock (NTP) and could make a live process look gone. NoSuchProcess when it is gone."""
    if not PROC_STAT:  # not Linux: psutil's wall-clock start
        return psutil.Process(pid).create_time()
    return _stat(pid)[1]


def _stat(pid: int) -> tuple[str, float]:
    """(state letter, start in seconds since boot) of ``pid`` from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None
    return fields[0].decode(), int(fields[19]) / CLOCK_TICKS  # fields 3 and 22


def same_process(pid: int, when: float) -> bool:
    """``pid`` is alive (not a zombie) and is the process that :func:`started` at
    ``when``."""
    try:
        if not PROC_STAT:
            p = psutil.Process(pid)
            return abs(p.create_time() - when) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE
        state, start = _stat(pid)
        return state != "Z" and abs(start - when) < 1e-6
    except (psutil.Error, OSError, ValueError, IndexError):
        return False


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into the same unwinding as Ctrl-C (cleanup runs), told apart."""


class OutputClosed(KeyboardInterrupt):
    """Whoever read our output went away (``fedpriv run | head``): the same unwinding as
    Ctrl-C, told apart."""


class PipeGuard:
    """The CLI's stdout: once its reader is gone, the next write raises
    :class:`OutputClosed` (instead of a BrokenPipeError that would leave a run "crashed"
    with no cause), and every later write goes nowhere."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.gone = False

    def _closed(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        raise OutputClosed

    def write(self, text: str) -> int:
        if self.gone:
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return 0

    def flush(self) -> None:
        if self.gone:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def interruption(exc: BaseException) -> str:
    """How a run was stopped from outside, for run.json and the terminal."""
    if isinstance(exc, OutputClosed):
        return ("stopped: the output's reader went away (e.g. `fedpriv run | head`); pipe "
                "into `tee` or a file to keep the run going")
    return ("stopped by SIGTERM" if isinstance(exc, Terminated)
            else "interrupted by the user (Ctrl-C)")


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while cleanup runs (a second Ctrl-C must not cut it short),
    then act on them: a signal that arrived meanwhile is raised once cleanup is done
    (KeyboardInterrupt, or :class:`Terminated`), unless an error is already on its way
    out; never lost. Only possible in the main thread, elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    saved: dict[int, Any] = {}
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            saved[s] = signal.signal(s, hold)
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    # reached only when the block ended normally; inside an __exit__ that an error is
    # passing through (Ctrl-C's own cleanup), that error goes on instead
    if held and sys.exc_info()[0] is None:
        raise Terminated if held[0] == signal.SIGTERM else KeyboardInterrupt


def tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its live descendants (psutil guards against PID reuse)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def terminate_then_kill(current: Callable[[], list[psutil.Process]], grace: float
                        ) -> list[psutil.Process]:
    """SIGTERM every process ``current()`` lists; after ``grace`` seconds SIGKILL those
    still alive and any it lists anew (born in between). Returns the ones killed."""
    procs = current()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    alive += [p for p in current() if p not in alive]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return alive


def stop_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM a process we started and every descendant; SIGKILL what is left after ``grace``."""
    killed = terminate_then_kill(lambda: tree(proc.pid), grace)
    psutil.wait_procs(killed, timeout=grace)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def listens_on(pid: int, port: int) -> bool:
    """Process ``pid`` itself holds a listening TCP socket on ``port``: the port is its,
    not another process' that answers on it."""
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections("inet"))
    except psutil.Error:
        return False


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In the child, before exec: ask Linux to send it ``sig`` (SIGTERM) when its parent
    dies (even by SIGKILL), so a child fedpriv started never outlives it."""
    try:
        # the running program's own symbols (libc's among them): find_library would run
        # `ldconfig -p` from here, a process forked between fork and exec
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's cleanup still applies
        pass


def stop_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the process group of a child started in a session of its own
    (its id is that child's PID): what it started and left behind when it exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        if sig == signal.SIGTERM:
            wait_until(lambda: not _group_alive(pgid), grace)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def start_child(cmd: list[str], env: dict[str, str] | None = None,
                stdin: int = subprocess.DEVNULL,
                death_signal: int = signal.SIGTERM) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (a Ctrl-C on the terminal is ours), with the
    parent-death signal (the kernel sends ``death_signal`` if we are killed: a child that
    must tell that from our own SIGTERM asks for another one), its output piped."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=stdin, text=True, bufsize=1, errors="replace",
                            preexec_fn=functools.partial(die_with_parent, death_signal),
                            start_new_session=True)


def stream_child(cmd: list[str], on_line: Callable[[str], None],
                 env: dict[str, str] | None = None) -> int:
    """Run ``cmd``, passing each output line on; stop it (by PID) if we are interrupted,
    and have the kernel stop it if we are killed. When it exits, whatever it started and
    left running (holding its output open) is stopped too. Returns its exit code."""
    return stream(start_child(cmd, env), on_line)


def stream(proc: subprocess.Popen, on_line: Callable[[str], None]) -> int:
    """Pass ``proc``'s output lines on until it ends (see :func:`stream_child`)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    ended: float | None = None
    try:
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                if proc.poll() is not None:
                    if ended is None:
                        ended = time.monotonic()
                        stop_group(proc.pid)
                    elif time.monotonic() - ended > 5:
                        break
                continue
            if line is None:
                break
            on_line(line.rstrip("\n"))
        return proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: the child, its group, then any stragglers
            stop_group(proc.pid)
            stop_tree(proc)


class Foreground:
    """Child processes that serve together in the foreground and end together.

    Each runs in a session of its own and gets the parent-death signal (the kernel stops
    it even when we are SIGKILLed); their output lines reach ``on_line`` from the caller's
    thread. When one exits, or we are interrupted, every child and what it started is
    stopped by PID: SIGTERM, then SIGKILL after a grace period.
    """

    def __init__(self, on_line: Callable[[str], None], env: dict[str, str] | None = None
                 ) -> None:
        self.on_line = on_line
        self.env = env
        self.children: list[subprocess.Popen] = []
        self._lines: queue.Queue[str] = queue.Queue()

    def start(self, cmd: list[str]) -> subprocess.Popen:
        """Start ``cmd``; its lines are passed on while :meth:`pump` runs."""
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                bufsize=1, errors="replace", preexec_fn=die_with_parent,
                                start_new_session=True)
        self.children.append(proc)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self._lines.put(line.rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()
        return proc

    def exited(self) -> subprocess.Popen | None:
        """The first child that has exited, if any."""
        return next((p for p in self.children if p.poll() is not None), None)

    def pump(self, until: Callable[[], bool] | None = None, timeout: float | None = None
             ) -> bool:
        """Pass lines on until ``until()`` holds (True), or a child exits or ``timeout``
        passes (False); without ``until``, until a child exits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        checked = 0.0
        while True:
            try:
                self.on_line(self._lines.get(timeout=0.1))
                if time.monotonic() - checked < 0.5:
                    continue  # drain what is there before deciding, but not forever
            except queue.Empty:
                pass
            checked = time.monotonic()
            if until is not None and until():
                return True
            if self.exited() is not None:
                return False
            if deadline is not None and time.monotonic() > deadline:
                return False

    def stop(self, grace: float = 5.0) -> None:
        """Stop every child (last started first) with its descendants and its group, then
        pass on the lines they left."""
        with signals_deferred():
            for proc in reversed(self.children):
                terminate_then_kill(lambda p=proc: tree(p.pid), grace)
                stop_group(proc.pid, grace)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            try:
                self.on_line(self._lines.get(timeout=0.1))
            except queue.Empty:
                if all(p.poll() is not None for p in self.children):
                    break

    def __enter__(self) -> Foreground:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def exit_now(code: int) -> None:
    """End a child process that has written everything: flush, then skip the interpreter's
    teardown (about 1.8 s with torch and the apps imported, for nothing)."""
    import logging

    for stream_ in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream_.flush()
    logging.shutdown()
    os._exit(code)
