"""A Flower SuperNode whose ClientApps run in one warm process, with short polls.

``python -m experiments.deploy.warm_node [--poll S] [--idle-after S] [--allow-app SHA256
| --allow-any-app] -- ARGS`` runs Flower's own ``flower-supernode ARGS --isolation
process`` in this process (the same SuperLink connection, TLS, node authentication, node
config and Runtime API), after

- writing a fresh Runtime API secret for this start (a new 0700 folder, the file 0600;
  removed when the node exits) and giving it to the SuperNode
  (``--superexec-auth-secret-file``) and to its executor, so that no other local user
  can claim this node's tasks (``AcquireTask``) on its plain-HTTP loopback port;

- starting :mod:`experiments.deploy.clientapp_worker` beside it, which serves every
  ClientApp message of this node in one long-running process instead of a new
  ``flwr-clientapp`` per message. The worker is this process's child: it gets the
  parent-death signal (the kernel stops it when this process dies, even by SIGKILL), it
  watches this PID too, it is restarted if it dies, and it is stopped by its PID when the
  SuperNode exits. It runs only FABs whose digest is pinned (``--allow-app``; default:
  this installation's own fedpriv app, :func:`experiments.deploy.app_pin.app_digest`);
- shortening the SuperNode's fixed polls (:mod:`experiments.deploy.fast_poll`).

``--executor superexec`` runs Flower's stock executor instead, still authenticated:
Flower's ``flower-superexec`` (a ``flwr-clientapp`` process per message, Flower's 3 s
polls), started and stopped by PID the same way. It cannot check digests, so it needs
``--allow-any-app``.

Everything else is Flower's: the Fleet connection, heartbeats, the node's state and
``Context`` per run, the Runtime API the worker talks to.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from ..runtime.owned_folders import owned_folder
from ..runtime.procs import die_with_parent, listens_on

WORKER = "experiments.deploy.clientapp_worker"
EXECUTORS = ("worker", "superexec")
SECRET_FLAG = "--superexec-auth-secret-file"


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``args`` (the last one), if given."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def write_runtime_secret() -> Path:
    """A fresh Runtime API secret: ``runtime.secret`` (mode 0600, 64 hex characters) in a
    new private folder (mode 0700, made by ``mkdtemp``); created exclusively and never
    through a symlink. Remove its folder when the node exits (if the node is SIGKILLed,
    the next fedpriv start on this host removes it: the folder names its owner)."""
    folder = owned_folder("supernode")
    os.chmod(folder, 0o700)
    path = folder / "runtime.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode())
    return path


def _runtime_api(flower_args: list[str]) -> list[str]:
    """How an executor reaches the SuperNode's Runtime API: its address
    (``--host``/``--port``, Flower's defaults otherwise) and TLS if the API has it."""
    from flwr.supercore.constant import SUPERNODE_DEFAULT_CLIENT_ADDRESS

    default_host, _, default_port = SUPERNODE_DEFAULT_CLIENT_ADDRESS.rpartition(":")
    host = _flag(flower_args, "--host") or default_host
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"  # bound everywhere: reach it on loopback
    address = f"{host}:{_flag(flower_args, '--port') or default_port}"
    ca = _flag(flower_args, "--ssl-ca-certfile")
    trust = ["--root-certificates", ca] if ca else ["--insecure"]
    return ["--runtime-api-address", address, *trust]


def worker_command(flower_args: list[str], poll: float, parent: int,
                   secret: Path | None = None, allow: Sequence[str] | None = None,
                   apps: Path | None = None) -> list[str]:
    """The worker for a SuperNode started with ``flower_args``: its Runtime API, the
    secret that signs ``AcquireTask`` (if any), the pinned digests (None: any app), the
    private folder it installs apps in (default: its own)."""
    pins = ["--allow-any-app"] if allow is None else \
        [a for d in allow for a in ("--allow-app", d)]
    auth = [SECRET_FLAG, str(secret)] if secret is not None else []
    where = ["--apps-dir", str(apps)] if apps is not None else []
    return [sys.executable, "-m", WORKER, *_runtime_api(flower_args), "--poll", str(poll),
            "--parent-pid", str(parent), *auth, *pins, *where]


def superexec_command(flower_args: list[str], parent: int, secret: Path | None) -> list[str]:
    """Flower's stock executor for this SuperNode: ``flower-superexec`` (a
    ``flwr-clientapp`` per message), proving itself with ``secret``."""
    auth = [SECRET_FLAG, str(secret)] if secret is not None else []
    return [str(Path(sys.executable).parent / "flower-superexec"),
            *_runtime_api(flower_args), *auth, "--parent-pid", str(parent)]


class WorkerKeeper:
    """Starts the worker (or SuperExec), restarts it if it dies, and stops it by PID at
    the end."""

    def __init__(self, cmd: list[str], name: str = "the ClientApp worker",
                 ready: Callable[[], bool] | None = None) -> None:
        self.cmd = cmd
        self.name = name
        self.ready = ready  # started only once it holds (from the watching thread)
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.starts = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="fedpriv-clientapp-worker")

    def start(self) -> None:
        """Start the worker now (from the calling thread), or once ``ready()`` holds
        (from the watching thread), and watch it from a thread."""
        if self.ready is None:
            self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)

    def _run(self) -> None:
        # The parent-death signal is bound to the thread that started the child: the main
        # thread, and for a restarted worker this daemon thread, which lives as long as the
        # process; both end only when the SuperNode process does.
        if self.ready is not None:
            while not self.ready():
                if self.stopping.wait(0.05):
                    return
            with self._lock:  # not after stop() has looked for it
                if self.stopping.is_set():
                    return
                self._spawn()
        while self.proc is not None:
            code = self.proc.wait()
            if self.stopping.is_set() or code in (-signal.SIGTERM, -signal.SIGINT):
                return  # stopped from outside: this SuperNode is going too
            print(f"[fedpriv warm node] {self.name} (pid {self.proc.pid}) exited "
                  f"with code {code}; starting another", file=sys.stderr, flush=True)
            if self.stopping.wait(1.0):
                return
            with self._lock:
                if self.stopping.is_set():
                    return
                self._spawn()

    def stop(self, grace: float = 5.0) -> None:
        """Stop the worker (SIGTERM, then SIGKILL after ``grace``), by its PID."""
        with self._lock:
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


def executor(args: argparse.Namespace, flower: list[str], secret: Path | None,
             allow: Sequence[str] | None, folder: Path | None) -> WorkerKeeper:
    """The keeper of this node's executor: the warm worker, or Flower's SuperExec."""
    if args.executor == "worker":
        # the apps it installs live in this start's private folder, removed with it; it
        # waits itself until this process holds the Runtime API port, importing meanwhile
        return WorkerKeeper(worker_command(flower, args.worker_poll, os.getpid(), secret,
                                           allow, folder / "apps" if folder else None))
    # Flower's executor sends the secret to the port at once: started only once this
    # process (the SuperNode) holds it, not whoever bound it first
    port = int(_runtime_api(flower)[1].rpartition(":")[2])
    return WorkerKeeper(superexec_command(flower, os.getpid(), secret), "Flower's SuperExec",
                        ready=lambda: listens_on(os.getpid(), port))


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
    ap.add_argument("--executor", choices=EXECUTORS, default="worker",
                    help="worker: fedpriv's warm ClientApp worker (default); superexec: "
                         "Flower's flower-superexec, a flwr-clientapp per message and "
                         "Flower's 3 s polls (needs --allow-any-app)")
    pins = ap.add_mutually_exclusive_group()
    pins.add_argument("--allow-app", action="append", default=[], metavar="SHA256",
                      help="run only apps whose FAB has this digest (repeatable; default: "
                           "this installation's fedpriv app)")
    pins.add_argument("--allow-any-app", action="store_true",
                      help="run any app the SuperLink sends")
    ap.add_argument("--client-cert", type=Path, metavar="PATH",
                    help="present this TLS client certificate to the SuperLink (its key: "
                         "the --auth-supernode-private-key given to Flower)")
    ap.add_argument("--unprotected-runtime-api", action="store_true",
                    help=argparse.SUPPRESS)  # tests only: the attack the secret stops
    args = ap.parse_args(own)
    if (_flag(flower, "--isolation") or "process") != "process":
        ap.error("a warm node runs its ClientApps in its own worker: --isolation process only")
    if args.executor == "superexec" and not args.allow_any_app:
        ap.error("--executor superexec runs Flower's flwr-clientapp, which cannot check an "
                 "app's digest: give --allow-any-app, or use --executor worker to pin apps")
    from .app_pin import DIGEST

    bad = [d for d in args.allow_app if not DIGEST.match(d)]
    if bad:
        ap.error(f"--allow-app {bad[0]!r}: not 64 lower-case hexadecimal digits")
    if args.client_cert is not None and not _flag(flower, "--auth-supernode-private-key"):
        ap.error("--client-cert needs the node's key: give Flower's "
                 "--auth-supernode-private-key after --")
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


def _remove(folder: Path | None) -> None:
    """Remove this start's secret folder (a no-op when there is none or it is gone)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args, flower = parse(sys.argv[1:] if argv is None else argv)
    os.umask(0o077)  # the SuperNode's and its ClientApps' files: this user's only
    from logging import INFO, WARNING

    from flwr.supercore import log
    from flwr.supercore.exit import add_exit_handler
    from flwr.supernode.cli.flower_supernode import flower_supernode

    if args.client_cert is not None:  # before Flower opens its Fleet connection
        from .client_cert import install as install_client_cert

        install_client_cert(Path(args.client_cert),
                            Path(str(_flag(flower, "--auth-supernode-private-key"))))
    if args.executor == "worker":
        from .fast_poll import install

        why = install(poll=args.poll, idle_after=args.idle_after)
        if why:
            log(WARNING, "[fedpriv warm node] keeping Flower's 3 s polls: %s", why)
        else:
            log(INFO, "[fedpriv warm node] SuperNode polls every %g s while busy", args.poll)
    allow = None  # the pinned digests, worked out before any secret is written
    if args.executor == "worker" and not args.allow_any_app:
        from .app_pin import app_digest

        allow = args.allow_app or [app_digest()]
    folder = secret = None
    given = _flag(flower, SECRET_FLAG)
    if given is not None:
        secret = Path(given)
    elif not args.unprotected_runtime_api:
        secret = write_runtime_secret()
        folder = secret.parent
        flower = [*flower, SECRET_FLAG, str(secret)]
    keeper = executor(args, flower, secret, allow, folder)
    # before Flower's own handlers (stop_http_server): the worker must be gone before the
    # Runtime API's port is free, or a local user could take the port and serve it tasks
    add_exit_handler(keeper.stop, run_before_force_exit=True)
    add_exit_handler(lambda: _remove(folder))
    sys.argv = [str(Path(sys.executable).parent / "flower-supernode"), *flower]
    try:
        keeper.start()
        flower_supernode()
    finally:
        with contextlib.suppress(Exception):
            keeper.stop()
        _remove(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
