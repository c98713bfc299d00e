"""Strategies by name and the plain round runner, on real messages.

Sampling and aggregation order are checked with a grid reduced to node ids; training
with every registered strategy runs the real ClientApp in this process
(tests/inprocess.py). Inside the real simulation runtime the same code is covered by
the end-to-end tests.
"""

import time

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
)
from flwr.supercore.task_identity import TaskIdentity

from experiments.configs import allowed, check_registered
from server.evaluation import CentralEvaluator
from strategies.build import build_runner, build_strategy
from strategies.registry import STRATEGIES
from strategies.rounds import RoundFailed
from tasks import messages
from tasks.config import KEYS, ConfigError, validate
from tasks.splits import heldout_split, model_for
from tasks.training import resolve_device

from .inprocess import InProcessGrid, LocalGrid


@pytest.fixture(autouse=True)
def _task_identity():
    # The identity Flower's runtime gives a ServerApp process before messages are made.
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class NodeList(LocalGrid):
    """A grid reduced to its node ids; replies come from ``answer(message)``."""

    def __init__(self, ids, answer=None):
        self.ids = list(ids)
        self.answer = answer

    def get_node_ids(self):
        return list(self.ids)

    def send_and_receive(self, messages, *, timeout=None):
        return [self.answer(m) for m in messages]


@pytest.mark.parametrize("name, cls", [
    ("fedavg", FedAvg), ("fedprox", FedProx), ("fedadam", FedAdam), ("fedavgm", FedAvgM),
    ("fedmedian", FedMedian), ("fedtrimmedavg", FedTrimmedAvg),
])
def test_registry_builds_flower_strategies(name, cls):
    strategy = build_strategy(validate({"strategy": name, "fraction-train": 0.5,
                                        "min-train-clients": 3}), 10)
    assert type(strategy) is cls
    # a round waits only for min-train-clients connected nodes, not for every node (a
    # dead SuperNode would make Flower wait forever)
    assert strategy.fraction_train == 0.5 and strategy.min_available_nodes == 3
    # the schema (below strategies/) takes any name; --help lists the registered ones
    assert allowed(KEYS["strategy"]) == " | ".join(STRATEGIES)


def test_an_unknown_strategy_is_refused_where_the_strategies_are():
    cfg = validate({"strategy": "fedfoo"})
    for refuse in (check_registered, lambda c: build_strategy(c, 4)):
        with pytest.raises(ConfigError, match="strategy = 'fedfoo' must be one of fedavg, "
                                              "fedprox.*STRATEGIES.register|unknown strategy "
                                              "'fedfoo'; choose from fedavg"):
            refuse(cfg)


def test_registry_passes_strategy_parameters():
    cfg = validate({"strategy": "fedprox", "proximal-mu": 0.3})
    assert build_strategy(cfg, 4).proximal_mu == 0.3
    assert build_strategy(validate({"strategy": "fedadam"}), 4).eta == 0.1
    assert build_strategy(validate({"strategy": "fedadam", "server-lr": 0.01}), 4).eta == 0.01
    avgm = build_strategy(validate({"strategy": "fedavgm", "server-momentum": 0.7}), 4)
    assert avgm.server_momentum == 0.7 and avgm.server_learning_rate == 1.0
    assert build_strategy(validate({"strategy": "fedtrimmedavg", "trim-beta": 0.1}), 4).beta == 0.1


def _reply(ins, value, n=1, error=None):
    if error is not None:
        return Message(Error(code=0, reason=error), reply_to=ins)
    content = RecordDict({"arrays": ArrayRecord([np.full(2, value)]),
                          "metrics": MetricRecord({"num-examples": n, "train-loss": value})})
    return Message(content, reply_to=ins)


def _runner(cfg, grid, mapping, seed=None):
    cfg = cfg if seed is None else validate({**cfg.flat(), "seed": seed})
    return build_runner(cfg, grid, mapping)


def test_sampling_is_reproducible_across_node_id_assignments():
    cfg = validate({"fraction-train": 0.3})
    picks = []
    for node_ids in ([101, 7, 55, 9, 23, 64, 88, 12, 31, 40], [5, 6, 1, 2, 3, 4, 7, 8, 9, 10]):
        # same partitions, different random node ids (as in two Flower runs)
        mapping = {nid: pid for pid, nid in enumerate(node_ids)}
        grid = NodeList(reversed(node_ids), lambda m: _reply(m, 1.0))  # order must not matter
        picks.append(_runner(cfg, grid, mapping).run_round(1, ArrayRecord([np.zeros(2)])).log
                     .sampled)
    assert picks[0] == picks[1] and len(picks[0]) == 3

    def samples(seed):
        runner = _runner(cfg, NodeList(range(10), lambda m: _reply(m, 1.0)),
                         {n: n for n in range(10)}, seed)
        return [runner.run_round(rnd, ArrayRecord([np.zeros(2)])).log.sampled
                for rnd in (1, 2, 3)]

    assert samples(42) == samples(42)
    assert samples(42) != samples(43)
    assert len({tuple(s) for s in samples(42)}) > 1  # a new draw every round


def test_aggregation_order_round_log_and_message_type():
    mapping = {30: 0, 20: 1, 10: 2}
    answers = {10: (3.0, 2, None), 30: (1.0, 1, None), 20: (0.0, 1, "client exploded")}
    grid = NodeList(mapping, lambda m: _reply(m, *answers[m.metadata.dst_node_id]))
    sent = []
    grid.send_and_receive = lambda msgs, timeout=None: [
        sent.append(m) or _reply(m, *answers[m.metadata.dst_node_id]) for m in msgs]
    result = _runner(validate({}), grid, mapping).run_round(1, ArrayRecord([np.zeros(2)]))
    np.testing.assert_allclose(result.arrays.to_numpy_ndarrays()[0], [7 / 3, 7 / 3])
    log = result.log
    assert [c["partition-id"] for c in log.clients] == [0, 2]
    assert log.failures == [{"partition-id": 1, "node-id": 20, "error": "client exploded"}]
    assert log.sampled == [0, 1, 2]
    assert {m.metadata.message_type for m in sent} == {messages.FIT}  # routed to @app.train("fit")


def test_updates_with_nan_or_the_wrong_shape_or_dtype_are_refused_before_aggregation():
    mapping = {1: 0, 2: 1, 3: 2, 4: 3}
    bad = {2: np.array([np.nan, 1.0]), 3: np.zeros(3), 4: np.zeros(2, np.int64)}

    def answer(m):
        node = m.metadata.dst_node_id
        if node == 1:
            return _reply(m, 5.0)
        return Message(RecordDict({"arrays": ArrayRecord([bad[node]]),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=m)

    result = _runner(validate({}), NodeList(mapping, answer), mapping).run_round(
        1, ArrayRecord([np.zeros(2)]))
    np.testing.assert_allclose(result.arrays.to_numpy_ndarrays()[0], [5.0, 5.0])  # only node 1
    assert [c["partition-id"] for c in result.log.clients] == [0]
    reasons = {f["partition-id"]: f["error"] for f in result.log.failures}
    assert set(reasons) == {1, 2, 3}
    assert all(r.startswith("UpdateRejected: ") for r in reasons.values())
    assert "NaN or Inf" in reasons[1]
    assert "shape (3,)" in reasons[2] and "int64" in reasons[3]


def test_a_round_below_min_train_clients_after_failures_stops_the_run():
    # e.g. Ray actors died: 1 of 3 clients answers, the run asked for at least 2
    mapping = {1: 0, 2: 1, 3: 2}
    grid = NodeList(mapping, lambda m: _reply(m, 1.0) if m.metadata.dst_node_id == 1
                    else _reply(m, 0, error="ActorDiedError: the actor died"))
    runner = build_runner(validate({"num-clients": 3, "min-train-clients": 2}), grid, mapping)
    with pytest.raises(RoundFailed, match="only 1 of 3 sampled clients answered, fewer than "
                                          "min-train-clients = 2.*ActorDiedError"):
        runner.run_round(1, ArrayRecord([np.zeros(2)]))
    # with min-train-clients = 1 the same round goes on, the failures recorded
    ok = _runner(validate({}), grid, mapping).run_round(1, ArrayRecord([np.zeros(2)]))
    assert len(ok.log.clients) == 1 and len(ok.log.failures) == 2


def test_round_with_only_failures_raises_with_reasons():
    mapping = {1: 0, 2: 1}
    grid = NodeList(mapping, lambda m: _reply(m, 0, error=f"bad data {m.metadata.dst_node_id}"))
    with pytest.raises(RoundFailed, match="all 2 sampled clients failed.*bad data"):
        _runner(validate({}), grid, mapping).run_round(1, ArrayRecord([np.zeros(2)]))


def test_a_round_whose_every_update_is_nan_says_training_diverged_and_what_to_change():
    mapping = {1: 0, 2: 1}

    def nan_weights(m):
        return Message(RecordDict({"arrays": ArrayRecord([np.array([np.nan, 1.0])]),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=m)

    with pytest.raises(RoundFailed, match="NaN or Inf.*Training diverged.*lower lr.*smaller "
                                          "clipping-norm or a larger cohort"):
        _runner(validate({}), NodeList(mapping, nan_weights), mapping).run_round(
            1, ArrayRecord([np.zeros(2)]))
    # a failure of another kind does not get the hint
    grid = NodeList(mapping, lambda m: _reply(m, 0, error="bad data"))
    with pytest.raises(RoundFailed) as failed:
        _runner(validate({}), grid, mapping).run_round(1, ArrayRecord([np.zeros(2)]))
    assert "diverged" not in str(failed.value)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_trains_the_real_clients(name):
    # 4 clients of the embedded MNIST, 3 rounds through the real ClientApp: accuracy rises
    # well above chance (0.10) with every strategy, each with its own server-side rule.
    extra = {"fedadam": {"server-lr": 0.02}}.get(name, {})
    cfg = validate({"num-clients": 4, "strategy": name, "lr": 0.1, **extra})
    grid = InProcessGrid(cfg)
    torch.manual_seed(cfg.training.seed)  # as the ServerApp does: the same start every run
    model, _ = model_for(cfg)
    evaluate = CentralEvaluator(model, heldout_split(cfg), 512, resolve_device("cpu"))
    runner = build_runner(cfg, grid, grid.partition_of)
    arrays = ArrayRecord(model.state_dict())
    start = evaluate(arrays)["accuracy"]
    for rnd in (1, 2, 3):
        arrays = runner.run_round(rnd, arrays).arrays
    final = evaluate(arrays)["accuracy"]
    assert start < 0.2 and final > 0.5, (name, start, final)
    if name == "fedprox":  # the proximal term reached the clients
        assert all(m.content["config"]["proximal-mu"] == 0.01 for m in grid.sent)


def test_a_federation_short_of_clients_stops_with_a_cause_instead_of_waiting_forever():
    """Flower's own wait (``sample_nodes`` loops while fewer than ``min_available_nodes``
    are connected) ends once the run's grid has been short for round-timeout seconds."""
    from flwr.serverapp.strategy.strategy_utils import sample_nodes

    from strategies.grid import FederationGrid, TooFewClients

    nodes = NodeList([11, 12, 13])
    grid = FederationGrid(nodes, {11: 0, 12: 1, 13: 2}, min_nodes=2, wait_limit=1.5)
    assert sample_nodes(grid, 2, 2)[1] == [11, 12, 13]
    nodes.ids = [12]  # two SuperNodes died
    t0 = time.monotonic()
    with pytest.raises(TooFewClients, match=r"only 1 of the run's 3 clients .* client\(s\) 0, 2"):
        sample_nodes(grid, 2, 2)
    assert 1.5 < time.monotonic() - t0 < 10
    nodes.ids = [11, 12]  # enough again: the clock starts over
    assert list(grid.get_node_ids()) == [11, 12]
    nodes.ids = [12]
    assert list(grid.get_node_ids()) == [12]  # short again, but not yet for long


def test_every_secure_aggregation_value_has_a_protocol():
    from strategies.protocols import PROTOCOLS
    from tasks.config.sections import SECURE_AGGREGATION

    assert list(PROTOCOLS.names) == list(SECURE_AGGREGATION)
