"""The attacks on small real cases: a real client (fedpriv's own local update, Opacus for
DP-SGD) trains on real MNIST digits, the attack sees only what a server would, and the
score uses the digits the attack never saw."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from scipy.optimize import brentq
from scipy.stats import binom

from clients.postprocess import Prune
from clients.update import Client, audit_canaries, local_update, training_data
from privacy.analysis.leakage_metrics import (
    label_accuracy,
    random_image_psnr,
    reconstruction_scores,
)
from privacy.analysis.membership_metrics import membership_scores
from privacy.attacks.audit import audit, epsilon_lower_bound
from privacy.attacks.inversion import InversionConfig, dlg, invert
from privacy.attacks.labels import idlg_label, label_counts, labels_from_counts
from privacy.attacks.membership import alignment_scores, loss_scores
from privacy.attacks.observation import Observation, load_all, state_dict
from privacy.attacks.simulate import flatten, replay
from server.observe import local_training
from tasks.config import validate
from tasks.splits import client_split, dataset_for, heldout_split, model_for
from tasks.training import make_loader, sgd, train_epochs

N_CLIENTS = 10


def observe(values: dict, pid: int = 0, weights_seed: int = 0):
    """One round of client ``pid`` (real local update) and what the server observed of it;
    returns (cfg, model, observation, the client's true x, y)."""
    cfg = validate({"leakage-rounds": "1", "leakage-clients": str(pid),
                    "attacks": "labels", **values})
    client = Client(cfg, pid, N_CLIENTS, client_split(cfg, pid, N_CLIENTS))
    ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config={},
                  node_config={"partition-id": pid, "num-partitions": N_CLIENTS})
    torch.manual_seed(weights_seed)
    model, _ = model_for(cfg)
    sent = {k: v.clone() for k, v in model.state_dict().items()}
    new, metrics = local_update(client, ctx, sent, {"server-round": 1})
    x, y, _ = training_data(client, ctx)
    data = dataset_for(cfg)
    obs = Observation(1, pid, {k: v.numpy() for k, v in sent.items()},
                      {k: v.numpy() for k, v in new.items()}, local_training(cfg),
                      int(metrics["num-examples"]), tuple(x.shape[1:]), data.num_classes,
                      data.mean, data.std, disclosed=dict(metrics))
    return cfg, model, obs, x, y


def _invert(model, obs, labels, iterations=1000):
    return invert(model, state_dict(obs.sent), obs.update(), labels, obs.training,
                  obs.input_shape, InversionConfig(iterations, 1, 0.1, 0.01, seed=0),
                  mean=obs.mean, std=obs.std)


def test_the_attackers_replay_of_local_training_is_the_clients_training():
    # Several local epochs with momentum and weight decay: replaying them on the true
    # data from the weights sent gives exactly the update the client sent.
    _, model, obs, x, y = observe({"observed-examples": 8, "batch-size": 8,
                                   "local-epochs": 3, "momentum": 0.9,
                                   "weight-decay": 1e-3})
    replayed = replay(model, state_dict(obs.sent), x, y, obs.training, create_graph=False)
    for k, v in obs.update().items():
        torch.testing.assert_close(replayed[k], v, atol=2e-6, rtol=1e-4)


def test_inverting_gradients_recovers_one_image_and_dp_sgd_stops_it():
    torch.set_num_threads(1)
    _, model, obs, x, y = observe({"observed-examples": 1, "batch-size": 1})
    label = idlg_label(obs.update(), model)
    assert label == int(y[0])
    plain = reconstruction_scores(_invert(model, obs, torch.tensor([label])).x, y, x, y,
                                  obs.mean, obs.std)
    chance = random_image_psnr(x, obs.mean, obs.std)
    assert plain["psnr"] > chance + 15 and plain["ssim"] > 0.5  # measured 28.6 dB vs 4.9

    _, model, dp, x2, y2 = observe({"observed-examples": 1, "batch-size": 1, "dp": "local",
                                    "noise-multiplier": 1.0})
    assert torch.equal(x2, x)  # the same digit, now trained with DP-SGD
    noisy = reconstruction_scores(_invert(model, dp, y2).x, y2, x2, y2, dp.mean, dp.std)
    assert noisy["psnr"] < plain["psnr"] - 10 and noisy["ssim"] < 0.2  # measured 8.7 dB


def test_dlg_baseline_recovers_an_undefended_image():
    torch.set_num_threads(1)
    _, model, obs, x, y = observe({"observed-examples": 1, "batch-size": 1})
    rec = dlg(model, state_dict(obs.sent), obs.update(), 1, 10, obs.training, obs.input_shape,
              iterations=300, seed=0, restarts=3)
    scores = reconstruction_scores(rec.x, rec.y, x, y, obs.mean, obs.std)
    assert scores["psnr"] > random_image_psnr(x, obs.mean, obs.std) + 10
    assert rec.labels == "optimised" and scores["label-accuracy"] == 1.0


@pytest.mark.parametrize("pid", range(N_CLIENTS))
def test_idlg_is_exact_for_one_example(pid):
    _, model, obs, _, y = observe({"observed-examples": 1, "batch-size": 1}, pid=pid,
                                  weights_seed=pid)
    assert idlg_label(obs.update(), model) == int(y[0])


@pytest.mark.parametrize("epochs", [1, 5])
def test_label_counts_of_a_batch_of_eight(epochs):
    _, model, obs, _, y = observe({"observed-examples": 8, "batch-size": 8,
                                   "local-epochs": epochs})
    counts = label_counts(obs.update(), model, state_dict(obs.sent), 8, obs.training,
                          obs.input_shape)
    assert counts.sum() == 8
    assert label_accuracy(labels_from_counts(counts), y) >= 0.75


def _trained(x, y, epochs, seed=0):
    torch.manual_seed(seed)
    cfg = validate({})
    model, _ = model_for(cfg)
    train_epochs(model, make_loader(x, y, 16, seed), sgd(model, 0.05), epochs,
                 torch.device("cpu"))
    return model, {k: v.detach() for k, v in model.state_dict().items()}


def test_loss_threshold_mia_on_an_overfit_model_and_on_one_that_never_saw_the_members():
    # Heavily overfit: 100 digits with random labels, memorised (MNIST itself is too easy
    # to overfit visibly: held-out digits reach near-zero loss too).
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    split, test = client_split(validate({}), 0, 5), heldout_split(validate({}))
    members = (split.x[:100], torch.randint(0, 10, (100,), generator=gen))
    nonmembers = (test.x[:100], torch.randint(0, 10, (100,), generator=gen))
    model, weights = _trained(*members, epochs=100)
    auc = membership_scores(loss_scores(model, weights, *members).numpy(),
                            loss_scores(model, weights, *nonmembers).numpy())["auc"]
    assert auc > 0.95
    # Members it never saw, against non-members from the same pool (MNIST's test digits
    # are easier than its training digits: they would not do as non-members).
    model, weights = _trained(split.x[400:], split.y[400:], epochs=5)
    members, nonmembers = (split.x[:200], split.y[:200]), (split.x[200:400], split.y[200:400])
    auc = membership_scores(loss_scores(model, weights, *members).numpy(),
                            loss_scores(model, weights, *nonmembers).numpy())["auc"]
    assert 0.4 < auc < 0.6


def test_gradient_alignment_scores_the_member_of_a_one_step_update_at_one():
    # One example, one plain SGD step: the update is -lr times its gradient, so its
    # alignment is exactly 1; a held-out digit of the same class scores lower.
    _, model, obs, x, y = observe({"observed-examples": 1, "batch-size": 1})
    test = heldout_split(validate({}))
    same = torch.nonzero(test.y == y[0]).flatten()[:20]
    scores = alignment_scores(model, state_dict(obs.sent), obs.update(),
                              torch.cat([x, test.x[same]]), torch.cat([y, test.y[same]]))
    assert float(scores[0]) == pytest.approx(1.0, abs=1e-5)
    assert float(scores[1:].max()) < 0.99


def test_epsilon_lower_bound_matches_the_binomial_tail_without_delta():
    # Independent: with delta = 0 the bound is where P[Binomial(r, e^eps/(1+e^eps)) >= v]
    # equals 1 - confidence (Steinke et al. 2023, Theorem 3.1).
    for r, v in ((50, 45), (100, 70), (200, 180)):
        def tail(eps, r=r, v=v):
            return binom.sf(v - 1, r, 1 / (1 + math.exp(-eps))) - 0.05
        assert epsilon_lower_bound(1000, r, v, 0.0, 0.95) == pytest.approx(
            brentq(tail, 0, 20), abs=1e-6)
    assert epsilon_lower_bound(1000, 100, 50, 0.0, 0.95) == 0.0  # chance-level guessing
    # delta only ever loosens the bound
    assert epsilon_lower_bound(1000, 100, 90, 1e-3, 0.95) < \
        epsilon_lower_bound(1000, 100, 90, 0.0, 0.95)


def test_audit_of_randomized_response_is_a_valid_lower_bound():
    # Monte Carlo of an eps-DP mechanism per canary (randomized response, eps = 1): the
    # bound exceeds the true eps in at most about 5% of runs, and is near it otherwise.
    rng = np.random.default_rng(0)
    eps, m, runs = 1.0, 1000, 200
    bounds = []
    for _ in range(runs):
        included = rng.random(m) < 0.5
        keep = rng.random(m) < math.exp(eps) / (1 + math.exp(eps))
        reported = np.where(keep, included, ~included).astype(float)
        bounds.append(audit(reported + 1e-6 * rng.random(m), included, 0.0, 0.95,
                            1.0).epsilon_lower_bound)
    bounds = np.array(bounds)
    assert (bounds > eps).mean() <= 0.08
    assert np.median(bounds) > 0.7


def _audited(values):
    cfg, model, obs, _, _ = observe({"attacks": "mia,audit", "canaries": 100,
                                     "observed-examples": 100, "batch-size": 16, **values})
    canaries, included = audit_canaries(cfg, 0, N_CLIENTS,
                                        sum(p.numel() for p in model.parameters()))
    # every canary is a row (those left out add nothing), so the record count, sampling
    # rate and steps do not depend on the secret inclusion; under local DP the client
    # reports the public size N (4,000 // 10) instead of its rows
    rows = 400 if values.get("dp") == "local" else 100 + len(included)
    assert obs.num_examples == rows and 0 < included.sum() < len(included)
    keys = [k for k, _ in model.named_parameters()]
    scores = canaries.scores(flatten(obs.update(), keys))
    return audit(scores, included, 1e-5, 0.95, 0.5), obs


def test_audit_is_positive_without_dp_and_below_the_accountant_with_it():
    plain, _ = _audited({})
    assert plain.epsilon_lower_bound > 1.5 and plain.correct >= 0.9 * plain.guesses
    private, obs = _audited({"dp": "local", "noise-multiplier": 1.0, "delta": 1e-5})
    claimed = float(obs.disclosed["epsilon"])
    assert private.epsilon_lower_bound <= claimed
    assert private.epsilon_lower_bound < plain.epsilon_lower_bound


def test_the_auc_interval_covers_the_true_auc_about_95_percent_of_the_time():
    # Two normal score distributions a distance d apart: AUC = Phi(d / sqrt 2).
    from scipy.stats import norm

    rng = np.random.default_rng(0)
    d, n, runs = 1.0, 30, 400
    true = norm.cdf(d / math.sqrt(2))
    hits = 0
    for _ in range(runs):
        s = membership_scores(rng.normal(d, 1, n), rng.normal(0, 1, n))
        lo, hi = s["auc-ci95"]
        hits += lo <= true <= hi
    assert 0.90 <= hits / runs <= 0.99
    # a TPR at 1% FPR needs 100 non-members; with 30 there is none to report
    assert s["tpr-at-1%fpr"] is None and s["tpr-at-0.1%fpr"] is None
    big = membership_scores(rng.normal(d, 1, 200), rng.normal(0, 1, 200))
    assert big["tpr-at-1%fpr"] is not None and big["tpr-at-0.1%fpr"] is None


def test_scores_agree_with_scikit_image_and_matching_undoes_a_permutation():
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    gen = torch.Generator().manual_seed(0)
    original = torch.rand(4, 1, 28, 28, generator=gen)
    recon = (original + 0.1 * torch.randn(4, 1, 28, 28, generator=gen)).clamp(0, 1)
    perm = torch.tensor([2, 0, 3, 1])
    s = reconstruction_scores(recon[perm], torch.zeros(4).long(), original,
                              torch.zeros(4).long())
    assert s["matched"] == perm.tolist()
    a, b = recon.numpy()[:, 0].astype(np.float64), original.numpy()[:, 0].astype(np.float64)
    psnr = np.mean([peak_signal_noise_ratio(b[i], a[i], data_range=1.0) for i in range(4)])
    ssim = np.mean([structural_similarity(b[i], a[i], data_range=1.0, gaussian_weights=True,
                                          sigma=1.5, use_sample_covariance=False)
                    for i in range(4)])
    assert s["psnr"] == pytest.approx(psnr, abs=1e-3)
    assert s["ssim"] == pytest.approx(ssim, abs=2e-2)


def test_pruning_keeps_only_the_largest_entries_of_the_update():
    old = {"w": torch.zeros(10), "b": torch.zeros(2)}
    new = {"w": torch.arange(1.0, 11.0) * torch.tensor([1.0, -1.0] * 5),
           "b": torch.tensor([20.0, -0.5])}
    pruned = Prune(0.5).apply(old, new, {})
    kept = torch.cat([pruned["w"], pruned["b"]])
    assert int((kept != 0).sum()) == 6 and float(pruned["b"][0]) == 20.0
    assert kept.abs().min() == 0 and sorted(kept.abs().tolist())[6:] == [6, 7, 8, 9, 10, 20]


def test_observations_round_trip(tmp_path):
    _, _, obs, _, _ = observe({"observed-examples": 4, "batch-size": 2})
    obs.released = {k: v + 1 for k, v in obs.received.items()}
    obs.save(tmp_path)
    (back,) = load_all(tmp_path)
    assert back.name == "round-1-client-0" and back.training == obs.training
    assert back.num_examples == 4 and back.disclosed["num-examples"] == 4
    for k in obs.sent:
        np.testing.assert_array_equal(back.received[k], obs.received[k])
        np.testing.assert_array_equal(back.released[k], obs.released[k])
