"""Flower's apps in one process (and its client workers): the real ServerApp and ClientApp,
no SuperLink, no Ray.

``python -m experiments.runtime.inprocess PARENT_PID`` imports what a run needs, then
reads the run from stdin and runs the ServerApp's main with an :class:`InProcessGrid` of
its simulated nodes, each with its own persistent
``Context`` (``node_config`` holding its partition, as in Flower's simulation). Every
message is delivered as Flower's simulation runtime delivers it: given an id, copied
(new records around the same immutable bytes, so a client that changes what it received
changes nothing else), answered by the ClientApp with its mods, the reply copied back; a
ClientApp that raises gives an error reply (code 2, ``CLIENT_APP_RAISED_EXCEPTION``) and leaves the
node's Context as it was, as Ray's backend does. A plain or local-DP round's training
messages are answered side by side, a client per ``client-cpus`` of the cores at once, as
Ray's workers answer them: in worker processes forked when the runtime starts
(``client-workers = "processes"``, :mod:`.client_workers`; the node's Context travels
with the message and comes back with the reply) or in threads of this process; each
client on its ``client-threads`` torch threads and its own generators (so the bits are
the same); every other message (anonymizers, SecAgg+, HE, the CVAE phase) one at a
time, here (:func:`clients.app.answers_in_parallel`). What is skipped is only
transport: Ray actors, the SuperLink's message store and its polling (``runtime =
"ray"`` keeps them, for process isolation, GPU shares and Ray clusters).

:class:`experiments.runtime.inprocess_link.InProcessLink` runs this child for the CLI.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext, suppress
from pathlib import Path
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from experiments.preflight.isolated import ANSWER
from privacy.dp.shared_memo import MEMO_ENV
from tasks.allocator import keep_freed_memory
from tasks.messages import FIT
from tasks.records import copy_records
from tasks.seeding import GLOBAL_RNG

from . import preload
from .client_workers import WorkerPool, answer
from .owned_folders import owned_folder, remove_stale_homes

NODE_ID_BASE = 1000  # node i has id NODE_ID_BASE + i (the server orders nodes by partition)
RUN_ID = 1
PARENT_DIED = signal.SIGUSR1  # the parent-death signal the link asks the kernel for


def _copy(content: RecordDict) -> RecordDict:
    """What a runtime delivers: a copy sharing nothing mutable with the sender's (new
    records and arrays around the same immutable bytes and scalars, as serializing and
    parsing them would give, at a third of the cost)."""
    return copy_records(content)


def _copy_context(context: Context) -> Context:
    """A node's Context as the ClientApp may change it: its state a serialized copy, its
    configs new dicts (their values, Flower's config scalars, are immutable). Serializing
    the whole Context, run config included, cost a third of a one-step client's message."""
    return Context(run_id=context.run_id, node_id=context.node_id,
                   node_config=dict(context.node_config), state=_copy(context.state),
                   run_config=dict(context.run_config))


class InProcessGrid(Grid):
    """Flower's Grid over nodes whose ClientApp answers in this process, in order.

    ``node_config(i)`` adds to node i's ``node_config`` what a host's ``--node-config``
    would (tests use it for hosts' own data paths); with ``keep_sent`` (tests), ``sent``
    keeps each message as delivered (a run keeps none: a 1,000-client round would add
    every client's copy of the model).
    """

    RUNTIME = "inprocess"

    def __init__(self, client_app: ClientApp, run_config: Mapping[str, Any], num_nodes: int,
                 *, node_ids: Iterable[int] | None = None, simulated: bool = True,
                 node_config: Callable[[int], dict[str, Any]] | None = None,
                 keep_sent: bool = False) -> None:
        self.client_app = client_app
        self.keep_sent = keep_sent
        self.together = False  # train a round's clients as one program (train-together)
        self.workers = 1  # clients answering at once, where the message allows it
        self.parallel: Callable[[Message], bool] = lambda msg: False
        self.pool: WorkerPool | None = None  # worker processes answering parallel messages
        # simulated nodes serve the partition the server pairs them with
        # (server.discovery.simulated); otherwise each keeps its own node_config's
        self.assigns_partitions = simulated
        ids = list(node_ids) if node_ids is not None else [NODE_ID_BASE + i
                                                            for i in range(num_nodes)]
        self.contexts = {
            nid: Context(run_id=RUN_ID, node_id=nid, state=RecordDict(),
                         run_config=dict(run_config),
                         node_config={"partition-id": pid, "num-partitions": num_nodes,
                                      **(node_config(pid) if node_config else {})})
            for pid, nid in enumerate(ids)}
        self._node_configs = {nid: dict(c.node_config) for nid, c in self.contexts.items()}
        self._run_configs = {nid: dict(c.run_config) for nid, c in self.contexts.items()}
        self._run = Run.create_empty(RUN_ID)
        self._replies: dict[str, Message] = {}
        self.sent: list[Message] = []
        self._answering_here: AbstractContextManager[Any] = nullcontext()

    def cell_view(self) -> InProcessGrid:
        """The same nodes, ClientApp and workers, each node with a fresh Context (its
        node and run config, an empty state), as a run of its own would find them: a
        sweep's cells that run side by side (:func:`server.app.run_cells`) keep their
        nodes' states apart. Thread-safe against the other views: the worker pool takes
        messages from any thread; each view keeps its own Contexts and replies."""
        view = copy.copy(self)
        view.contexts = {nid: Context(run_id=c.run_id, node_id=nid, state=RecordDict(),
                                      run_config=dict(self._run_configs[nid]),
                                      node_config=dict(self._node_configs[nid]))
                         for nid, c in self.contexts.items()}
        view._replies, view.sent = {}, []
        # a message answered here (not by a worker process: evaluation, a lone client)
        # runs its ClientApp in this process, which seeds torch's global generator
        view._answering_here = GLOBAL_RNG
        return view

    @property
    def partition_of(self) -> dict[int, int]:
        return {nid: int(c.node_config["partition-id"]) for nid, c in self.contexts.items()}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message and keep its reply until it is pulled. With ``together``,
        a plain round's training messages are delivered at once, each ClientApp in a
        thread, and the clients train as one batched program
        (:mod:`clients.together`)."""
        messages = list(messages)
        if self.together and len(messages) > 1 and all(
                m.metadata.message_type == FIT for m in messages):
            replies = self._together(messages)
        elif self.workers > 1 and len(messages) > 1 and all(
                self.parallel(m) for m in messages):
            replies = self._parallel(messages)
        else:
            replies = [self.deliver(m) for m in messages]
        for msg, reply in zip(messages, replies, strict=True):
            self._replies[msg.metadata.message_id] = reply
        return [m.metadata.message_id for m in messages]

    def _together(self, messages: list[Message]) -> list[Message]:
        from concurrent.futures import ThreadPoolExecutor

        from clients import together

        with together.gathering(len(messages)) as cohort:
            def one(msg: Message) -> Message:
                try:
                    return self.deliver(msg)
                finally:
                    cohort.finished()

            with ThreadPoolExecutor(len(messages), thread_name_prefix="client") as pool:
                return list(pool.map(one, messages))

    def _parallel(self, messages: list[Message]) -> list[Message]:
        """Each message answered beside the others, the replies in the messages' order: in
        the worker processes when the runtime has them (:mod:`.client_workers`), else in
        ``workers`` threads (torch runs its kernels without the GIL); as Ray's workers
        answer a round, with the same bits (every client trains on ``client-threads``
        threads of its own, from its own generators)."""
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(self.workers, len(messages)),
                                    thread_name_prefix="client") as pool:
                return list(pool.map(self.deliver, messages))
        nodes = [self._stamp(m) for m in messages]
        known = [(m, self.contexts[n]) for m, n in zip(messages, nodes, strict=True)
                 if n in self.contexts]
        if self.keep_sent:
            self.sent += [m for m, _ in known]
        answers = iter(self.pool.answer(known))  # pickled there and back: copies
        replies = []
        for msg, node in zip(messages, nodes, strict=True):
            if node not in self.contexts:
                reply = self._unknown(msg)
            else:
                reply, context = next(answers)
                if context is not None:
                    self.contexts[node] = context
            reply.metadata.__dict__["_message_id"] = str(uuid4())
            replies.append(reply)
        return replies

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Every reply: the clients answer before this returns, so nothing times out."""
        return self.pull_messages(list(self.push_messages(messages)))

    def deliver(self, msg: Message) -> Message:
        """One message to its node's ClientApp, as Flower's simulation worker does it."""
        node = self._stamp(msg)
        if node not in self.contexts:
            reply = self._unknown(msg)
        else:
            delivered = msg
            delivered.content = _copy(msg.content)
            if self.keep_sent:
                self.sent.append(delivered)
            # the node works on a copy of its Context, kept only if the ClientApp succeeds
            with self._answering_here:
                reply, context = answer(self.client_app, delivered,
                                        _copy_context(self.contexts[node]))
            if context is not None:
                if not reply.has_error():  # (a ClientApp may return an error reply)
                    reply.content = _copy(reply.content)
                self.contexts[node] = context
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        return reply

    def _stamp(self, msg: Message) -> int:
        """Give ``msg`` what the SuperLink would (an id, the run, the sender); its node."""
        md = msg.metadata
        md.__dict__["_message_id"] = str(uuid4())
        md.__dict__["_run_id"] = self._run.run_id
        md.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
        return md.dst_node_id

    @staticmethod
    def _unknown(msg: Message) -> Message:
        return Message(Error(code=ErrorCode.NODE_UNAVAILABLE,
                             reason=f"no node {msg.metadata.dst_node_id} in this federation"),
                       reply_to=msg)


def serve(run_config: Mapping[str, Any], num_nodes: int) -> None:
    """Run the ServerApp's main on an in-process federation of ``num_nodes``."""
    import clients.app as client_app
    from clients.local_dp import warm_accounting
    from server.app import app as server_app
    from tasks.config import validate

    client_app.serve_in_process()
    # who is sending, as Flower's runtime tells a ServerApp process (flwr.supercore)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = (
        RUN_ID, SUPERLINK_NODE_ID, 1)
    grid = InProcessGrid(client_app.app, run_config, num_nodes)
    grid.together = bool(run_config.get("train-together", False))
    grid.workers = min(workers(run_config), num_nodes)  # no idle worker processes
    grid.parallel = lambda msg: client_app.answers_in_parallel(msg, run_config)
    # the run's epsilons are shared (privacy.dp.shared_memo) in a folder private to this
    # user: the one the link names (it removes it), whoever answers the clients; or, for
    # worker processes, one of our own
    own_memo = None
    if os.environ.get(MEMO_ENV):
        Path(os.environ[MEMO_ENV]).mkdir(mode=0o700, exist_ok=True)
    # what the run's clients import beyond the apps, once here, not in each worker
    configs = [validate(dict(c)) for c in _configs(run_config)]
    preload.load(preload.needed(configs))
    if grid.workers > 1 and not grid.together and \
            validate(dict(run_config)).resources.client_workers == "processes":
        if not os.environ.get(MEMO_ENV):
            own_memo = os.environ[MEMO_ENV] = str(owned_folder("epsilon", remove_at_exit=False))
        for cfg in configs:  # the clients' calibration and one-step PLDs, once for all
            warm_accounting(cfg, num_nodes)
        grid.pool = WorkerPool(client_app.app, grid.workers)  # before any torch kernel
    context = Context(run_id=RUN_ID, node_id=SUPERLINK_NODE_ID, node_config={},
                      state=RecordDict(), run_config=dict(run_config))
    try:
        server_app(grid, context)
    finally:
        if grid.pool is not None:
            grid.pool.close()
        if own_memo is not None:
            os.environ.pop(MEMO_ENV, None)
            shutil.rmtree(own_memo, ignore_errors=True)


def workers(run_config: Mapping[str, Any]) -> int:
    """How many clients answer at once: as on Ray, a client per ``client-cpus`` of this
    process's cores (and no more than its ``client-threads`` leave room for); one on a
    GPU, which each client has whole."""
    import torch

    from tasks.config import validate

    r = validate(dict(run_config)).resources
    if r.device == "cuda" or (r.device == "auto" and torch.cuda.is_available()):
        return 1
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")  # Linux
             else os.cpu_count() or 1)
    return max(1, cores // max(r.client_cpus, r.client_threads))


def _configs(run_config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The run's config, or every sweep cell's."""
    cells = str(run_config.get("sweep-cells") or "")
    if cells:
        return [c["config"] for c in json.loads(Path(cells).read_text())["cells"]]
    return [run_config]


def _run_folders(run_config: Mapping[str, Any]) -> list[Path]:
    """The run folders this child writes: the run's, or every sweep cell's."""
    return [Path(str(c["run-dir"])) for c in _configs(run_config) if c.get("run-dir")]


def main(argv: list[str]) -> int:
    """The child's entry (``PARENT_PID``): import what a run needs, then read the run
    (``{"run-config": FILE, "nodes": N}``) from stdin and serve it; exit at once on EOF.
    Before the run it answers pre-flight requests (``{"preflight": CONFIG_OR_LIST}``), each
    with one ``ANSWER`` line on stdout."""
    from .keeper import mark_orphaned

    parent = int(argv[0])
    run_config: dict[str, Any] = {}

    def stopped(signum: int, frame: object) -> None:  # the parent stops us: it records
        os._exit(128 + signum)

    def orphaned(signum: int, frame: object) -> None:  # the parent died (the kernel says
        if run_config:  # so with PARENT_DIED): nobody else will record our runs
            mark_orphaned(_run_folders(run_config), parent)
        with suppress(Exception):  # nor remove its private folders
            remove_stale_homes()
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(PARENT_DIED, orphaned)
    keep_freed_memory()  # before the client workers fork: theirs too
    warm_up()
    preload.load(argv[1:])  # what the CLI expects the run to need (Opacus for local DP)
    while True:
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        request = json.loads(line)
        if "preflight" not in request:
            break
        print(ANSWER + json.dumps(_preflight(request["preflight"])), flush=True)
    run_config.update(json.loads(Path(request["run-config"]).read_text()))
    try:
        serve(run_config, int(request["nodes"]))
    except Exception:  # the ServerApp recorded and printed it; the trace goes to the log
        traceback.print_exc()
        return 1
    return 0


def _preflight(given: dict | list) -> dict:
    """The pre-flight check's answer (:func:`experiments.preflight.checks.answer`) to a
    request the CLI sends before the run; a crash is answered too (its trace printed), so
    that the CLI says so and stops us."""
    from experiments.preflight.checks import answer

    try:
        return answer(given)
    except Exception as exc:
        traceback.print_exc()
        return {"crash": f"{type(exc).__name__}: {exc}"}


def warm_up() -> None:
    """Import what every run needs before it is asked for: the apps (torch, Flower); what
    only some runs need is in :mod:`.preload`."""
    import clients.app  # noqa: F401
    import server.app  # noqa: F401

if __name__ == "__main__":
    from .procs import exit_now

    exit_now(main(sys.argv[1:]))
