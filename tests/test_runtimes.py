"""The runtimes: fedpriv's in-process one against Flower's simulation runtime (Ray).

The in-process runtime must be a runtime, not a shortcut: the same ServerApp and
ClientApp, messages copied, each node's Context kept across rounds (and left as it was
when its ClientApp raises), and, for the same seed, the same ledger as Ray's, for every
protocol. Runtimes that cannot serve a run are refused before any work.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

import fedpriv
from experiments.runtime.choice import choose
from experiments.runtime.client_workers import WorkerPool
from experiments.runtime.inprocess import InProcessGrid
from tasks.config import ConfigError, validate
from tasks.results.folder import read_run_info

from .conftest import REPO, ledger_json, run_cli
from .test_strategies import _task_identity  # noqa: F401  (fixture)


def _head() -> str:
    """The checkout's commit, asked of git directly."""
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()

def _counting_app() -> ClientApp:
    """A ClientApp that counts its messages in Context.state, scribbles on what it got,
    and raises when asked to."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        seen = int(context.state.config_records.get("n", ConfigRecord({"n": 0}))["n"]) + 1
        context.state.config_records["n"] = ConfigRecord({"n": seen})
        msg.content.config_records["config"]["scribbled"] = True
        if msg.content.config_records["config"].get("fail"):
            raise RuntimeError("asked to fail")
        if msg.content.config_records["config"].get("refuse"):  # an error reply, not raised
            return Message(Error(code=ErrorCode.UNKNOWN, reason="refused"), reply_to=msg)
        return Message(RecordDict({"metrics": ConfigRecord({"seen": seen})}), reply_to=msg)

    return app


def _send(grid: InProcessGrid, node: int, **config) -> tuple[Message, Message]:
    sent = Message(RecordDict({"config": ConfigRecord(dict(config))}), dst_node_id=node,
                   message_type="train")
    (reply,) = grid.send_and_receive([sent])
    return sent, reply


def test_inprocess_messages_are_copied_and_state_persists(_task_identity):  # noqa: F811
    grid = InProcessGrid(_counting_app(), {}, 2)
    node = next(iter(grid.get_node_ids()))
    content = RecordDict({"config": ConfigRecord({"x": 1})})
    kept = content.config_records["config"]
    msg = Message(content, dst_node_id=node, message_type="train")
    (first,) = grid.send_and_receive([msg])
    assert "scribbled" not in kept  # the client changed its copy, not the server's record
    assert first.metadata.src_node_id == node and first.metadata.reply_to_message_id
    _, second = _send(grid, node)
    assert second.content.config_records["metrics"]["seen"] == 2  # Context.state kept
    other = list(grid.get_node_ids())[1]
    assert _send(grid, other)[1].content.config_records["metrics"]["seen"] == 1  # per node


def test_a_run_keeps_no_delivered_message_unless_asked(_task_identity):  # noqa: F811
    """A run's grid holds no message once its reply is pulled (a 1,000-client round would
    otherwise keep every client's copy of the model); tests ask for ``sent``."""
    for keep in (False, True):
        grid = InProcessGrid(_counting_app(), {}, 2, keep_sent=keep)
        for node in grid.get_node_ids():
            _send(grid, node)
        assert len(grid.sent) == (2 if keep else 0)
        assert not grid._replies


def test_a_raising_clientapp_gives_an_error_reply_and_keeps_its_old_context(
        _task_identity):  # noqa: F811
    grid = InProcessGrid(_counting_app(), {}, 1)
    node = next(iter(grid.get_node_ids()))
    _send(grid, node)
    _, failed = _send(grid, node, fail=True)
    assert failed.has_error() and failed.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "asked to fail" in failed.error.reason
    # the failed message's count was not kept, as Ray's backend drops a failed Context
    assert _send(grid, node)[1].content.config_records["metrics"]["seen"] == 2


@pytest.mark.parametrize("processes", [False, True])
def test_a_round_answered_side_by_side_keeps_each_nodes_context_as_alone(
        _task_identity, processes):  # noqa: F811
    """Messages answered at once, in threads or worker processes: replies in order, each
    node's Context kept when its ClientApp returned (an error reply included) and not when
    it raised, what the server sent untouched, an unknown node answered unavailable."""
    grid = InProcessGrid(_counting_app(), {}, 3)
    grid.workers, grid.parallel = 2, lambda msg: True
    if processes:
        grid.pool = WorkerPool(grid.client_app, 2)
    try:
        nodes = list(grid.get_node_ids())
        for _ in range(2):
            sent = [Message(RecordDict({"config": ConfigRecord(dict(c))}), dst_node_id=n,
                            message_type="train")
                    for n, c in zip([*nodes, 999], [{}, {"fail": True}, {"refuse": True}, {}],
                                    strict=True)]
            kept = sent[0].content.config_records["config"]  # the server's own record
            replies = list(grid.send_and_receive(sent))
        assert [r.metadata.reply_to_message_id for r in replies] == \
            [m.metadata.message_id for m in sent]
        assert replies[0].content.config_records["metrics"]["seen"] == 2
        assert replies[1].error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        assert replies[2].error.reason == "refused"
        assert replies[3].error.code == ErrorCode.NODE_UNAVAILABLE
        assert "scribbled" not in kept
        counts = [grid.contexts[n].state.config_records.get("n") for n in nodes]
        assert [c["n"] if c else 0 for c in counts] == [2, 0, 2]
    finally:
        if grid.pool is not None:
            grid.pool.close()


def test_a_message_to_an_unknown_node_is_answered_unavailable(_task_identity):  # noqa: F811
    grid = InProcessGrid(_counting_app(), {}, 1)
    _, reply = _send(grid, 999)
    assert reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE


@pytest.mark.parametrize("values, cuda, supernodes, fragment", [
    ({"runtime": "inprocess"}, False, True, "Drop --supernodes"),
    ({"runtime": "inprocess", "device": "auto", "client-gpus": 0.25}, True, False,
     "Set client-gpus = 1"),
])
def test_a_runtime_that_cannot_serve_the_run_is_refused(values, cuda, supernodes, fragment):
    with pytest.raises(ConfigError, match=fragment):
        choose(validate(values), cuda=cuda, supernodes=supernodes)


def test_a_ray_cluster_with_the_inprocess_runtime_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="runtime = 'ray'"):
        validate({"runtime": "inprocess", "ray-address": "10.0.0.5:6379"})


@pytest.mark.parametrize("values, cuda, expected", [
    ({}, False, "inprocess"),
    ({}, True, "ray"),  # clients share the GPU (client-gpus 0.25 by default)
    ({"client-gpus": 1.0}, True, "inprocess"),
    ({"device": "cpu"}, True, "inprocess"),
    ({"ray-address": "10.0.0.5:6379"}, False, "ray"),
    ({"runtime": "ray"}, False, "ray"),
    ({"runtime": "inprocess", "client-gpus": 1.0}, True, "inprocess"),
])
def test_auto_picks_inprocess_unless_the_run_needs_ray(values, cuda, expected):
    assert choose(validate(values), cuda=cuda).name == expected
    if not {"runtime", "ray-address"} & set(values):  # those refuse --supernodes
        assert choose(validate(values), cuda=cuda, supernodes=True).name == "deployment"


@pytest.mark.parametrize("values, cuda, advice", [
    ({"runtime": "ray"}, False, "set runtime = 'inprocess'"),
    ({"ray-address": "10.0.0.5:6379"}, False, "leave ray-address empty"),
    ({}, True, "set client-gpus = 1"),  # GPU shares: Ray
])
def test_a_run_that_needs_ray_without_ray_installed_is_refused_first(
        monkeypatch, values, cuda, advice):
    """Ray missing (an environment installed without Flower's simulation extra): the run
    that would go to Ray is refused by the check every caller makes before any work,
    saying how to run in-process; runs that stay in-process are untouched."""
    monkeypatch.setitem(sys.modules, "ray", None)  # what import ray finds: nothing
    with pytest.raises(ConfigError, match="Ray is not installed") as refused:
        choose(validate(values), cuda=cuda)
    assert advice in str(refused.value)
    assert choose(validate({}), cuda=False).name == "inprocess"
    assert choose(validate({"client-gpus": 1.0}), cuda=True).name == "inprocess"


def test_the_cli_refuses_a_ray_run_without_ray_before_writing_anything(tmp_path):
    hide = tmp_path / "site"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")
    results = tmp_path / "results"
    res = run_cli("run", "--set", "runtime=ray", "--set", f"results-dir={results}",
                  env={"PYTHONPATH": str(hide)})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Ray is not installed" in res.stderr and "Traceback" not in res.stderr
    assert not results.exists() or not any(results.iterdir())


def _cell_dir(sweep, n):
    """A sweep cell's run folder by its index (the folder name goes on with its keys)."""
    (path,) = [p for p in (sweep / "cells").iterdir() if p.name.split("-")[0] == f"{n:02d}"]
    return path


def _ledger_view(run):
    return [(r["round"], r["test"], r["sampled"], r.get("privacy"),
             r["train"].get("loss")) for r in ledger_json(run)]


@pytest.mark.slow
def test_every_protocol_gives_the_same_ledger_in_process_and_on_ray(tmp_path):
    """One sweep (plain, local DP, central DP, SecAgg+, HE) run in-process and on Flower's
    simulation runtime: every cell's ledger (test metrics, sampled clients, epsilons,
    training loss) is the same, to the last digit (HE: to CKKS's precision)."""
    sweep = tmp_path / "runtimes.toml"
    sweep.write_text("""
name = "runtimes"
[fixed]
num-clients = 3
num-server-rounds = 2
save-model = false
batch-size = 64
[[cells]]
dp = "none"
[[cells]]
dp = "local"
noise-multiplier = 1.0
[[cells]]
dp = "central"
noise-multiplier = 0.01
[[cells]]
secure-aggregation = "secagg+"
[[cells]]
secure-aggregation = "he"
lr = 0.02
""")
    folders = {}
    for runtime in ("inprocess", "ray"):
        results = tmp_path / runtime
        res = run_cli("sweep", str(sweep), "--set", f"runtime={runtime}",
                      "--set", f"results-dir={results}", cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        (folders[runtime],) = (results / "sweeps").iterdir()
        where = "in-process" if runtime == "inprocess" else "on Flower's simulation runtime (Ray)"
        assert res.stdout.count(f"run(s) {where}") == 1, res.stdout
    for n in range(1, 6):
        a, b = (_cell_dir(folders[r], n) for r in ("inprocess", "ray"))
        assert read_run_info(a)["runtime"] == "inprocess" and read_run_info(b)["runtime"] == "ray"
        versions = read_run_info(a)["versions"]  # the code that made the result
        assert versions["fedpriv"] == fedpriv.__version__
        assert versions["fedpriv-commit"].split("+")[0] == _head()
        assert len(ledger_json(a)) == 2
        if n < 5:
            assert _ledger_view(a) == _ledger_view(b), n
            continue
        # CKKS encrypts with fresh randomness (TenSEAL seeds itself from the OS): two runs
        # of the same seed differ within its precision, whatever the runtime (the cell's
        # gentler lr: at 0.05 one client's second round sat where that 1e-6 noise in the
        # aggregate tipped its trajectory, 5% in the loss, in-process as on Ray)
        for x, y in zip(ledger_json(a), ledger_json(b), strict=True):
            assert x["sampled"] == y["sampled"]
            assert x["test"]["loss"] == pytest.approx(y["test"]["loss"], rel=1e-3)
            assert x["test"]["accuracy"] == pytest.approx(y["test"]["accuracy"], abs=2e-3)


@pytest.mark.parametrize("values, fragment", [
    ({"train-together": True, "dp": "local", "noise-multiplier": 1.0}, "dp = 'local'"),
    ({"train-together": True, "runtime": "ray"}, "runtime = 'ray'"),
    ({"train-together": True, "secure-aggregation": "secagg+"}, "secure-aggregation"),
    ({"train-together": True, "strategy": "fedprox"}, "fedprox"),
])
def test_train_together_refuses_what_the_batched_program_does_not_do(values, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate(values)


def test_train_together_refuses_a_run_that_would_go_to_ray():
    with pytest.raises(ConfigError, match="needs the in-process runtime"):
        choose(validate({"train-together": True}), cuda=True)  # GPU shares: Ray
    assert choose(validate({"train-together": True, "client-gpus": 1.0}),
                  cuda=True).name == "inprocess"


def test_a_cohort_trains_its_joined_clients_and_does_not_wait_for_those_that_left():
    """Three ClientApp threads: two join the cohort, one finishes without training (it
    declined); the two get train_cohort's result, the same as training each alone."""
    import threading

    import torch

    from clients import together
    from tasks.cohort_training import CohortTraining
    from tasks.models import build_model
    from tasks.training import make_loader, sgd, train_epochs

    torch.manual_seed(0)
    data = [(torch.randn(40, 1, 28, 28), torch.randint(0, 10, (40,))) for _ in range(2)]
    training = CohortTraining(lr=0.05, batch_size=16, momentum=0.5)
    start = build_model("small-cnn", (1, 28, 28), 10).state_dict()
    got: dict[int, dict] = {}
    with together.gathering(3) as cohort:
        def client(k: int) -> None:
            try:
                if k < 2:
                    model = build_model("small-cnn", (1, 28, 28), 10)
                    model.load_state_dict(start)
                    cohort.join(model, *data[k], seed=k, training=training,
                                device=torch.device("cpu"))
                    got[k] = model.state_dict()
            finally:
                cohort.finished()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and sorted(got) == [0, 1]
    for k in range(2):  # the sequential reference
        model = build_model("small-cnn", (1, 28, 28), 10)
        model.load_state_dict(start)
        train_epochs(model, make_loader(*data[k], 16, k), sgd(model, 0.05, 0.5), 1,
                     torch.device("cpu"))
        for name, value in model.state_dict().items():
            assert torch.allclose(got[k][name], value, atol=1e-5, rtol=1e-4), name


@pytest.mark.slow
def test_train_together_gives_the_sequential_ledger_to_float_rounding(tmp_path):
    """The same run with the round's clients trained one after another and as one batched
    program. From the same start each client's training agrees to float rounding (its
    mean training loss here; tests/test_cohort_training.py compares the weights), but the
    batched kernels round differently from the sequential ones, and local SGD amplifies
    the last bits (a 1e-7 nudge of one client's start moved its trained weights by 1e-2):
    the first round's test loss differed by 4e-4 relative on an AVX-512 Xeon and by under
    1e-5 on other CPUs, so the model's metrics are compared within 3e-3, and the last
    round as two seeds' worth of noise would, not digit for digit."""
    sweep = tmp_path / "together.toml"
    sweep.write_text("""
name = "together"
[fixed]
num-clients = 4
num-server-rounds = 2
save-model = false
[grid]
train-together = [false, true]
""")
    res = run_cli("sweep", str(sweep), "--set", f"results-dir={tmp_path / 'r'}", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (folder,) = (tmp_path / "r" / "sweeps").iterdir()
    alone, together_ = (ledger_json(_cell_dir(folder, n)) for n in (1, 2))
    assert len(alone) == len(together_) == 2
    assert [r["sampled"] for r in alone] == [r["sampled"] for r in together_]
    first, batched = alone[0], together_[0]
    for a, b in zip(alone[0]["clients"], together_[0]["clients"], strict=True):
        assert b["train-loss"] == pytest.approx(a["train-loss"], rel=1e-4)
    for key in ("loss", "accuracy"):
        assert batched["test"][key] == pytest.approx(first["test"][key], rel=3e-3)
        assert batched["train"][key] == pytest.approx(first["train"][key], rel=3e-3)
    assert together_[-1]["test"]["accuracy"] == pytest.approx(alone[-1]["test"]["accuracy"],
                                                              abs=0.03)


class _PidNoting:
    """The ClientApp, noting in ``path`` the process that answered each message."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, msg, context):
        import clients.app as client_app

        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return client_app.app(msg, context)


def _run_in_threads(tmp_path, name: str, workers: int, processes: bool = False,
                    **keys) -> tuple[list[dict], int]:
    """One real run of the ServerApp on the in-process grid with ``workers`` clients
    answering at once; its ledger (without timings) and the most messages that were being
    answered at once (with ``processes``: in worker processes, and how many of them
    other than this one answered training messages)."""
    import threading

    from flwr.app import RecordDict

    import clients.app as client_app
    from server.app import run_one

    from .inprocess import InProcessGrid as TestGrid

    cfg = validate({"num-clients": 4, "num-server-rounds": 2, "save-model": False,
                    "run-dir": str(tmp_path / name), **keys})
    grid = TestGrid(cfg, simulated=True)
    grid.workers = workers
    grid.parallel = lambda msg: client_app.answers_in_parallel(msg, cfg.flat())
    busy, most, lock = [0], [0], threading.Lock()
    deliver = grid.deliver

    def counted(msg):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            return deliver(msg)
        finally:
            with lock:
                busy[0] -= 1

    grid.deliver = counted
    answered_in = tmp_path / f"{name}.pids"
    if processes:
        grid.pool = WorkerPool(_PidNoting(answered_in), workers)
    try:
        run_one(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                              run_config=cfg.flat()), cfg)
    finally:
        if grid.pool is not None:
            grid.pool.close()
    if processes:
        pids = set(answered_in.read_text().split())
        most[0] = len(pids - {str(os.getpid())})
    timeless = [{**{k: v for k, v in r.items() if k != "time"},
                 "clients": [{k: v for k, v in c.items() if not k.endswith("-s")}
                             for c in r["clients"]]}
                for r in ledger_json(tmp_path / name)]
    return timeless, most[0]


def test_clients_answering_in_threads_or_worker_processes_give_the_same_bits(
        tmp_path, _task_identity):  # noqa: F811
    """A plain round's clients train in threads or forked worker processes (as many at
    once as the cores allow, as on Ray) with the ledger of one after another, digit for
    digit: each has one torch thread and generators of its own (batches; DP-SGD's noise).
    An anonymizer, fitted on first use from the global generators, is answered one at a
    time."""
    for name, keys in (("plain", {}), ("dp", {"dp": "local", "noise-multiplier": 1.0})):
        alone, one = _run_in_threads(tmp_path, f"{name}-alone", 1, **keys)
        threaded, most = _run_in_threads(tmp_path, f"{name}-threads", 2, **keys)
        assert one == 1 and most == 2  # the clients really did train at the same time
        assert len(alone) == 2 and threaded == alone, name
        forked, workers = _run_in_threads(tmp_path, f"{name}-processes", 2, processes=True,
                                          **keys)
        assert workers == 2 and forked == alone, name  # in two worker processes
    _, most = _run_in_threads(tmp_path, "gaussian", 2, anonymizer="gaussian")
    assert most == 1


def test_the_cli_names_what_its_runs_need_when_it_starts_the_runtime_child(tmp_path):
    """Opacus for local DP (and a DP-trained CVAE), torch's optimizers where one is built,
    go on the child's command line, which imports them before it runs the pre-flight
    check (serve() loads the same from the run's configs before its workers fork);
    nothing extra for a plain run; an unknown name is ignored."""
    import sys

    from experiments.runtime import preload
    from experiments.runtime.inprocess_link import InProcessLink

    assert preload.needed([validate({})]) == []
    assert preload.needed([validate({}), validate({"dp": "local"})]) == [
        "opacus", "torch-optimizers"]
    assert preload.needed([validate({"anonymizer": "cvae", "cvae-epsilon": 8.0,
                                      "features": "embeddings"})]) == [
        "opacus", "torch-optimizers"]
    assert preload.needed([validate({"client-optimizer": "adam"})]) == ["torch-optimizers"]
    with InProcessLink() as link:
        link.start([validate({"dp": "local"})])
        assert link.proc is not None and link.proc.args[-2:] == ["opacus", "torch-optimizers"]
    code = ("import sys; from experiments.runtime import preload; "
            "preload.load(['nothing-known', 'opacus']); print('opacus' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "True"


def test_the_waiting_runtime_child_runs_the_pre_flight_check(tmp_path, monkeypatch):
    """The pre-flight check runs in the in-process runtime's child, which imports torch,
    the apps and Opacus once for both: its answer is the one a child of its own gives, a
    refusal is the same ConfigError, a run starts no other child, and a child that dies
    before answering is said to have crashed, with its exit code."""
    from experiments import api
    from experiments.preflight import isolated
    from experiments.runtime.inprocess_link import InProcessLink

    dp = validate({"dp": "local", "noise-multiplier": 1.0})
    with InProcessLink() as link:
        link.start([dp])
        inside = isolated.preflight_isolated(dp, checker=link.checker())
        assert inside == isolated.preflight_isolated(dp)  # a child of its own
        with pytest.raises(ConfigError, match="is not below 1/N"):
            isolated.preflight_isolated(validate({"dp": "local", "delta": 0.1}), checker=link)
        assert link.proc is not None
        link.proc.kill()  # (its own session: by PID)
        link.proc.wait()
        with pytest.raises(RuntimeError, match=r"crashed \(exit code -9\)"):
            isolated.preflight_isolated(dp, checker=link)
        assert link.checker() is None  # the next run starts a new child

    def own_child(given: object, env: object) -> tuple[dict, int]:
        raise AssertionError("the pre-flight check started a child of its own")

    monkeypatch.setattr(isolated, "_child", own_child)
    res = api.run_config(validate({"num-clients": 2, "num-server-rounds": 1,
                                   "results-dir": str(tmp_path)}), echo=None)
    assert res.ok and res.accuracy is not None
