"""Central DP-FedAvg: noise matches its formula, accounting matches Flower's accountant.

Flower's DP wrappers run here on real Flower Message objects (the grid is reduced to
its node ids, as in test_strategies).
"""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
)

from strategies import build_strategy
from strategies.central_dp import CentralDP, PrivacyBudgetReached
from tasks.config import ConfigError, validate

from .test_strategies import NodeList, _task_identity  # noqa: F401  (fixture)

DIM = 300_000


def _cfg(**kw):
    return validate({"dp": "central", "num-clients": 3, "min-train-clients": 3, **kw})


def _round(strategy, rnd, update, n=3, reply=None):
    """Send a zero model; every client answers zero + ``update``; return the new model."""
    msgs = list(strategy.configure_train(rnd, ArrayRecord([np.zeros(DIM, np.float32)]),
                                         ConfigRecord(), NodeList(range(n))))
    replies = []
    for m in msgs[: reply if reply is not None else len(msgs)]:
        content = RecordDict({"arrays": ArrayRecord([update.astype(np.float32)]),
                              "metrics": MetricRecord({"num-examples": 100, "dp-weight": 1})})
        replies.append(Message(content, reply_to=m))
    arrays, _ = strategy.aggregate_train(rnd, replies)
    return None if arrays is None else arrays.to_numpy_ndarrays()[0]


def test_server_side_noise_std_matches_dp_fedavg_formula():
    z, s, m = 1.3, 0.5, 3
    strategy = build_strategy(_cfg(**{"noise-multiplier": z, "clipping-norm": s}), 3)
    assert isinstance(strategy, CentralDP)
    update = np.full(DIM, 0.01)  # norm 5.48: every client is clipped to norm S
    out = _round(strategy, 1, update)
    clipped = update * (s / np.linalg.norm(update))
    noise = out - clipped
    assert abs(noise.std() / (z * s / m) - 1) < 0.01
    assert abs(noise.mean()) < 5 * z * s / m / np.sqrt(DIM)


def test_epsilon_composes_every_released_round_like_flowers_accountant():
    cfg = _cfg(**{"noise-multiplier": 1.0})
    strategy = build_strategy(cfg, 3)
    ref = RdpAccountant(PrivacyConfig(target_delta=1 / 30, population_size=3,
                                      neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                      sampling_method=SamplingMethod.NO_AMPLIFICATION))
    for rnd in (1, 2, 3):
        _round(strategy, rnd, np.full(DIM, 1e-4))
        ref.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=3, population_size=3))
        assert strategy.privacy.epsilon == pytest.approx(ref.get_epsilon(1 / 30))
    assert strategy.privacy.describe()["releases"] == 3


def test_a_round_with_missing_replies_is_not_released():
    strategy = build_strategy(_cfg(), 3)
    assert _round(strategy, 1, np.full(DIM, 1e-4), reply=2) is None
    assert strategy.privacy.epsilon == 0.0 and strategy.privacy.accountant.num_releases == 0


def test_max_epsilon_stops_before_the_round_that_would_exceed_it():
    probe = build_strategy(_cfg(), 3)
    _round(probe, 1, np.full(DIM, 1e-4))
    eps1 = probe.privacy.epsilon
    _round(probe, 2, np.full(DIM, 1e-4))
    eps2 = probe.privacy.epsilon
    strategy = build_strategy(_cfg(**{"max-epsilon": (eps1 + eps2) / 2}), 3)
    _round(strategy, 1, np.full(DIM, 1e-4))
    with pytest.raises(PrivacyBudgetReached, match="past max-epsilon"):
        _round(strategy, 2, np.full(DIM, 1e-4))
    assert strategy.privacy.epsilon == pytest.approx(eps1)


def test_client_side_clipping_sends_the_norm_and_only_adds_noise():
    strategy = build_strategy(_cfg(**{"central-clipping": "client-fixed",
                                      "clipping-norm": 2.0}), 3)
    msgs = list(strategy.configure_train(1, ArrayRecord([np.zeros(4, np.float32)]),
                                         ConfigRecord(), NodeList(range(3))))
    assert all(m.content["config"]["clipping_norm"] == 2.0 for m in msgs)


def test_central_dp_config_errors():
    with pytest.raises(ConfigError, match="needs strategy = 'fedavg'"):
        validate({"dp": "central", "strategy": "fedmedian"})
    with pytest.raises(ConfigError, match="adds no noise"):
        validate({"dp": "central", "noise-multiplier": 0})
    with pytest.raises(ConfigError, match="clipping-norm = 0 must be > 0"):
        validate({"clipping-norm": 0})
    with pytest.raises(ConfigError, match="needs client-side clipping"):
        validate({"dp": "central", "secure-aggregation": True})
