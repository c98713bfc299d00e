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


def _round(strategy, rnd, update, n=3, reply=None, examples=None):
    """Send a zero model; client i answers zero + ``update`` (or ``update[i]`` for a list)
    and reports ``examples[i]`` examples (100 each by default); return the new model."""
    msgs = list(strategy.configure_train(rnd, ArrayRecord([np.zeros(DIM, np.float32)]),
                                         ConfigRecord(), NodeList(range(n))))
    replies = []
    for i, m in enumerate(msgs[: reply if reply is not None else len(msgs)]):
        own = update[i] if isinstance(update, list) else update
        num = examples[i] if examples is not None else 100
        content = RecordDict({"arrays": ArrayRecord([own.astype(np.float32)]),
                              "metrics": MetricRecord({"num-examples": num, "dp-weight": 1})})
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

    # DP-FedAvg weights clients equally, whatever num-examples they report. Little noise
    # so that the weighting shows: the model's mean over DIM coordinates has noise std
    # z S / m / sqrt(DIM) = 1.5e-5; the example-weighted and equal-weight means of these
    # updates differ by 3.2e-4 (21 such stds).
    z, s, m = 0.05, 0.5, 3
    strategy = build_strategy(_cfg(**{"noise-multiplier": z, "clipping-norm": s}), 3)
    levels = [1e-4, 4e-4, 8e-4]  # norms 0.055, 0.22, 0.44: all below S, none clipped
    updates = [np.full(DIM, c) for c in levels]
    assert all(np.linalg.norm(u) < s for u in updates)
    examples = [10, 100, 1000]
    out = _round(strategy, 1, updates, examples=examples)
    equal = np.mean(levels)
    weighted = np.average(levels, weights=examples)
    tol = 5 * z * s / m / np.sqrt(DIM)
    assert abs(weighted - equal) > 4 * tol  # the test can tell the two apart
    assert abs(out.mean() - equal) < tol
    noise = out - np.mean(updates, axis=0)
    assert abs(noise.std() / (z * s / m) - 1) < 0.01


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

    # The clients clip (clients/app.py); the server must average what they send as it
    # is and add N(0, (z S / m)^2). Client 3 sends an update of norm 3.0 > S: a server
    # that clipped again would pull the mean down by 6.1e-4 (50 stds of the mean).
    z, s, m = 0.01, 2.0, 3
    strategy = build_strategy(_cfg(**{"central-clipping": "client-fixed",
                                      "noise-multiplier": z, "clipping-norm": s}), 3)
    norms = [0.5, 1.5, 3.0]
    updates = [np.full(DIM, r / np.sqrt(DIM)) for r in norms]
    out = _round(strategy, 1, updates, examples=[10, 100, 1000])
    sent_mean = np.mean(updates, axis=0)
    server_clipped = np.mean([u * min(1.0, s / np.linalg.norm(u)) for u in updates], axis=0)
    tol = 5 * z * s / m / np.sqrt(DIM)
    assert abs(sent_mean.mean() - server_clipped.mean()) > 4 * tol
    assert abs(out.mean() - sent_mean.mean()) < tol
    noise = out - sent_mean
    assert abs(noise.std() / (z * s / m) - 1) < 0.02


def test_central_dp_config_errors():
    with pytest.raises(ConfigError, match="needs strategy = 'fedavg'"):
        validate({"dp": "central", "strategy": "fedmedian"})
    with pytest.raises(ConfigError, match="adds no noise"):
        validate({"dp": "central", "noise-multiplier": 0})
    with pytest.raises(ConfigError, match="clipping-norm = 0 must be > 0"):
        validate({"clipping-norm": 0})
    with pytest.raises(ConfigError, match="needs client-side clipping"):
        validate({"dp": "central", "secure-aggregation": True})



@pytest.mark.parametrize("scale", [0.1, 0.9, 7.0])
def test_client_clip_update_bounds_the_change_by_s_and_reports_the_norm_before(scale):
    from clients.app import _clip_update

    rng = np.random.default_rng(0)
    old = [rng.normal(size=(4, 5)), rng.normal(size=7)]
    step = [rng.normal(size=(4, 5)), rng.normal(size=7)]
    step_norm = np.sqrt(sum(np.sum(d**2) for d in step))
    step = [d * scale / step_norm for d in step]  # ||new - old|| = scale
    new = [o + d for o, d in zip(old, step, strict=True)]
    s = 1.0
    before = _clip_update(new, old, s)
    assert before == pytest.approx(scale, rel=1e-9)
    diff = [n - o for n, o in zip(new, old, strict=True)]  # clipped in place
    after = np.sqrt(sum(np.sum(d**2) for d in diff))
    assert after == pytest.approx(min(scale, s), rel=1e-9)
    factor = min(1.0, s / scale)  # the direction is kept
    for d, sent in zip(diff, step, strict=True):
        np.testing.assert_allclose(d, sent * factor, rtol=1e-9, atol=1e-12)
