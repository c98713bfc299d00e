"""The in-process runtime's client worker processes: a dead worker is reported, not
waited for, and no worker outlives the runtime, even when the runtime is SIGKILLed."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import psutil
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from experiments.runtime.client_workers import WorkerPool
from strategies.rounds import WorkerLost

from .conftest import REPO
from .test_strategies import _task_identity  # noqa: F401  (fixture)


def _echo(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"r": ConfigRecord({"pid": os.getpid()})}), reply_to=msg)


def _dies(msg: Message, context: Context) -> Message:
    os._exit(3)  # as the kernel's OOM killer or a crash in native code would end it


def _messages(n: int) -> list[tuple[Message, Context]]:
    return [(Message(RecordDict(), 1000 + i, "train", group_id="1"),
             Context(run_id=1, node_id=1000 + i, node_config={}, state=RecordDict(),
                     run_config={})) for i in range(n)]


def test_worker_processes_answer_in_order_with_their_context(_task_identity):  # noqa: F811
    pool = WorkerPool(_echo, 2)
    try:
        items = _messages(9)
        answers = pool.answer(items)
        assert [r.metadata.reply_to_message_id for r, _ in answers] == \
            [m.metadata.message_id for m, _ in items]
        pids = {r.content.config_records["r"]["pid"] for r, _ in answers}
        assert pids <= set(pool.pids) and os.getpid() not in pids
        assert all(c is not None and c.node_id == m.metadata.dst_node_id
                   for (m, _), (_, c) in zip(items, answers, strict=True))
    finally:
        pool.close()
    assert not [p for p in pool.pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_dead_worker_is_reported_as_a_lost_worker(_task_identity):  # noqa: F811
    pool = WorkerPool(_dies, 2)
    try:
        with pytest.raises(WorkerLost, match="client worker process .* died"):
            pool.answer(_messages(4))
    finally:
        pool.close()


def test_workers_die_with_a_sigkilled_runtime(tmp_path):
    # a process that starts a pool and is then SIGKILLed, as a runtime can be: the kernel
    # ends its workers (they would otherwise wait on their task queue forever)
    script = (
        "import sys, time\n"
        "from experiments.runtime.client_workers import WorkerPool\n"
        "def app(msg, context): return msg\n"
        "pool = WorkerPool(app, 2)\n"
        "print(*pool.pids, flush=True)\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    pids: list[int] = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # a generous bound
        assert ready, "the pool did not start"
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:  # the workers this test's process started, should they be left
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
