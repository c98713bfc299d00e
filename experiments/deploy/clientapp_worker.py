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
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

# Imported before the first message, so that no message pays for them. Only third-party
# packages: the app's own modules must come from the run's FAB.
PRELOAD = ("numpy", "torch", "torchvision", "opacus", "flwr.app", "flwr.clientapp",
           "flwr.client.mod", "flwr.common", "flwr.compat.common.recorddict_compat")
SERVED = "[fedpriv clientapp-worker] served task"  # logged once per message
READY = "[fedpriv clientapp-worker] ready"
PULL_BACKOFF = 0.02  # s before asking again for a message object not yet there (Flower: 1)
PULL_BACKOFF_CAP = 0.5


def preload(names: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import the ClientApp's heavy dependencies now; return those that are not installed."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
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

    def __init__(self, address: str, insecure: bool, certificates: bytes | None) -> None:
        self.address = address
        self.insecure = insecure
        self.certificates = certificates
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
        )
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supercore.runtime.tracing import RuntimeTracingInterceptor

        component = "flwr-clientapp" if token else "SuperExec"
        interceptors: list[Any] = [RuntimeTracingInterceptor(),
                                   RuntimeVersionHttpInterceptor(component_name=component)]
        if token:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        retry = make_simple_http_retry_invoker()
        return RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=self.insecure,
            root_certificates=self.certificates, interceptors=interceptors,
            retry_invoker=retry), retry

    def load(self, run: Any, fab: Any) -> Any:
        """The run's ClientApp: installed from its FAB and imported once per FAB; a new
        FAB first unloads the previous one's modules (they are the same packages)."""
        if fab.hash_str == self.fab_hash:
            return self.app
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.config import get_project_dir

        self.unload()
        install_from_fab(fab.content, skip_prompt=True)
        self.app = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(
            run.fab_id, run.fab_version, fab.hash_str)
        self.fab_hash = fab.hash_str
        self.app_dir = Path(get_project_dir(run.fab_id, run.fab_version, fab.hash_str))
        return self.app

    def unload(self) -> None:
        """Forget the loaded FAB's modules (those whose file is inside its folder)."""
        if self.app_dir is None:
            return
        root = str(self.app_dir.resolve())
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None) or ""
            if file and str(Path(file).resolve()).startswith(root + "/"):
                del sys.modules[name]
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
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            heartbeat.start()
            message, context, run, fab = pull_task_input(client)
            app = self.load(run, fab)
            reply = app(message=message, context=context)
            sub_status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # the ClientApp's failure becomes the reply, as in Flower
            code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            reason = f"{type(ex)}:<'{ex}'>"
            if isinstance(ex, LoadClientAppError):
                code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                reason = "An exception was raised when attempting to load `ClientApp`"
            log(ERROR, "ClientApp raised an exception", exc_info=ex)
            details = reason
            if message is not None:
                reply = Message(Error(code=code, reason=reason), reply_to=message)
        finally:
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
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    preload()
    from flwr.supercore.app_utils import start_parent_process_monitor

    if args.parent_pid is not None:  # belt and braces beside the parent-death signal
        start_parent_process_monitor(args.parent_pid)
    certs = None if args.insecure else args.root_certificates.read_bytes()
    try:
        Worker(args.runtime_api_address, bool(args.insecure), certs).serve(args.poll)
    except KeyboardInterrupt:  # the parent monitor's SIGINT, or Ctrl-C
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
