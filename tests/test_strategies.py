"""Strategy registry and the Observed wrapper.

The wrapper is driven here with Flower's real Message objects; the grid is a fixed
list of node ids (the only thing sampling reads). Its behaviour inside the real
simulation runtime is covered by the end-to-end tests.
"""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
)
from flwr.supercore.task_identity import TaskIdentity

from strategies import Observed, RoundFailed, build_strategy
from strategies.registry import weighted_metrics
from tasks.config import validate


@pytest.fixture(autouse=True)
def _task_identity():
    # The identity Flower's runtime gives a ServerApp process before messages are made.
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class NodeList(Grid):
    """A grid reduced to its node ids."""

    def __init__(self, ids):
        self.ids = list(ids)

    def get_node_ids(self):
        return list(self.ids)

    def set_run(self, run):
        raise AssertionError("not used")

    @property
    def run(self):
        raise AssertionError("not used")

    def create_message(self, *a, **k):
        raise AssertionError("not used")

    def push_messages(self, messages):
        raise AssertionError("not used")

    def pull_messages(self, message_ids):
        raise AssertionError("not used")

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("not used")


@pytest.mark.parametrize("name, cls", [
    ("fedavg", FedAvg), ("fedprox", FedProx), ("fedadam", FedAdam), ("fedavgm", FedAvgM),
    ("fedmedian", FedMedian), ("fedtrimmedavg", FedTrimmedAvg),
])
def test_registry_builds_flower_strategies(name, cls):
    strategy = build_strategy(validate({"strategy": name, "fraction-train": 0.5}), 10)
    assert type(strategy) is cls
    assert strategy.fraction_train == 0.5 and strategy.min_available_nodes == 10


def test_registry_passes_strategy_parameters():
    cfg = validate({"strategy": "fedprox", "proximal-mu": 0.3})
    assert build_strategy(cfg, 4).proximal_mu == 0.3
    assert build_strategy(validate({"strategy": "fedadam"}), 4).eta == 0.1
    assert build_strategy(validate({"strategy": "fedadam", "server-lr": 0.01}), 4).eta == 0.01
    avgm = build_strategy(validate({"strategy": "fedavgm", "server-momentum": 0.7}), 4)
    assert avgm.server_momentum == 0.7 and avgm.server_learning_rate == 1.0
    assert build_strategy(validate({"strategy": "fedtrimmedavg", "trim-beta": 0.1}), 4).beta == 0.1


def test_weighted_metrics_average_only_loss_and_accuracy():
    recs = [RecordDict({"m": MetricRecord({"num-examples": 1, "train-loss": 1.0,
                                           "partition-id": 0})}),
            RecordDict({"m": MetricRecord({"num-examples": 3, "train-loss": 3.0,
                                           "partition-id": 7})})]
    assert dict(weighted_metrics(recs, "num-examples")) == {"train-loss": 2.5}
    for r in recs:  # central DP averages models by dp-weight; metrics stay per example
        next(iter(r.metric_records.values()))["dp-weight"] = 1
    assert dict(weighted_metrics(recs, "dp-weight")) == {"train-loss": 2.5}


def _train_messages(observed, grid, rnd=1):
    return observed.configure_train(rnd, ArrayRecord([np.zeros(2)]), ConfigRecord(), grid)


def _reply(ins, pid, value, n=1):
    content = RecordDict({"arrays": ArrayRecord([np.full(2, value)]),
                          "metrics": MetricRecord({"num-examples": n, "partition-id": pid,
                                                   "train-loss": value})})
    return Message(content, reply_to=ins)


def test_sampling_is_reproducible_across_node_id_assignments():
    cfg = validate({"fraction-train": 0.3})
    picks = []
    for node_ids in ([101, 7, 55, 9, 23, 64, 88, 12, 31, 40], [5, 6, 1, 2, 3, 4, 7, 8, 9, 10]):
        # same partitions, different random node ids (as in two Flower runs)
        mapping = {nid: pid for pid, nid in enumerate(node_ids)}
        observed = Observed(build_strategy(cfg, 10), 42, mapping)
        grid = NodeList(reversed(node_ids))  # arrival order must not matter either
        _train_messages(observed, grid)
        picks.append(observed.current.sampled)
    assert picks[0] == picks[1] and len(picks[0]) == 3

    def samples(seed):
        observed = Observed(build_strategy(cfg, 10), seed, {n: n for n in range(10)})
        out = []
        for rnd in (1, 2, 3):
            _train_messages(observed, NodeList(range(10)), rnd)
            out.append(observed.current.sampled)
        return out

    assert samples(42) == samples(42)
    assert samples(42) != samples(43)
    assert len({tuple(s) for s in samples(42)}) > 1  # a new draw every round


def test_aggregation_order_and_round_log():
    mapping = {30: 0, 20: 1, 10: 2}
    observed = Observed(build_strategy(validate({}), 3), 0, mapping)
    ins = {m.metadata.dst_node_id: m for m in _train_messages(observed, NodeList(mapping))}
    replies = [_reply(ins[10], 2, 3.0, 2), _reply(ins[30], 0, 1.0, 1),
               Message(Error(code=0, reason="client exploded"), reply_to=ins[20])]
    arrays, metrics = observed.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays.to_numpy_ndarrays()[0], [7 / 3, 7 / 3])
    log = observed.current
    assert [c["partition-id"] for c in log.clients] == [0, 2]
    assert log.failures == [{"partition-id": 1, "node-id": 20, "error": "client exploded"}]
    assert log.sampled == [0, 1, 2] and metrics["train-loss"] == pytest.approx(7 / 3)


def test_round_with_only_failures_raises_with_reasons():
    mapping = {1: 0, 2: 1}
    observed = Observed(build_strategy(validate({}), 2), 0, mapping)
    ins = list(_train_messages(observed, NodeList(mapping)))
    replies = [Message(Error(code=0, reason=f"bad data {i}"), reply_to=m)
               for i, m in enumerate(ins)]
    with pytest.raises(RoundFailed, match="all 2 sampled clients failed.*bad data"):
        observed.aggregate_train(1, replies)
