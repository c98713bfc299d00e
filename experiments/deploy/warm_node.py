"""A Flower SuperNode whose ClientApps run in one warm process, with short polls.

``python -m experiments.deploy.warm_node [--poll S] [--idle-after S] -- ARGS`` runs
Flower's own ``flower-supernode ARGS --isolation process`` in this process (the same
SuperLink connection, TLS, node authentication, node config and Runtime API), after

- starting :mod:`experiments.deploy.clientapp_worker` beside it, which serves every
  ClientApp message of this node in one long-running process instead of a new
  ``flwr-clientapp`` per message. The worker is this process's child: it gets the
  parent-death signal (the kernel stops it when this process dies, even by SIGKILL), it
  watches this PID too, it is restarted if it dies, and it is stopped by its PID when the
  SuperNode exits;
- shortening the SuperNode's fixed polls (:mod:`experiments.deploy.fast_poll`).

Everything else is Flower's: the Fleet connection, heartbeats, the node's state and
``Context`` per run, the Runtime API the worker talks to.
"""

from __future__ import annotations

import argparse
import math
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..runtime.procs import _die_with_parent

WORKER = "experiments.deploy.clientapp_worker"


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``args`` (the last one), if given."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def worker_command(flower_args: list[str], poll: float, parent: int) -> list[str]:
    """The worker for a SuperNode started with ``flower_args``: its Runtime API address
    (``--host``/``--port``, Flower's defaults otherwise), and TLS if the API has it."""
    from flwr.supercore.constant import SUPERNODE_DEFAULT_CLIENT_ADDRESS

    default_host, _, default_port = SUPERNODE_DEFAULT_CLIENT_ADDRESS.rpartition(":")
    host = _flag(flower_args, "--host") or default_host
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"  # bound everywhere: reach it on loopback
    address = f"{host}:{_flag(flower_args, '--port') or default_port}"
    ca = _flag(flower_args, "--ssl-ca-certfile")
    trust = ["--root-certificates", ca] if ca else ["--insecure"]
    return [sys.executable, "-m", WORKER, "--runtime-api-address", address, *trust,
            "--poll", str(poll), "--parent-pid", str(parent)]


class WorkerKeeper:
    """Starts the worker, restarts it if it dies, and stops it by PID at the end."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.starts = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="fedpriv-clientapp-worker")

    def start(self) -> None:
        """Start the worker now (from the calling thread), and watch it from a thread."""
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent)

    def _run(self) -> None:
        # The parent-death signal is bound to the thread that started the child: the main
        # thread, and for a restarted worker this daemon thread, which lives as long as the
        # process; both end only when the SuperNode process does.
        while self.proc is not None:
            code = self.proc.wait()
            if self.stopping.is_set() or code in (-signal.SIGTERM, -signal.SIGINT):
                return  # stopped from outside: this SuperNode is going too
            print(f"[fedpriv warm node] the ClientApp worker (pid {self.proc.pid}) exited "
                  f"with code {code}; starting another", file=sys.stderr, flush=True)
            if self.stopping.wait(1.0):
                return
            self._spawn()

    def stop(self, grace: float = 5.0) -> None:
        """Stop the worker (SIGTERM, then SIGKILL after ``grace``), by its PID."""
        self.stopping.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """fedpriv's options before ``--``, flower-supernode's arguments after it."""
    if "--" in argv:
        cut = argv.index("--")
        own, flower = argv[:cut], argv[cut + 1:]
    else:
        own, flower = [], argv
    ap = argparse.ArgumentParser(prog="python -m experiments.deploy.warm_node",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--poll", type=float, default=0.1,
                    help="seconds between the SuperNode's pulls from the SuperLink while "
                         "busy (Flower: 3)")
    ap.add_argument("--idle-after", type=float, default=math.inf,
                    help="after this many seconds without a message, back to Flower's 3 s "
                         "(default: never)")
    ap.add_argument("--worker-poll", type=float, default=0.05,
                    help="seconds between the worker's asks for a task (local)")
    args = ap.parse_args(own)
    if (_flag(flower, "--isolation") or "process") != "process":
        ap.error("a warm node runs its ClientApps in its own worker: --isolation process only")
    kept: list[str] = []
    skip = False
    for a in flower:  # drop a given --isolation (it can only be `process`), then add it
        if skip or a.startswith("--isolation="):
            skip = False
            continue
        skip = a == "--isolation"
        if not skip:
            kept.append(a)
    return args, [*kept, "--isolation", "process"]


def main(argv: list[str] | None = None) -> int:
    import os

    args, flower = parse(sys.argv[1:] if argv is None else argv)
    from flwr.supercore import log
    from flwr.supercore.exit import add_exit_handler
    from flwr.supernode.cli.flower_supernode import flower_supernode

    from .fast_poll import install

    why = install(poll=args.poll, idle_after=args.idle_after)
    from logging import INFO, WARNING

    if why:
        log(WARNING, "[fedpriv warm node] keeping Flower's 3 s polls: %s", why)
    else:
        log(INFO, "[fedpriv warm node] SuperNode polls every %g s while busy", args.poll)
    keeper = WorkerKeeper(worker_command(flower, args.worker_poll, os.getpid()))
    add_exit_handler(keeper.stop)
    keeper.start()
    sys.argv = [str(Path(sys.executable).parent / "flower-supernode"), *flower]
    try:
        flower_supernode()
    finally:
        keeper.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
