"""HE against an active server: the decrypting client, not the server, enforces the minimum
cohort (privacy.encryption.cohort).

The adversary is a server that deviates from the protocol: it sends whatever messages it
likes to the real ClientApp handlers (in-process, real TenSEAL and Ed25519) after an honest
key setup. Each attack is first shown to work with the client-side check removed (the
decrypted "sum" is one client's update), then refused with it in place.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode

from privacy.encryption import cohort
from strategies.build import build_runner
from strategies.grid import FederationGrid
from strategies.protocols.he import HEProtocol, _signed
from tasks import messages
from tasks.config import validate
from tasks.encrypted_updates import to_record
from tasks.splits import model_for

from .inprocess import NODE_ID_BASE, InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)


class Attacker:
    """A server with an honest key setup and a free hand afterwards."""

    def __init__(self, num_clients: int = 3, node_config=None, **values) -> None:
        self.cfg = validate({"num-clients": num_clients, "fraction-train": 1.0,
                             "secure-aggregation": "he", "batch-size": 64,
                             "run-dir": "/tmp/fedpriv-he-attack", **values})
        # real SuperNodes' semantics; node_config(i): what host i adds to its node config
        self.grid = InProcessGrid(self.cfg, node_config=node_config)
        fed = FederationGrid(self.grid, self.grid.partition_of)
        self.rounds = HEProtocol(self.cfg, fed, fed.partition_of)
        self.rounds.setup()
        self.arrays = ArrayRecord(model_for(self.cfg)[0].state_dict())
        self.length = sum(a.size for a in self.arrays.to_numpy_ndarrays())

    def other_model(self, seed: int) -> ArrayRecord:
        """Another model than ``self.arrays`` (a later round's): the contribution record
        answers a model only once."""
        import torch

        torch.manual_seed(seed)
        return ArrayRecord(model_for(self.cfg)[0].state_dict())

    def send(self, pid: int, action: str, content: RecordDict) -> Message:
        (reply,) = self.grid.send_and_receive([Message(
            content, message_type=action, dst_node_id=NODE_ID_BASE + pid)])
        return reply

    def train(self, pid: int, server_round: int, decryptor: int, cohort=None,
              arrays: ArrayRecord | None = None) -> Message:
        """Ask ``pid`` to train for a cohort the server declares (default: everyone)."""
        config = ConfigRecord({"server-round": server_round,
                               "local-epochs": self.cfg.training.local_epochs,
                               "he-decryptor": decryptor,
                               "he-cohort": list(cohort if cohort is not None
                                                 else range(self.cfg.federation.num_clients))})
        return self.send(pid, messages.HE_FIT, RecordDict({
            "arrays": arrays if arrays is not None else self.arrays, "config": config}))

    def decrypt(self, pid: int, server_round: int, updates, cohort=None) -> Message:
        cohort = list(cohort if cohort is not None else range(self.cfg.federation.num_clients))
        return self.send(pid, messages.HE_DECRYPT, RecordDict({
            "config": ConfigRecord({}),
            messages.HE_STATE: to_record(server_round, updates, self.length, cohort)}))


def _signed_update(reply: Message, pid: int) -> cohort.SignedUpdate:
    assert not reply.has_error(), reply.error.reason
    return _signed(reply, pid)


def _refused(attempt, why: str) -> None:
    """The client handler raises CohortRefused: the runtime turns it into an error reply
    (Flower's code 2), and the client's state keeps nothing of the request."""
    reply = attempt()
    assert reply.has_error(), "the client answered instead of refusing"
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "CohortRefused" in reply.error.reason and why in reply.error.reason, \
        reply.error.reason


def _update_of(reply: Message) -> np.ndarray:
    """The plaintext a decryption reply carries: the weighted update, then the weight."""
    values = reply.content.array_records["arrays"]["sum"].numpy()
    return values[:-1] / values[-1]


@pytest.fixture
def attacker(_task_identity):  # noqa: F811
    return Attacker()


def test_a_lone_update_is_decrypted_without_the_check_and_refused_with_it(attacker):
    """The direct attack: send client 1's ciphertext alone to client 0 for decryption."""
    lone = [_signed_update(attacker.train(1, 1, decryptor=0), 1)]
    with mock.patch.object(cohort, "check_cohort"):  # the mutation: no client-side check
        leaked = attacker.decrypt(0, 1, lone)
    assert not leaked.has_error()
    weight = leaked.content.array_records["arrays"]["sum"].numpy()[-1]
    assert abs(weight - round(weight)) < 1e-6 and 1000 < weight < 1500  # one client's count
    assert np.abs(_update_of(leaked)).max() > 0  # client 1's update, in the clear
    lone2 = [_signed_update(attacker.train(1, 2, decryptor=0, arrays=attacker.other_model(2)),
                            1)]
    _refused(lambda: attacker.decrypt(0, 2, lone2), "minimum cohort is 2")


def test_a_cohort_of_one_is_refused(attacker):
    """The server samples one client and asks it to decrypt its own 'sum' (what
    num-clients=3 fraction-train=0.34 gave before)."""
    own = [_signed_update(attacker.train(0, 1, decryptor=0), 0)]
    _refused(lambda: attacker.decrypt(0, 1, own), "refusing to decrypt a sum of 1 client")


def test_a_two_client_round_with_one_reply_dropped_is_refused(attacker):
    """Two clients trained; the server drops (or garbles) one reply and asks for the sum of
    the other alone; a padded copy of the survivor does not count twice either."""
    a = _signed_update(attacker.train(0, 1, decryptor=2), 0)
    _signed_update(attacker.train(1, 1, decryptor=2), 1)  # dropped by the server
    _refused(lambda: attacker.decrypt(2, 1, [a]), "minimum cohort is 2")
    _refused(lambda: attacker.decrypt(2, 1, [a, a]), "appears twice")


def test_forged_relabelled_and_misdirected_updates_are_refused(attacker):
    a = _signed_update(attacker.train(0, 1, decryptor=2), 0)
    b = _signed_update(attacker.train(1, 1, decryptor=2), 1)
    # client 1's update presented as client 2's own, to pass the count with a dummy
    relabelled = cohort.SignedUpdate(2, b.chunks, b.signature)
    _refused(lambda: attacker.decrypt(2, 1, [a, relabelled]), "does not carry its signature")
    # a ciphertext the server made itself (it holds the public context) with a made-up
    # signature, standing in for a second client
    fake = cohort.SignedUpdate(1, a.chunks, bytes(64))
    _refused(lambda: attacker.decrypt(2, 1, [a, fake]), "does not carry its signature")
    # not in the roster at all
    _refused(lambda: attacker.decrypt(2, 1, [a, cohort.SignedUpdate(7, b.chunks, b.signature)]),
             "not in this run's roster")
    # signed for decryptor 2, sent to client 1
    _refused(lambda: attacker.decrypt(1, 1, [a, b]), "another decryptor")


def test_one_decryption_and_one_update_per_round(attacker):
    """Decrypting {0, 1, 2} and then {0, 1} in the same round would give client 2's update
    by subtraction; training twice in one round would let the server compare."""
    ups = [_signed_update(attacker.train(p, 1, decryptor=0), p) for p in range(3)]
    first = attacker.decrypt(0, 1, ups)
    assert not first.has_error(), first.error.reason
    _refused(lambda: attacker.decrypt(0, 1, ups[:2]), "already decrypted a sum for round 1")
    _refused(lambda: attacker.train(1, 1, decryptor=2), "already signed an update for round 1")
    # a second decryptor for the same round: the updates name client 0 only
    _refused(lambda: attacker.decrypt(2, 1, ups[:2]), "another decryptor")
    # round 1's updates replayed as round 2's, beside a fresh one
    fresh = _signed_update(attacker.train(2, 2, decryptor=0, arrays=attacker.other_model(2)),
                           2)
    _refused(lambda: attacker.decrypt(0, 2, [*ups[:2], fresh]), "replayed from another round")


def test_a_host_may_demand_a_larger_cohort(_task_identity):  # noqa: F811
    """A SuperNode's own node config raises the minimum; the server's run config cannot
    lower it below two (he-min-cohort < 2 is not a valid run config)."""
    with pytest.raises(Exception, match="he-min-cohort"):
        validate({"secure-aggregation": "he", "he-min-cohort": 1})
    attacker = Attacker(num_clients=3)
    attacker.grid.contexts[NODE_ID_BASE].node_config["he-min-cohort"] = 3
    ups = [_signed_update(attacker.train(p, 1, decryptor=0), p) for p in range(2)]
    _refused(lambda: attacker.decrypt(0, 1, ups), "minimum cohort is 3")


def test_the_honest_server_records_a_round_below_the_minimum_and_keeps_the_model(
        _task_identity):  # noqa: F811
    """A round in which only one valid update arrives is refused and recorded by the
    server itself, never sent for decryption, and the model stays as it was."""
    cfg = validate({"num-clients": 2, "fraction-train": 1.0, "secure-aggregation": "he",
                    "batch-size": 64, "run-dir": "/tmp/fedpriv-he-refused"})

    class DropOne(InProcessGrid):
        def send_and_receive(self, out, *, timeout=None):
            out = list(out)
            replies = super().send_and_receive(out, timeout=timeout)
            if out and out[0].metadata.message_type == messages.HE_FIT:
                record = replies[1].content.config_records[messages.HE_STATE]
                record["ciphertexts"] = [c[:100] for c in record["ciphertexts"]]
            return replies

    grid = DropOne(cfg)
    fed = FederationGrid(grid, grid.partition_of)
    rounds = build_runner(cfg, fed, fed.partition_of)
    arrays = ArrayRecord(model_for(cfg)[0].state_dict())
    result = rounds.run_round(1, arrays)
    assert result.arrays is None and "fewer than he-min-cohort = 2" in result.log.refused
    assert [f["partition-id"] for f in result.log.failures] == [1]
    assert messages.HE_DECRYPT not in [m.metadata.message_type for m in grid.sent]


def test_a_run_that_would_sample_fewer_than_the_minimum_is_refused_before_it_starts():
    with pytest.raises(Exception, match="samples 1 client\\(s\\) a round, fewer than "
                                        "he-min-cohort = 2") as err:
        validate({"num-clients": 3, "fraction-train": 0.34, "secure-aggregation": "he"})
    assert "Raise fraction-train" in str(err.value)
    validate({"num-clients": 3, "fraction-train": 0.34, "min-train-clients": 2,
              "secure-aggregation": "he"})


def test_a_client_that_declines_signs_it_and_the_rest_of_the_cohort_is_decrypted(
        _task_identity):  # noqa: F811
    """Under the contribution record only a whole declared cohort is decrypted; a client
    that declines to train (its DP budget spent, its screen refusing) signs a statement
    with no ciphertexts, so the others' sum is still decrypted, and counts only them."""
    import clients.encrypted as client_encrypted

    cfg = validate({"num-clients": 3, "fraction-train": 1.0, "secure-aggregation": "he",
                    "batch-size": 64, "run-dir": "/tmp/fedpriv-he-decline"})
    real = client_encrypted.local_update

    def declining(client, context, state, config, seed=None):
        if client.partition_id == 2:
            return None, {"partition-id": 2, "screen-refused": 1}
        return real(client, context, state, config, seed)

    grid = InProcessGrid(cfg)
    fed = FederationGrid(grid, grid.partition_of)
    rounds = build_runner(cfg, fed, fed.partition_of)
    arrays = ArrayRecord(model_for(cfg)[0].state_dict())
    with mock.patch.object(client_encrypted, "local_update", declining):
        result = rounds.run_round(1, arrays)
    assert result.log.refused is None and result.arrays is not None
    assert [c["partition-id"] for c in result.log.skipped] == [2]
    assert [c["partition-id"] for c in result.log.clients] == [0, 1]


def test_a_decryptor_whose_host_keeps_no_record_still_decrypts_only_whole_cohorts(
        _task_identity):  # noqa: F811
    """The senders signed the whole cohort (their hosts keep a record): a decryptor whose
    own host turned its record off still refuses a part of it, or a server could decrypt
    {0, 1, 2} now and {0, 1} after a replay, and subtract."""
    attacker = Attacker(node_config=lambda p: {"contribution-record": "false"} if p == 0
                        else {})
    ups = [_signed_update(attacker.train(p, 1, decryptor=0), p) for p in range(3)]
    _refused(lambda: attacker.decrypt(0, 1, ups[:2]), "not the whole cohort")
    assert not attacker.decrypt(0, 1, ups).has_error()
