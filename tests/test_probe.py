"""The CVAE paper's evaluation protocol (Di Salvo et al., BMVC 2024) inside the federation:
AUROC on real test data, model selection on a real validation split, robustness to
Gaussian noise on the test inputs, the online CVAE, and the sweep that crosses them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from torchmetrics.functional.classification import multiclass_auroc

from clients.anonymized import online_sample, released_data
from experiments.sweep.spec import load_sweep
from server.app import run_one
from server.evaluation import auroc
from tasks.config import ConfigError, validate
from tasks.results.ledger import read_ledger
from tasks.seeding import derive_seed
from tasks.splits import client_split

from .inprocess import InProcessGrid
from .test_strategies import _task_identity  # noqa: F401  (fixture)


def test_auroc_matches_an_independent_implementation():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 500)
    logits = rng.normal(size=(500, 4)) + 2.0 * np.eye(4)[y]
    probs = torch.softmax(torch.from_numpy(logits), 1).numpy()
    want = float(multiclass_auroc(torch.from_numpy(probs), torch.from_numpy(y), 4,
                                  average="macro"))
    assert auroc(y, probs) == pytest.approx(want, abs=1e-6)
    assert auroc(y, np.eye(4)[y]) == 1.0
    assert auroc(np.zeros(5, dtype=int), np.full((5, 4), 0.25)) is None


def test_auroc_equals_scikit_learn_with_ties_and_absent_classes():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(1)
    for n, k, absent in ((300, 10, (3, 7)), (200, 4, ()), (50, 3, (1,))):
        labels = np.setdiff1d(np.arange(k), absent)
        y = rng.choice(labels, n)
        probs = rng.dirichlet(np.ones(k), n).round(2)  # rounded: many tied scores
        probs /= probs.sum(1, keepdims=True)
        if len(labels) == 2:
            want = roc_auc_score(y == labels[1], probs[:, labels[1]])
        else:
            cols = probs[:, labels] / probs[:, labels].sum(1, keepdims=True)
            want = roc_auc_score(y, cols, multi_class="ovr", average="macro", labels=labels)
        assert auroc(y, probs) == pytest.approx(want, abs=1e-12)
    y = np.array([1, 1, 0, 0, 1])
    scores = np.array([[0.5, 0.5], [0.2, 0.8], [0.5, 0.5], [0.9, 0.1], [0.3, 0.7]])
    assert auroc(y, scores) == pytest.approx(roc_auc_score(y, scores[:, 1]), abs=1e-12)


def _context(cfg):
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                   run_config=cfg.flat())


def test_selection_on_validation_and_noise_robustness_are_reported(tmp_path,
                                                                   _task_identity):  # noqa: F811
    cfg = validate({"num-clients": 3, "num-server-rounds": 3, "batch-size": 64,
                    "validation-fraction": 0.2, "test-noise": "0,1,3",
                    "run-dir": str(tmp_path / "run")})
    info = run_one(InProcessGrid(cfg, simulated=True), _context(cfg), cfg)
    ledger = read_ledger(tmp_path / "run")
    best = min(ledger, key=lambda r: r.test["validation-loss"])
    selection = info.model_selection
    assert selection["round"] == best.round
    assert selection["test"] == {k: v for k, v in best.test.items()
                                 if not k.startswith("validation-")}
    # the test split is the other 80% of the 1,000 held-out digits
    noise = info.robustness
    assert [r["sigma"] for r in noise] == [0.0, 1.0, 3.0]
    assert noise[0]["auroc"] == pytest.approx(selection["test"]["auroc"])  # no noise: same
    assert noise[0]["accuracy"] > noise[2]["accuracy"]  # heavy noise hurts
    assert 0.5 < noise[0]["auroc"] <= 1.0
    assert (tmp_path / "run" / "checkpoint" / "selected.npz").is_file()


def test_bad_test_noise_is_refused():
    for bad in ("0.1,x", "-1", "nan"):
        with pytest.raises(ConfigError, match="test-noise"):
            validate({"test-noise": bad})


def test_cvae_online_trains_on_a_fresh_sample_every_epoch(tmp_path):
    cfg = validate({"features": "embeddings", "anonymizer": "cvae-online", "cvae-epochs": 3,
                    "num-clients": 4})
    split = client_split(cfg, 0, 4)
    seed = derive_seed(cfg.training.seed, 0)
    a = cfg.anonymization
    x1, y1 = online_sample(a, split, seed, 1, 0)
    x2, y2 = online_sample(a, split, seed, 1, 1)
    again, _ = online_sample(a, split, seed, 1, 0)
    torch.testing.assert_close(x1, again)  # seeded by (client, round, epoch)
    assert not torch.equal(x1, x2)
    released = released_data(a, split, seed)
    assert len(y1) == len(y2) == len(released.y)  # as many as the client's members
    # labels drawn from the client's class distribution
    counts = np.bincount(released.y.numpy(), minlength=10) / len(released.y)
    drawn = np.bincount(np.concatenate([online_sample(a, split, seed, r, 0)[1].numpy()
                                        for r in range(1, 9)]), minlength=10)
    assert np.abs(drawn / drawn.sum() - counts).max() < 0.03
    # scored like cvae: the same CVAE (same seed and data) and the same release
    plain = released_data(validate({**cfg.flat(), "anonymizer": "cvae"}).anonymization,
                          split, seed)
    assert released.scores == plain.scores
    for bad in ({"dp": "local"}, {"leakage-rounds": "1"}):
        with pytest.raises(ConfigError, match="cvae-online"):
            validate({"features": "embeddings", "anonymizer": "cvae-online", **bad})


def test_variants_are_crossed_with_the_grid(tmp_path):
    spec = load_sweep("cvae-paper")
    cells = spec.cells()
    assert len(cells) == 2 * 2 * 6
    assert {(c["dataset"], c["num-clients"]) for c in cells} == {
        (d, n) for d in ("mnist", "fashion-mnist") for n in (10, 1)}
    assert sum(c["anonymizer"] == "ksame" for c in cells) == 12
    assert "k" not in cells[0] and cells[1]["k"] == 2
    only = tmp_path / "v.toml"
    only.write_text('[[variants]]\nk = 2\n[[variants]]\nk = 3\n')
    assert load_sweep(str(only)).cells() == [{"k": 2}, {"k": 3}]


def test_auroc_of_a_diverged_model_or_two_present_classes():
    y = np.array([0, 2, 2, 0, 2])
    probs = np.array([[0.9, 0.05, 0.05], [0.1, 0.1, 0.8], [0.2, 0.1, 0.7],
                      [0.6, 0.3, 0.1], [0.3, 0.3, 0.4]])
    assert auroc(y, probs) == 1.0  # classes 0 and 2 present: the binary AUROC of class 2
    probs[0, 0] = np.nan
    assert auroc(y, probs) is None  # a diverged model is scored, not a crash
