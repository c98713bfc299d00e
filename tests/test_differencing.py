"""Secure aggregation against an active server that differences overlapping cohorts.

The adversary is the server: it picks the cohorts. It sends one model to the cohorts
{0, 1}, {0, 2} and {1, 2} (in three rounds of a run, or in round 1 of three restarts of
it) and computes (S01 + S12 - S02) / 2 = client 1's update, through the project's real
client handlers (HE: TenSEAL and Ed25519 after an honest key setup; SecAgg+: Flower's
workflow and mod). Each test first shows the attack recover the update with the
contribution record removed (``contribution-record = false``), then shows the clients
refuse the second cohort with it in place (:mod:`clients.contributions`). What the record
leaves open (a server that moves the model beyond the radius) is shown too, so the docs'
claim about it stays true.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)

from clients import secagg_guard
from clients.contributions import ContributionRecord, ContributionRefused
from strategies.grid import FederationGrid
from strategies.protocols.he import _signed
from strategies.protocols.secagg import SecAggProtocol
from strategies.rounds import RoundLog
from tasks import messages
from tasks.config import validate
from tasks.splits import model_for

from .inprocess import NODE_ID_BASE, InProcessGrid
from .test_he_cohort import Attacker
from .test_strategies import _task_identity  # noqa: F401  (fixture)

COHORTS = ((0, 1), (0, 2), (1, 2))


def _host(record: bool) -> dict:
    """A real SuperNode's node config: its host keeps the record (the default) or, for
    the mutation, turns it off (the operator's run config cannot)."""
    return {} if record else {"contribution-record": "false"}


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def _initial(cfg) -> ArrayRecord:
    """The model the server sends throughout: one fixed initial model."""
    torch.manual_seed(cfg.training.seed)
    return ArrayRecord(model_for(cfg)[0].state_dict())


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _truth(cfg, arrays: ArrayRecord, pid: int) -> np.ndarray:
    """Client ``pid``'s update on ``arrays`` in round 1 with the run's public seeds: the
    ground truth, computed by the scorer with a plain training message (never seen by
    the attacker)."""
    plain = validate({**cfg.flat(), "secure-aggregation": "off", "dp": "none"})
    grid = InProcessGrid(plain)
    config = ConfigRecord({"server-round": 1, "local-epochs": plain.training.local_epochs})
    (reply,) = grid.send_and_receive([Message(RecordDict({"arrays": arrays, "config": config}),
                                              message_type=messages.FIT,
                                              dst_node_id=NODE_ID_BASE + pid)])
    new = reply.content.array_records["arrays"].to_numpy_ndarrays()
    return _flat(new) - _flat(arrays.to_numpy_ndarrays())


# ---------------------------------------------------------------- HE


def _he_round(attacker: Attacker, server_round: int, members: tuple[int, ...]
              ) -> tuple[np.ndarray, float] | str:
    """Train ``members`` on the attacker's model and have the first decrypt their sum:
    (sum of weighted updates, total weight), or the first refusal's reason."""
    ups = []
    for p in members:
        reply = attacker.train(p, server_round, decryptor=members[0], cohort=members)
        if reply.has_error():
            return reply.error.reason
        ups.append(_signed(reply, p))
    out = attacker.decrypt(members[0], server_round, ups, cohort=members)
    if out.has_error():
        return out.error.reason
    values = out.content.array_records["arrays"]["sum"].numpy()
    return values[:-1].astype(np.float64), float(values[-1])


def _difference(sums: dict) -> np.ndarray:
    """(S01 + S12 - S02) / 2, divided by client 1's weight got the same way."""
    total = sums[(0, 1)][0] + sums[(1, 2)][0] - sums[(0, 2)][0]
    weight = sums[(0, 1)][1] + sums[(1, 2)][1] - sums[(0, 2)][1]
    return total / weight


@pytest.mark.parametrize("record", [False, True])
def test_he_differencing_over_rounds(_task_identity, record):  # noqa: F811
    attacker = Attacker(node_config=lambda p: _host(record))
    attacker.arrays = _initial(attacker.cfg)
    got = {c: _he_round(attacker, r, c) for r, c in enumerate(COHORTS, start=1)}
    if not record:  # the mutation: the attack recovers client 1's update
        estimate = _difference(got)
        truth = _truth(attacker.cfg, attacker.arrays, 1)
        assert _cosine(estimate, truth) > 0.9, _cosine(estimate, truth)
        return
    assert isinstance(got[(0, 1)], tuple)  # the first cohort's sum is decrypted
    for c in COHORTS[1:]:  # every later cohort holds a client that answered {0, 1}
        assert isinstance(got[c], str) and "ContributionRefused" in got[c], got[c]
        assert "for the cohort [0, 1]" in got[c]


@pytest.mark.parametrize("record", [False, True])
def test_he_differencing_over_restarts(_task_identity, tmp_path, record):  # noqa: F811
    """Three starts of a run (each a fresh key setup, round 1, the same initial model), on
    hosts whose SuperNodes keep a state folder: the record is the host's, not the run's."""
    def host(pid: int) -> dict:
        return {messages.STATE_DIR: str(tmp_path / f"host-{pid}"), **_host(record)}

    got, model = {}, None
    for c in COHORTS:
        attacker = Attacker(node_config=host)
        model = attacker.arrays = model or _initial(attacker.cfg)
        got[c] = _he_round(attacker, 1, c)
    if not record:  # round 1 repeats bit for bit with the run's public seeds
        estimate = _difference(got)
        truth = _truth(attacker.cfg, model, 1)
        assert np.linalg.norm(estimate - truth) / np.linalg.norm(truth) < 1e-6
        return
    assert isinstance(got[(0, 1)], tuple)
    for c in COHORTS[1:]:
        assert isinstance(got[c], str) and "ContributionRefused" in got[c], got[c]
    for pid in (0, 1):  # the file the record lives in is the host's own, 0600
        path = tmp_path / f"host-{pid}" / "contributions" / f"partition-{pid}.json"
        assert path.stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- SecAgg+


def _secagg_server(record: bool, values: dict, max_weight: float
                   ) -> tuple[SecAggProtocol, object]:
    """A SecAgg+ server (Flower's workflow, fedpriv's protocol) over 3 in-process
    SuperNodes whose hosts keep the record or not."""
    cfg = validate({"num-clients": 3, "fraction-train": 1.0, "secure-aggregation": "secagg+",
                    "batch-size": 64, "run-dir": "/tmp/fedpriv-secagg-attack", **values})
    grid = InProcessGrid(cfg, node_config=lambda p: _host(record))
    fed = FederationGrid(grid, grid.partition_of)
    server = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                     run_config=cfg.flat())
    return SecAggProtocol.for_run(cfg, fed, fed.partition_of, context=server,
                                  max_weight=max_weight), cfg


def _secagg_rounds(record: bool) -> tuple[dict, RoundLog, ArrayRecord, object]:
    protocol, cfg = _secagg_server(record, {}, 4000.0)
    arrays = _initial(cfg)
    got, logs = {}, {}
    for r, members in enumerate(COHORTS, start=1):
        log = RoundLog(r)
        config = {"server-round": r, "local-epochs": 1}
        chosen = ([NODE_ID_BASE + p for p in members], config)
        with mock.patch.object(protocol, "configure", lambda sr, chosen=chosen: chosen):
            collected = protocol.collect(r, arrays, config, None, log)
        logs[members] = log
        if collected is not None:  # the average (the weights stay secret; sizes are equal)
            got[members] = _flat(collected.total)
    return got, logs, arrays, cfg


@pytest.mark.parametrize("record", [False, True])
def test_secagg_differencing_over_rounds(_task_identity, record):  # noqa: F811
    got, logs, arrays, cfg = _secagg_rounds(record)
    if not record:
        # averages of equal-sized pairs: A01 + A12 - A02 = u1
        estimate = got[(0, 1)] + got[(1, 2)] - got[(0, 2)]
        truth = _truth(cfg, arrays, 1)
        assert _cosine(estimate, truth) > 0.9, _cosine(estimate, truth)
        return
    assert set(got) == {(0, 1)}
    for c in COHORTS[1:]:
        log = logs[c]
        assert log.refused and "refused to answer this model for this cohort" in log.refused
        assert any("ContributionRefused" in f["error"] for f in log.failures)


# ---------------------------------------------------------------- the record's rules


def _model(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(40, 30)), rng.normal(size=30)]


def test_the_same_cohort_is_answered_again_alike_and_another_refused():
    record = ContributionRecord.new(radius=1e-4)
    model = _model()
    first = record.claim(model, [2, 1], "he", 1, "round-1 settings")
    again = record.claim(model, [1, 2], "he", 1, "round-1 settings")  # a redone round
    assert again is first and first.seed == again.seed and first.rounds == [1, 1]
    # the same cohort with any other input (round number, proximal term, clip...): the
    # retrained update would differ, so it is refused
    with pytest.raises(ContributionRefused, match="other round or run settings"):
        record.claim(model, [1, 2], "he", 2, "round-2 settings")
    # a replay that would now decline (budget spent since) refuses instead
    with pytest.raises(ContributionRefused, match="would now decline"):
        ContributionRecord.check_replay(again, declined=True)
    ContributionRecord.check_replay(ContributionRecord.new(1e-4).claim(model, [1], "he", 1),
                                    declined=True)  # a first answer may decline
    with pytest.raises(ContributionRefused, match="for the cohort \\[1, 2\\]"):
        record.claim(model, [1, 3], "he", 3)
    with pytest.raises(ContributionRefused):  # the same model under the other protocol
        record.claim(model, [1, 2], "secagg+", 3)
    # a model within the radius is the same model, and never answered again (not even
    # for the same cohort: its update would differ from the first)
    near = [a * (1 + 3e-5) for a in model]
    for cohort in ([1, 3], [1, 2]):
        with pytest.raises(ContributionRefused, match="within 0.0001"):
            record.claim(near, cohort, "he", 4, "round-1 settings")
    # what remains (docs/PRIVACY.md): a model moved beyond the radius is a new model
    far = [a * (1 + 3e-3) for a in model]
    assert record.claim(far, [1, 3], "he", 5).seed != first.seed
    # the record survives its storage
    back = ContributionRecord.from_json(record.to_json(), 1e-4)
    with pytest.raises(ContributionRefused):
        back.claim(model, [1, 3], "he", 6)


def test_an_update_is_unmasked_in_one_sum_of_survivors_only():
    record = ContributionRecord.new(radius=1e-4)
    entry = record.claim(_model(), [1, 2, 3], "secagg+", 1)
    record.reveal(entry.digest, [1, 2])  # 3 dropped: the sum of {1, 2} is revealed
    with pytest.raises(ContributionRefused, match="already unmasked in a sum of \\[1, 2\\]"):
        record.reveal(entry.digest, [1, 2, 3])
    with pytest.raises(ContributionRefused, match="for the cohort \\[1, 2\\]"):
        record.claim(_model(), [1, 2, 3], "secagg+", 2)  # the whole cohort again: no
    assert record.claim(_model(), [1, 2], "secagg+", 1) is entry  # the survivors again
    with pytest.raises(ContributionRefused, match="not all in the cohort"):
        record.reveal(entry.digest, [1, 4])


def _secagg_message(stage: str, **configs) -> Message:
    return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: stage,
                                                                 **configs})}),
                   dst_node_id=7, message_type=messages.SECURE_FIT)


def test_the_secagg_client_refuses_split_thresholds_and_its_own_drop():
    """Checks Flower's client omits: a threshold that lets a server gather shares of one
    client's mask seed and of its key from disjoint neighbours, and an unmask request
    naming the client itself dropped (it would hand over a share of its own key)."""
    cfg = validate({"secure-aggregation": "secagg+"})
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(),
                      run_config=cfg.flat())
    with pytest.raises(ContributionRefused, match="2 \\* threshold > num-shares"):
        secagg_guard.check(_secagg_message(Stage.SETUP, **{
            Key.SHARE_NUMBER: 4, Key.THRESHOLD: 2,
            **secagg_guard.expected_quantization(cfg)}), context, simulated=True)
    quantization = secagg_guard.expected_quantization(cfg)
    secagg_guard.check(_secagg_message(Stage.SETUP, **{Key.SHARE_NUMBER: 3,
                                                       Key.THRESHOLD: 2, **quantization}),
                       context, simulated=True)
    # one client given a finer grid than the others: its digits would stand apart
    finer = {**quantization, Key.TARGET_RANGE: quantization[Key.TARGET_RANGE] * 1024}
    with pytest.raises(ContributionRefused, match="every client must quantize alike"):
        secagg_guard.check(_secagg_message(Stage.SETUP, **{Key.SHARE_NUMBER: 3,
                                                           Key.THRESHOLD: 2, **finer}),
                           context, simulated=True)
    context.state[RECORD_KEY_STATE] = ConfigRecord({"nid": 7})
    for active, dead, why in (([8, 9], [7], "names this client dropped"),
                              ([7, 8], [8], "both alive and dropped")):
        with pytest.raises(ContributionRefused, match=why):
            secagg_guard.check(_secagg_message(Stage.UNMASK, **{
                Key.ACTIVE_NODE_ID_LIST: active, Key.DEAD_NODE_ID_LIST: dead}),
                context, simulated=True)
    off = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(),
                  run_config=validate({"secure-aggregation": "secagg+",
                                       "contribution-record": False}).flat())
    secagg_guard.check(_secagg_message(Stage.SETUP, **{
        Key.SHARE_NUMBER: 4, Key.THRESHOLD: 2, **secagg_guard.expected_quantization(cfg)}),
        off, simulated=True)


def test_on_a_real_supernode_the_host_not_the_operator_decides():
    """The operator's run config cannot turn a host's record off or shrink its radius; in
    simulation (the researcher is both) the run config decides."""
    from clients.contributions import settings

    assert settings(False, 0.0, {}, simulated=False) == (True, 1e-4)
    assert settings(False, 0.0, {"contribution-record": "false"}, simulated=False)[0] is False
    assert settings(True, 1e-2, {}, simulated=False) == (True, 1e-2)
    assert settings(False, 0.0, {}, simulated=True) == (False, 0.0)
    with pytest.raises(ValueError, match="contribution-radius"):
        settings(True, 0.0, {"contribution-radius": "wide"}, simulated=False)


# ---------------------------------------------------------------- distributed DP


def _secagg_restart(members: tuple[int, ...], model: ArrayRecord, values: dict) -> list:
    """Round 1 of a fresh start of a SecAgg+ run on hosts whose record is off: the
    server gets the sum of ``members``' (noisy) contributions."""
    protocol, _ = _secagg_server(False, values, 1.0)
    config = {"server-round": 1, "local-epochs": 1}
    chosen = ([NODE_ID_BASE + p for p in members], config)
    with mock.patch.object(protocol, "configure", lambda sr: chosen):
        collected = protocol.collect(1, model, config, None, RoundLog(1))
    return collected.total


def test_under_distributed_dp_the_difference_is_noise_as_predicted(_task_identity):  # noqa: F811
    """The restart attack again, on hosts without the record, with dp = "distributed":
    each sum carries its clients' Skellam shares, so (S01 + S12 - S02) / 2 is client 1's
    clipped update plus noise of variance 3/4 of a sum's per coordinate; its error is what
    that noise predicts, and its cosine to the update is nil."""
    values = {"dp": "distributed", "noise-multiplier": 1.0, "clipping-norm": 1.0}
    cfg = validate({"num-clients": 3, "fraction-train": 1.0, "secure-aggregation": "secagg+",
                    **values})
    model = _initial(cfg)
    sums = {c: _flat(_secagg_restart(c, model, values)) for c in COHORTS}
    estimate = (sums[(0, 1)] + sums[(1, 2)] - sums[(0, 2)]) / 2
    truth = _truth(validate({**cfg.flat(), "batch-size": 64}), model, 1)
    truth *= min(1.0, 1.0 / np.linalg.norm(truth))  # the client clips to clipping-norm
    # a sum of 2 of the planned 3 shares: variance 2/3 sigma^2 per coordinate
    predicted = np.sqrt(3 / 4 * 2 / 3 * truth.size)  # sigma = z * C = 1
    error = np.linalg.norm(estimate - truth)
    assert abs(error / predicted - 1) < 0.05, (error, predicted)
    assert abs(_cosine(estimate, truth)) < 0.05


def test_a_distributed_dp_run_records_the_epsilon_of_its_sums(tmp_path, _task_identity):  # noqa: F811
    """A whole run (the ServerApp, SecAgg+ over in-process nodes, 2 rounds, 3 clients):
    the ledger's epsilon is the Skellam closed form composed over the rounds each client
    took part in, computed here from the plan's published numbers, not by the ledger."""
    from privacy.dp import distributed as dd
    from server.app import run_one
    from tasks.results.ledger import read_ledger

    cfg = validate({"num-clients": 3, "num-server-rounds": 2, "secure-aggregation": "secagg+",
                    "dp": "distributed", "noise-multiplier": 2.0, "model": "linear",
                    "save-model": False, "run-dir": str(tmp_path / "run")})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config=cfg.flat())
    run_one(InProcessGrid(cfg, simulated=True), context, cfg)
    ledger = read_ledger(tmp_path / "run")
    assert [r.round for r in ledger] == [1, 2]
    privacy = ledger[-1].privacy
    assert privacy["mode"] == "distributed" and privacy["rounds-max"] == 2
    want = dd.skellam_epsilon(privacy["sensitivity-l2"], privacy["sensitivity-l1"],
                              privacy["local-variance"], 3, 2, privacy["delta"])[0]
    assert privacy["epsilon-max"] == pytest.approx(want, rel=1e-9)
    assert ledger[0].privacy["epsilon-max"] < privacy["epsilon-max"]
