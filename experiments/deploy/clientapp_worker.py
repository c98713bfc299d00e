"""A warm ClientApp executor: one long-running process beside a SuperNode serves all its
messages, in place of Flower's SuperExec that starts a ``flwr-clientapp`` per message.

``python -m experiments.deploy.clientapp_worker --runtime-api-address 127.0.0.1:PORT
--insecure`` talks to a SuperNode started with ``--isolation process`` over its Runtime
API, exactly as Flower's ``flower-superexec`` and ``flwr-clientapp`` do: it claims each
pending ClientApp task (``AcquireTask``, which hands out the task's token), pulls the
message and the node's ``Context`` (``PullTaskInput``), runs the run's ClientApp, pushes
the reply and the updated ``Context`` (so ``Context.state`` persists per node, kept by
the SuperNode as before) and sends the task's heartbeats meanwhile. The difference:
torch, numpy and Flower are imported once, the app is installed from its FAB and
imported once per FAB (from the FAB, as ``flwr-clientapp`` does, never from this
environment), and process-level caches survive between messages, as in Flower's
simulation, where one Ray actor serves many messages.

Flower's ``flwr-clientapp`` (1.41, 1.42) serves exactly one task and then exits
(``flwr.supernode.runtime.run_clientapp.run_clientapp`` ends in ``flwr_exit``), so it
cannot be kept warm. This module reuses that module's ``pull_task_input``,
``push_message`` and ``push_task_output`` and repeats ``run_clientapp``'s steps between
them (its error replies and task statuses included). That is reliance on Flower
internals, checked by ``tests/test_deploy_warm.py`` against the installed Flower.
Runtime dependency installation is not supported (fedpriv turns it off everywhere).

What it guards on the host (the node's Runtime API is plain HTTP on loopback, where any
local user could otherwise claim the node's tasks):

- ``--superexec-auth-secret-file``: it signs ``AcquireTask`` with the SuperNode's
  secret (Flower's ``SuperExecAuthHttpInterceptor``, as Flower's SuperExec does); every
  other Runtime call needs the task token ``AcquireTask`` hands out;
- ``--allow-app DIGEST`` (repeatable) or ``--allow-any-app``: before installing or
  importing anything from a FAB it computes the FAB's SHA-256 itself and refuses one not
  pinned: nothing of that app runs; the server gets an Error reply (as Flower sends for
  a ClientApp that fails to load) and the host one log line saying how to pin it;
- the Context goes back to the SuperNode with the node config (and run config, ids) it
  came with: only ``Context.state`` is the ClientApp's to change;
- umask 077: what the ClientApp writes (its ``state-dir``: the DP ledger, the CVAE) is
  readable by this host user only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import signal
import sys
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from ..runtime.owned_folders import owned_folder
from ..runtime.procs import listens_on
from .app_pin import fab_digest, refusal

# Imported before the first message, so that no message pays for them. Only third-party
# packages: the app's own modules must come from the run's FAB.
PRELOAD = ("numpy", "torch", "torchvision", "opacus", "flwr.app", "flwr.clientapp",
           "flwr.client.mod", "flwr.common", "flwr.compat.common.recorddict_compat")
SERVED = "[fedpriv clientapp-worker] served task"  # logged once per message
READY = "[fedpriv clientapp-worker] ready"
PULL_BACKOFF = 0.02  # s before asking again for a message object not yet there (Flower: 1)
PULL_BACKOFF_CAP = 0.5
KEEP = {name.split(".")[0] for name in PRELOAD} | {"experiments"}  # never re-imported
ACQUIRE = "/flwr.proto.Runtime/AcquireTask"  # the one Runtime call the secret guards


class AppRefused(Exception):
    """A FAB whose digest this host has not pinned: nothing of it was installed or run."""

    def __init__(self, fab_id: str, version: str, digest: str) -> None:
        self.fab_id, self.version, self.digest = fab_id, version, digest
        super().__init__(f"this SuperNode's host runs only pinned client code; app "
                         f"{fab_id} {version} (FAB sha256 {digest}) is not pinned there")


def preload(names: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import the ClientApp's heavy dependencies now; return those that are not installed.
    A root logging handler one of them installs (Opacus calls ``basicConfig``) is removed:
    it printed every line of this worker twice."""
    import logging

    root = logging.getLogger()
    before = list(root.handlers)
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)
    return missing


def pull_task_input(client: Any) -> tuple[Any, Any, Any, Any]:
    """The task's Message, Context, Run and FAB: Flower's (1.41, 1.42)
    ``run_clientapp.pull_task_input``, but retrying a message object that is not there
    yet after ``PULL_BACKOFF`` s instead of Flower's 1 s. A worker that is already
    running claims a task as soon as the SuperNode creates it, which is before the
    SuperNode has finished pulling the message's objects from the SuperLink; a new
    ``flwr-clientapp`` process never got there that early."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    fab = fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node,
                                                  context.run_id),
        return_type=Message, initial_backoff=PULL_BACKOFF, backoff_cap=PULL_BACKOFF_CAP)
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower sets it
    return message, context, run, fab


class Worker:
    """Runs ClientApp tasks one after another in this process, keeping the loaded app."""

    def __init__(self, address: str, insecure: bool, certificates: bytes | None,
                 secret: bytes | None = None, allowed: frozenset[str] | None = frozenset(),
                 apps_dir: Path | None = None) -> None:
        """``secret``: the SuperNode's Runtime API secret (None: it has none);
        ``allowed``: the FAB digests this host pinned (None: any app); ``apps_dir``: a
        private folder to install FABs in (default: a fresh one)."""
        self.address = address
        self.insecure = insecure
        self.certificates = certificates
        self.secret = secret
        self.allowed = allowed
        self.apps_dir = apps_dir or owned_folder("apps")
        self.refused: set[str] = set()  # digests already reported in the log
        self.fab_hash: str | None = None
        self.app_dir: Path | None = None
        self.app: Any = None
        self.served = 0

    def _client(self, token: str | None) -> tuple[Any, Any]:
        """A Runtime API client and its retry invoker; with ``token``, a client that
        speaks for that task."""
        from flwr.supercore.interceptors import (
            RuntimeTokenHttpInterceptor,
            RuntimeVersionHttpInterceptor,
            SuperExecAuthHttpInterceptor,
        )
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supercore.runtime.tracing import RuntimeTracingInterceptor

        component = "flwr-clientapp" if token else "SuperExec"
        interceptors: list[Any] = [RuntimeTracingInterceptor(),
                                   RuntimeVersionHttpInterceptor(component_name=component)]
        if token:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        elif self.secret:
            interceptors.append(SuperExecAuthHttpInterceptor(
                master_secret=self.secret, protected_methods=frozenset({ACQUIRE})))
        retry = make_simple_http_retry_invoker()
        return RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=self.insecure,
            root_certificates=self.certificates, interceptors=interceptors,
            retry_invoker=retry), retry

    def load(self, run: Any, fab: Any) -> Any:
        """The run's ClientApp: its FAB's digest checked against the pins first
        (:class:`AppRefused`, before anything of it is installed or imported), then
        installed in this worker's private folder and imported once per FAB, from the FAB
        only; a new FAB first unloads the previous one's modules (the same packages)."""
        digest = fab_digest(fab.content)  # never the hash the FAB comes labelled with
        if digest == self.fab_hash:
            return self.app
        if self.allowed is not None and digest not in self.allowed:
            raise AppRefused(run.fab_id, run.fab_version, digest)
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.supercore import log

        log(INFO, "[fedpriv clientapp-worker] running app %s %s (FAB sha256 %s, %s)",
            run.fab_id, run.fab_version, digest,
            "pinned" if self.allowed is not None else "any app allowed")

        self.unload()
        # a folder per digest: Flower reuses an installed folder named by the first
        # digits of the hash without checking its content
        path = install_from_fab(fab.content, install_dir=self.apps_dir / digest,
                                skip_prompt=True)
        # the app's packages already imported from this environment (`tasks`, by
        # experiments/__init__.py) are imported again from the FAB
        self._forget(_top_level(path) - KEEP)
        self.app = get_load_client_app_fn(default_app_ref="", app_path=str(path),
                                          multi_app=True)(run.fab_id, run.fab_version, digest)
        self.fab_hash = digest
        self.app_dir = Path(path)
        return self.app

    @staticmethod
    def _forget(names: set[str], root: str | None = None) -> None:
        """Drop from ``sys.modules`` the modules named ``names`` (with their submodules)
        and, with ``root``, those whose file is inside that folder."""
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None) or ""
            inside = bool(root and file and str(Path(file).resolve()).startswith(root + "/"))
            if inside or name.split(".")[0] in names:
                del sys.modules[name]

    def unload(self) -> None:
        """Forget the loaded FAB's modules (those whose file is inside its folder)."""
        if self.app_dir is None:
            return
        self._forget(set(), str(self.app_dir.resolve()))
        with contextlib.suppress(ValueError):
            sys.path.remove(str(self.app_dir.absolute()))
        self.app = self.fab_hash = self.app_dir = None

    def run_task(self, token: str) -> None:
        """Serve one claimed task, as ``flwr-clientapp`` does (``run_clientapp``, 1.41-1.42),
        without exiting afterwards."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore import log
        from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        t0 = time.perf_counter()
        client, retry = self._client(token)
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        message = reply = context = None
        kept: dict[str, Any] = {}
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            heartbeat.start()
            message, context, run, fab = pull_task_input(client)
            kept = _identity(context)
            app = self.load(run, fab)
            reply = app(message=message, context=context)
            sub_status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # the ClientApp's failure becomes the reply, as in Flower
            code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            reason = f"{type(ex)}:<'{ex}'>"
            if isinstance(ex, AppRefused):
                code, reason = ErrorCode.LOAD_CLIENT_APP_EXCEPTION, str(ex)
                if ex.digest not in self.refused:  # one line per app, not per message
                    self.refused.add(ex.digest)
                    log(ERROR, "%s", refusal(ex.fab_id, ex.version, ex.digest))
            elif isinstance(ex, LoadClientAppError):
                code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                reason = "An exception was raised when attempting to load `ClientApp`"
            if not isinstance(ex, AppRefused):
                log(ERROR, "ClientApp raised an exception", exc_info=ex)
            details = reason
            if message is not None:
                reply = Message(Error(code=code, reason=reason), reply_to=message)
        finally:
            if context is not None:  # only Context.state is the ClientApp's to change
                for name, value in kept.items():
                    setattr(context, name, value)
            try:
                if reply is not None and context is not None:
                    try:
                        push_message(client, reply, context)
                    except Exception as ex:
                        log(ERROR, "Failed to push reply message", exc_info=ex)
                retry.max_tries = 1  # as flwr-clientapp's exit handler
                push_task_output(client=client, context=context, sub_status=sub_status,
                                 details=details)
            finally:
                if heartbeat.is_running:
                    heartbeat.stop()
                client.close()
        self.served += 1
        log(INFO, "%s %d (%s, %.2f s)", SERVED, self.served, sub_status,
            time.perf_counter() - t0)

    def serve(self, poll: float) -> None:
        """Claim and serve ClientApp tasks until stopped; ask for one every ``poll`` s."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore import log
        from flwr.supercore.constant import TaskType

        client, _ = self._client(None)
        request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
        log(INFO, "%s for %s", READY, self.address)
        try:
            while True:
                try:
                    res = client.AcquireTask(request)
                except Exception as err:  # the SuperNode starting or stopping
                    log(WARNING, "[fedpriv clientapp-worker] Runtime API: %s", err)
                    time.sleep(max(poll, 0.5))
                    continue
                if res.HasField("task") and res.token:
                    self.run_task(res.token)
                    continue  # another may be waiting
                time.sleep(poll)
        finally:
            client.close()


def _identity(context: Any) -> dict[str, Any]:
    """What the SuperNode's Context says about the node and the run, copied: put back
    before the Context is pushed, so no task changes what the next one sees."""
    return {"node_config": dict(context.node_config), "run_config": dict(context.run_config),
            "run_id": context.run_id, "node_id": context.node_id,
            "series_id": context.series_id}


def _top_level(folder: Path) -> set[str]:
    """The importable top-level names an installed app folder provides."""
    names = set()
    for entry in folder.iterdir():
        if entry.is_dir() and (entry / "__init__.py").is_file():
            names.add(entry.name)
        elif entry.suffix == ".py":
            names.add(entry.stem)
    return names


def await_port_of(pid: int, address: str, interval: float = 0.05) -> None:
    """Wait until ``pid`` (the SuperNode that started this worker) itself listens on the
    Runtime API's port. The node binds it a second or so after starting the worker; a
    local process holding the port before it would otherwise be sent the node's secret
    and could hand this worker tasks to run on the host's data."""
    port = int(address.rpartition(":")[2])
    while not listens_on(pid, port):
        time.sleep(interval)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-api-address", required=True, metavar="HOST:PORT",
                    help="the SuperNode's Runtime API (its --host/--port)")
    trust = ap.add_mutually_exclusive_group(required=True)
    trust.add_argument("--insecure", action="store_true")
    trust.add_argument("--root-certificates", type=Path,
                       help="CA of the Runtime API's TLS certificate")
    ap.add_argument("--poll", type=float, default=0.05,
                    help="seconds between asks for a task (a local HTTP call)")
    ap.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    ap.add_argument("--apps-dir", type=Path, metavar="DIR",
                    help="a private folder to install apps in (default: a fresh one, "
                         "removed at exit)")
    ap.add_argument("--superexec-auth-secret-file", type=Path, metavar="FILE",
                    help="the SuperNode's Runtime API secret: AcquireTask is signed with it")
    pins = ap.add_mutually_exclusive_group(required=True)
    pins.add_argument("--allow-app", action="append", default=[], metavar="SHA256",
                      help="run only FABs with this digest (repeatable)")
    pins.add_argument("--allow-any-app", action="store_true",
                      help="run any FAB the SuperLink sends (no pin)")
    args = ap.parse_args(argv)
    from .app_pin import DIGEST

    bad = [d for d in args.allow_app if not DIGEST.match(d)]
    if bad:
        ap.error(f"--allow-app {bad[0]!r}: not 64 lower-case hexadecimal digits")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.umask(0o077)  # what the ClientApp writes (its state-dir) is this user's only
    preload()
    from flwr.supercore.app_utils import start_parent_process_monitor

    if args.parent_pid is not None:  # belt and braces beside the parent-death signal
        start_parent_process_monitor(args.parent_pid)
    certs = None if args.insecure else args.root_certificates.read_bytes()
    secret = (args.superexec_auth_secret_file.read_bytes()
              if args.superexec_auth_secret_file else None)
    allowed = None if args.allow_any_app else frozenset(args.allow_app)
    if args.apps_dir is not None:
        args.apps_dir.mkdir(mode=0o700, exist_ok=True)
    worker = Worker(args.runtime_api_address, bool(args.insecure), certs, secret, allowed,
                    args.apps_dir)

    def on_term(*_: object) -> None:
        """SIGTERM (the keeper's stop, the parent-death signal): remove the installed
        apps, then die of the signal as before (the keeper reads the exit code)."""
        shutil.rmtree(worker.apps_dir, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    try:
        if args.parent_pid is not None:
            await_port_of(args.parent_pid, args.runtime_api_address)
        worker.serve(args.poll)
    except KeyboardInterrupt:  # the parent monitor's SIGINT, or Ctrl-C
        return 0
    finally:
        shutil.rmtree(worker.apps_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
