"""Homomorphic-encryption aggregation (``secure-aggregation = "he"``): CKKS sums match
plain sums within the stated precision, a wrong key or an altered ciphertext fails
clearly, the key exchange hides the key from the relaying server, and HE rounds give the
plain rounds' aggregate of the same client updates — with the real ClientApp, Opacus and
TenSEAL, in-process (the real runtime: test_end_to_end_privacy)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, RecordDict

from privacy.dp.dpfedavg import DPFedAvgParams
from privacy.encryption import ckks, keyshare
from server.app import run_one
from strategies.build import build_runner
from strategies.grid import FederationGrid
from strategies.protocols.he import encoding_slack
from tasks import messages
from tasks.config import validate
from tasks.results.ledger import read_ledger
from tasks.splits import model_for

from .dp_reference import gaussian_epsilon
from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def key():
    secret = ckks.new_secret_context()
    return secret, ckks.public_context(secret)


def test_ckks_sums_match_plain_sums_within_the_stated_precision(key):
    secret, public = key
    rng = np.random.default_rng(0)
    d = 3 * ckks.SLOTS + 17  # several ciphertexts, the last one partly filled
    updates = [rng.normal(0, 0.05, d) for _ in range(4)]
    weights = [0.25, 0.1, 0.4, 0.25]
    parts = [ckks.encrypt(public, u, w) for u, w in zip(updates, weights, strict=True)]
    assert len(parts[0]) == ckks.num_chunks(d) == 4
    values, counts = ckks.decrypt(secret, ckks.add(public, parts, list("abcd")), d)
    ckks.check_count(counts, 4)
    plain = sum(w * u for u, w in zip(updates, weights, strict=True))
    assert np.abs(values[:d] - plain).max() < 1e-7
    assert values[d] == pytest.approx(1.0, abs=1e-7)  # the weights' sum
    with pytest.raises(ValueError, match="beyond"):
        ckks.encrypt(public, np.full(3, 2.0**51), 1.0)


def test_a_public_context_cannot_decrypt_and_another_key_fails_the_count(key):
    secret, public = key
    total = ckks.add(public, [ckks.encrypt(public, np.ones(10), 1.0)] * 3, list("abc"))
    with pytest.raises(ckks.CiphertextRejected, match="does not decrypt"):
        ckks.decrypt(public, total, 10)
    other = ckks.new_secret_context()
    with pytest.raises(ckks.CiphertextRejected, match="do not share one key"):
        ckks.check_count(ckks.decrypt(other, total, 10)[1], 3)


def _flip(chunk: bytes, at: int) -> bytes:
    out = bytearray(chunk)
    out[at] ^= 0x80
    return bytes(out)


def test_an_altered_ciphertext_never_becomes_a_wrong_aggregate(key):
    """Bit flips across a ciphertext: it no longer parses (the server names the sender),
    or the sum fails its check slots when decrypted, or the flip was harmless (the sum is
    still right to CKKS precision, e.g. a coefficient's lowest bits). Never a silently
    wrong aggregate."""
    secret, public = key
    x = np.linspace(-1, 1, 5000)
    good = ckks.encrypt(public, x, 0.5)
    honest = ckks.encrypt(public, np.ones(5000), 0.5)
    want = 0.5 * x + 0.5
    outcome = {"parse": 0, "check": 0, "harmless": 0}
    for at in np.linspace(0, len(good[0]) - 1, 40).astype(int):
        bad = [_flip(good[0], int(at)), *good[1:]]
        try:
            total = ckks.add(public, [honest, bad], ["client 3", "client 7"])
        except ckks.CiphertextRejected as err:
            assert "client 7's ciphertext" in str(err) and err.index == 1
            outcome["parse"] += 1
            continue
        values, counts = ckks.decrypt(secret, total, 5000)
        try:
            ckks.check_count(counts, 2)
        except ckks.CiphertextRejected as err:
            assert "was altered" in str(err)
            outcome["check"] += 1
            continue
        assert np.abs(values[:5000] - want).max() < 1e-6, at  # passed: it must be right
        outcome["harmless"] += 1
    assert outcome["parse"] and outcome["check"], outcome
    with pytest.raises(ckks.CiphertextRejected, match="different numbers"):
        ckks.add(public, [good, good * 2], ["a", "b"])


def test_the_sealed_key_opens_only_for_its_client_and_run():
    private, public = keyshare.node_keypair()
    sealed = keyshare.seal(b"the CKKS secret", public, "run-1", 2)
    assert keyshare.open_sealed(sealed, private, "run-1", 2) == b"the CKKS secret"
    for run, pid in (("run-2", 2), ("run-1", 3)):
        with pytest.raises(ValueError, match="does not open"):
            keyshare.open_sealed(sealed, private, run, pid)
    with pytest.raises(ValueError, match="does not open"):
        keyshare.open_sealed(sealed, keyshare.node_keypair()[0], "run-1", 2)


def test_the_encoding_slack_is_accounted_as_sensitivity():
    d = 1_663_370  # the McMahan CNN
    slack = encoding_slack(d)
    assert slack == pytest.approx(np.sqrt(d) * ckks.POLY_MODULUS / 2 / 2**ckks.SCALE_BITS)
    params = DPFedAvgParams(1.0, 1.0, 10, cohort=5, fraction=0.5, quantization_slack=slack)
    assert params.accounted_multiplier == pytest.approx(0.5 / (1 + slack))


def _runner(cfg):
    """The runner ``cfg`` asks for, over in-process clients that run ``cfg`` too."""
    grid = InProcessGrid(cfg, simulated=True)
    fed = FederationGrid(grid, grid.partition_of, assign=True)
    return grid, build_runner(cfg, fed, fed.partition_of)


def test_he_rounds_give_the_plain_aggregate_of_the_same_updates(_task_identity):  # noqa: F811
    """Each round, from the same global model, the HE runner's new model equals the plain
    FedAvg runner's (same clients, same seeded training) to within CKKS precision; the
    server holds only ciphertexts and the decrypted sum."""
    values = {"num-clients": 3, "fraction-train": 0.67, "batch-size": 64}
    cfg = validate({**values, "secure-aggregation": "he"})
    grid, he = _runner(cfg)
    _, plain = _runner(validate(values))
    arrays = ArrayRecord(model_for(cfg)[0].state_dict())
    for rnd in (1, 2):
        got = he.run_round(rnd, arrays)
        want = plain.run_round(rnd, arrays)
        assert got.log.sampled == want.log.sampled and len(got.log.sampled) == 2
        assert got.replies == []  # nothing per client for the leakage study
        diff = max(float(np.abs(a - b).max()) for a, b in zip(
            got.arrays.to_numpy_ndarrays(), want.arrays.to_numpy_ndarrays(), strict=True))
        assert diff < 1e-6, diff
        assert all(c["upload-bytes"] > 100_000 for c in got.log.clients)
        arrays = got.arrays
    # one key setup for the run, one decryption (of the sum only) per round
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds.count(messages.HE_DEAL) == 1 and kinds.count(messages.HE_DECRYPT) == 2


class Tampering(InProcessGrid):
    """Alters client 1's ciphertexts on their way to the server: bytes that do not parse
    (a flip that still parses is caught by the check slots: the test above), or one
    ciphertext too few."""

    how = "truncate"

    def send_and_receive(self, messages_out, *, timeout=None):
        replies = super().send_and_receive(messages_out, timeout=timeout)
        for reply in replies:
            record = reply.content.config_records.get(messages.HE_STATE)
            if record and "ciphertexts" in record and \
                    self.partition_of[reply.metadata.src_node_id] == 1:
                chunks = list(record["ciphertexts"])
                record["ciphertexts"] = ([c[: len(c) // 2] for c in chunks]
                                         if self.how == "truncate" else chunks[:-1])
        return replies


def _context(cfg):
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                   run_config=cfg.flat())


@pytest.mark.parametrize("how, why", [("truncate", "does not carry its signature"),
                                      ("drop", "6 ciphertexts for a model that needs 7")])
@pytest.mark.parametrize("record_on", [True, False], ids=["contribution-record", "off"])
def test_a_tampered_ciphertext_fails_that_client_and_the_run_goes_on(
        tmp_path, _task_identity, how, why, record_on):  # noqa: F811
    """The server's pre-check fails only the tampered client. With the contribution record
    (the default) the others' sum is then not decrypted (only a whole declared cohort is),
    and the round says so; without it, the other two are decrypted."""
    cfg = validate({"num-clients": 3, "num-server-rounds": 1, "secure-aggregation": "he",
                    "batch-size": 64, "save-model": False, "run-dir": str(tmp_path / "run"),
                    "contribution-record": record_on})
    grid = Tampering(cfg, simulated=True)
    grid.how = how
    run_one(grid, _context(cfg), cfg)
    (record,) = read_ledger(tmp_path / "run")
    assert [c["partition-id"] for c in record.clients] == [0, 2]
    (failure,) = record.failures
    assert failure["partition-id"] == 1 and why in failure["error"]
    if record_on:
        assert "client(s) [1] of the declared cohort sent no valid update" in record.refused
    else:
        assert record.refused is None


@pytest.mark.parametrize("values", [
    {"dp": "central", "noise-multiplier": 0.05, "clipping-norm": 0.1,
     "central-clipping": "client-fixed"},
    {"dp": "local", "noise-multiplier": 1.0},
], ids=["central-dp", "local-dp"])
def test_he_runs_with_central_and_local_dp(tmp_path, _task_identity, values):  # noqa: F811
    cfg = validate({"num-clients": 3, "num-server-rounds": 2, "secure-aggregation": "he",
                    "batch-size": 64, "save-model": False, "run-dir": str(tmp_path / "run"),
                    **values})
    info = run_one(InProcessGrid(cfg, simulated=True), _context(cfg), cfg)
    assert info.aggregation["individual-updates-visible"] is False
    ledger = read_ledger(tmp_path / "run")
    assert [r.round for r in ledger] == [1, 2]
    if values["dp"] == "central":
        # every client each round, no amplification claimed: two Gaussian releases of
        # ratio 1/z_eff, z_eff = z C / (C + slack) (dp-accounting, independently)
        z_eff = 0.05 * 0.1 / (0.1 + info.aggregation["encoding-slack"])
        want = gaussian_epsilon(np.sqrt(2) / z_eff, ledger[-1].privacy["delta"])
        assert want <= ledger[-1].privacy["epsilon"] <= 1.05 * want  # the accountant's bound
    else:  # each client's own ledger, and only identity and DP status in the clear
        from clients.state_store import load_state

        states = list((tmp_path / "run" / "checkpoint" / "clients").rglob("*.state"))
        assert len(states) == 3  # the DP ledgers are kept for a resume; the HE keys never
        assert all(messages.HE_STATE not in load_state(p).config_records and
                   "dp-sgd" in load_state(p).config_records for p in states)
        for client in ledger[-1].clients:
            assert client["epsilon"] > 0
            assert set(client) <= {"partition-id", "num-partitions", "num-examples",
                                   "train-steps", "epsilon", "delta", "noise-multiplier",
                                   "sample-rate", "dp-steps", "dp-skipped", "upload-bytes"}
