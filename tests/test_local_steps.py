"""local-steps: a fixed number of local updates per round, in plain and DP-SGD training,
its accounting, and what it cannot be combined with; canary lines in a client's text."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from clients.local_dp import new_ledger
from clients.update import Client, local_update
from privacy.dp.public import PublicSchedule
from tasks.config import ConfigError, validate
from tasks.models import build_model
from tasks.splits import client_split, model_for
from tasks.training import make_loader, round_steps, sgd, train_epochs

from .conftest import fresh_epsilon


def test_training_stops_after_local_steps():
    model = build_model("linear", (1, 28, 28), 10)
    x, y = torch.randn(100, 1, 28, 28), torch.randint(0, 10, (100,))
    loader = make_loader(x, y, 10, 0)
    assert train_epochs(model, loader, sgd(model, 0.1), 2, torch.device("cpu"),
                        max_steps=7).steps == 7
    assert train_epochs(model, loader, sgd(model, 0.1), 2, torch.device("cpu")).steps == 20
    assert round_steps(2, 10, 7) == 7 and round_steps(2, 10, 0) == 20
    assert round_steps(1, 4, 9) == 4


def test_dp_sgd_is_calibrated_and_accounted_for_the_steps_it_takes():
    cfg = validate({"dp": "local", "target-epsilon": 2.0, "num-server-rounds": 4,
                    "batch-size": 32, "local-steps": 5})
    plan = PublicSchedule(400, 32)  # 13 batches an epoch, cut to 5
    ledger = new_ledger(cfg, plan, 10)
    eps = fresh_epsilon([(ledger.noise_multiplier, 32 / 400, 4 * 5)], 1 / 4000, "pld")
    assert 1.99 <= eps <= 2.0
    whole = new_ledger(validate({"dp": "local", "target-epsilon": 2.0, "num-server-rounds": 4,
                                 "batch-size": 32}), plan, 10)
    assert ledger.noise_multiplier < whole.noise_multiplier  # fewer steps, less noise


def _round(values: dict, pid: int = 0, n: int = 10):
    cfg = validate(values)
    client = Client(cfg, pid, n, client_split(cfg, pid, n))
    ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config={},
                  node_config={"partition-id": pid, "num-partitions": n})
    torch.manual_seed(0)
    model, _ = model_for(cfg)
    sent = {k: v.clone() for k, v in model.state_dict().items()}
    return local_update(client, ctx, sent, {"server-round": 1})


def test_a_client_round_takes_local_steps_with_and_without_dp():
    _, plain = _round({"local-steps": 3, "model": "linear"})
    assert plain["train-steps"] == 3
    _, private = _round({"local-steps": 3, "model": "linear", "dp": "local",
                         "noise-multiplier": 1.0})
    assert private["dp-steps"] == 3 and private["train-steps"] == 3


@pytest.mark.parametrize("sets, says", [
    ({"local-steps": 3, "train-together": True}, "local-steps"),
    ({"local-steps": 3, "leakage-rounds": "1"}, "replay whole local epochs"),
])
def test_what_local_steps_cannot_do_is_refused(sets, says):
    with pytest.raises(ConfigError, match=says):
        validate(sets)


def test_a_holder_trains_on_its_canary_lines_and_no_one_else_does():
    from tasks.shakespeare import VOCABULARY
    from tasks.text_canaries import line_examples, planted

    sets = {"dataset": "shakespeare", "partitioner": "natural", "num-clients": 6,
            "secret-canaries": 3, "secret-repetitions": "2,5", "secret-clients": 2}
    cfg = validate(sets)
    plants = planted(cfg)
    assert [p.repetitions for p in plants] == [2, 5, 2]
    assert all(len(p.holders) == 2 for p in plants) and planted(validate(sets)) == plants
    plain = validate({**sets, "secret-canaries": 0})
    for pid in range(6):
        mine = client_split(cfg, pid, 6)
        base = client_split(plain, pid, 6)
        held = [p for p in plants if pid in p.holders]
        extra = sum(p.repetitions * (len(p.canary.text) + 1) for p in held)
        assert len(mine) == len(base) + extra
        torch.testing.assert_close(mine.x[:len(base)], base.x)
        lines = "".join(VOCABULARY[i] for i in mine.x[len(base):, -1].tolist())
        for p in held:
            assert lines.count(p.canary.text[:-1]) >= p.repetitions
    x, y = line_examples("ab")
    assert ["".join(VOCABULARY[i] for i in row)[-2:] for row in x] == ["  ", " a", "ab"]
    assert "".join(VOCABULARY[i] for i in y) == "ab\n"
    assert np.all(x[:, :-2] == VOCABULARY.index(" "))
