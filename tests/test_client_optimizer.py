"""The clients' local optimiser (client-optimizer: FedOpt's client side): Adam trains in
a real run, and under local DP-SGD it only post-processes Opacus' noisy clipped gradient,
so the run claims exactly SGD's epsilon."""

from __future__ import annotations

import pytest

import fedpriv
from experiments.configs import resolve
from tasks.config import ConfigError, validate

RUN = {"dataset": "breast-cancer", "model": "linear", "num_clients": 3,
       "num_server_rounds": 3, "echo": None, "save_model": False}


def _run(tmp_path, name, **keys):
    return fedpriv.run(results_dir=str(tmp_path / name), **RUN, **keys)


def test_adam_clients_learn_and_dp_claims_sgds_epsilon(tmp_path):
    adam = _run(tmp_path, "adam", client_optimizer="adam", lr=0.01)
    assert adam.ok and adam.accuracy > 0.85, adam  # breast-cancer: a linear model learns it
    private = {opt: _run(tmp_path, f"dp-{opt}", dp="local", target_epsilon=4.0,
                         client_optimizer=opt, lr=0.01 if opt != "sgd" else 0.05)
               for opt in ("sgd", "adam")}
    eps = {opt: r.frame()["epsilon"].tolist() for opt, r in private.items()}
    assert eps["adam"] == eps["sgd"] and max(eps["adam"]) <= 4.0  # the same accounting
    losses = {opt: r.frame()["test_loss"].tolist() for opt, r in private.items()}
    assert losses["adam"] != losses["sgd"]  # and yet another optimiser stepped


def test_what_the_optimiser_cannot_do_is_said_before_start():
    with pytest.raises(ConfigError, match="client-optimizer = 'adam' \\(the batched program"):
        validate({"client-optimizer": "adam", "train-together": True})
    with pytest.raises(ConfigError, match="momentum = 0.9 has no effect with "
                                          "client-optimizer = 'adam'"):
        resolve(None, ["client-optimizer=adam", "momentum=0.9"])
    with pytest.raises(ConfigError, match="client-optimizer = 'rmsprop' must be one of"):
        validate({"client-optimizer": "rmsprop"})
