"""Local DP-SGD: accounting against a fresh Opacus accountant, calibration, Opacus wiring."""

import math
import threading

import numpy as np
import pytest
import torch

from clients.anonymized import holdout_split
from clients.local_dp import LocalDPError, new_ledger
from clients.update import Client, training_data
from privacy.anonymize import anonymize, dp_sgd_unit, rowwise_anonymizers
from privacy.dp.accounting import (
    BudgetTooSmall,
    ClientLedger,
    calibrate_noise,
    epsilon,
    merge,
    planned_rounds,
)
from privacy.dp.dpsgd import UnsupportedModelError, check_model, make_private, resolve_mode
from privacy.dp.public import PublicSchedule
from tasks.config import ConfigError, validate
from tasks.models import build_model
from tasks.seeding import derive_seed
from tasks.splits import Split
from tasks.training import make_loader, sgd, train_epochs

from .conftest import fresh_epsilon


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_ledger_epsilon_equals_a_fresh_accountant_over_the_whole_history(kind):
    ledger = ClientLedger(noise_multiplier=1.1, sample_rate=1 / 13, delta=1e-4,
                          accountant=kind)
    assert ledger.epsilon() == 0.0
    for _ in range(3):  # three rounds of 13 steps
        ledger.record(13)
    assert ledger.history == [(1.1, 1 / 13, 39)]  # consecutive identical entries merge
    expected = fresh_epsilon([(1.1, 1 / 13, 13)] * 3, 1e-4, kind)
    assert ledger.epsilon() == pytest.approx(expected, rel=1e-6)
    # a one-round accountant (Flower's Opacus example) reports far less
    assert fresh_epsilon([(1.1, 1 / 13, 13)], 1e-4, kind) < 0.7 * expected


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_pld_epsilon_is_dp_accountings_accountant_to_the_bit(relation):
    # each entry's one-step PLD is built once per process and self-composed, as
    # dp-accounting's PLDAccountant composes PoissonSampledDpEvent(q, Gaussian) x steps
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
    from dp_accounting.pld import PLDAccountant

    from privacy.dp.accounting import _pld_epsilon, _rdp_epsilon, dp_relation, pld_interval

    for history in [((1.0, 1 / 13, 13),), ((1.1, 0.125, 40), (0.9, 0.02, 300)),
                    ((0.8, 1.0, 5),), ((1.3, 0.05, 100), (1.3, 1.0, 3))]:
        rough = _rdp_epsilon(history, 1e-5) * (2 if relation == "replace-one" else 1)
        acc = PLDAccountant(dp_relation(relation),
                            value_discretization_interval=pld_interval(rough))
        for sigma, q, steps in history:
            event = GaussianDpEvent(sigma)
            acc.compose(PoissonSampledDpEvent(q, event) if q < 1 else event, steps)
        assert _pld_epsilon(history, 1e-5, relation) == float(acc.get_epsilon(1e-5))


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_the_self_composition_with_cached_bounds_is_dp_accountings_to_the_bit(relation):
    # the Chernoff bounds' log-MGFs are computed once per one-step PLD; every PMF the
    # round's self-composition gives is still dp-accounting's own, array for array
    import numpy as np

    from privacy.dp.accounting import _one_step_pld, _self_composed

    for sigma, q in ((1.0, 0.08), (0.7, 0.01), (2.0, 0.25)):
        one = _one_step_pld(sigma, q, 1e-3, relation)
        for steps in (1, 13, 65, 260, 13):  # the last again: from the cache
            ours, theirs = _self_composed(one, steps), one.self_compose(steps)
            for a, b in ((ours._pmf_remove, theirs._pmf_remove),
                         (ours._pmf_add, theirs._pmf_add)):
                assert (a._lower_loss, a._infinity_mass) == (b._lower_loss, b._infinity_mass)
                assert np.array_equal(a._probs, b._probs)
            assert ours.get_epsilon_for_delta(1e-5) == theirs.get_epsilon_for_delta(1e-5)


def test_the_self_composition_flushing_subnormals_is_dp_accountings_to_the_bit():
    # the MNIST default's one-step PLD on the default grid: after 35 and more steps the
    # spectrum's high frequencies fall below 2^-1022 (the power, flushed, 2-5x faster)
    import numpy as np
    from scipy import fft

    from privacy.dp.accounting import _one_step_pld, _self_composed

    one = _one_step_pld(1.0, 0.16, 1e-4, "add-remove")
    spectrum = fft.fft(one._pmf_remove._probs) ** 70
    assert np.any((spectrum.real != 0) & (np.abs(spectrum.real) < np.finfo(float).tiny))
    for steps in (35, 70, 105):
        ours, theirs = _self_composed(one, steps), one.self_compose(steps)
        for a, b in ((ours._pmf_remove, theirs._pmf_remove),
                     (ours._pmf_add, theirs._pmf_add)):
            assert a._lower_loss == b._lower_loss
            assert np.array_equal(a._probs, b._probs)


def test_flushed_subnormals_flushes_inside_and_restores_the_thread_after():
    import numpy as np
    import torch

    from privacy.dp.accounting import flushed_subnormals

    tiny = np.finfo(np.float64).tiny

    def flushing() -> bool:
        return bool(np.multiply(tiny, 0.5) == 0.0)

    assert not flushing()
    inside, elsewhere = threading.Event(), []  # a thread running beside it (training)
    thread = threading.Thread(target=lambda: inside.wait() and elsewhere.append(flushing()))
    thread.start()
    with flushed_subnormals():
        assert flushing() == torch.set_flush_denormal(True)  # where the CPU can
        inside.set()
        thread.join()
    assert elsewhere == [False]
    assert not flushing()
    if torch.set_flush_denormal(True):  # a thread that flushes already keeps flushing
        try:
            with flushed_subnormals():
                assert flushing()
            assert flushing()
        finally:
            torch.set_flush_denormal(False)


def test_the_epsilon_computed_ahead_while_a_round_trains_is_the_one_reported():
    ledger = ClientLedger(noise_multiplier=1.07, sample_rate=1 / 11, delta=1e-5)
    ledger.record(11)
    ledger.epsilon_ahead(11)  # on a worker thread, as the round starts training
    ledger.record(11)
    assert ledger.epsilon() == pytest.approx(
        fresh_epsilon([(1.07, 1 / 11, 22)], 1e-5, "pld"), rel=1e-9)


def test_the_default_claim_is_dp_accountings_pld_and_tighter_than_rdp():
    # the audit's Poisson setting (q 0.1, 30 steps): PLD 6.90 where RDP says 8.00
    assert ClientLedger(1.0, 0.1, 1e-5).accountant == "pld"
    for sigma, q, steps in [(0.8, 0.1, 30), (1.1, 0.1, 30), (1.0, 1 / 13, 39)]:
        pld = epsilon([(sigma, q, steps)], 1e-5)
        assert pld == pytest.approx(fresh_epsilon([(sigma, q, steps)], 1e-5, "pld"), rel=1e-9)
        assert pld < 0.95 * epsilon([(sigma, q, steps)], 1e-5, "rdp")
    # replace-one: dp-accounting's REPLACE_ONE analysis, larger than add-remove's
    r1 = epsilon([(1.0, 0.1, 30)], 1e-5, "pld", "replace-one")
    assert r1 == pytest.approx(fresh_epsilon([(1.0, 0.1, 30)], 1e-5, "pld", "replace-one"),
                               rel=1e-9)
    assert r1 > epsilon([(1.0, 0.1, 30)], 1e-5, "pld")
    with pytest.raises(ValueError, match="add/remove neighbours only"):
        epsilon([(1.0, 0.1, 30)], 1e-5, "rdp", "replace-one")


def test_prv_accountant_is_supported_and_tighter():
    hist = [(1.0, 0.05, 200)]
    assert epsilon(hist, 1e-5, "prv") == pytest.approx(fresh_epsilon(hist, 1e-5, "prv"),
                                                       rel=1e-6)
    assert epsilon(hist, 1e-5, "prv") < epsilon(hist, 1e-5, "rdp")


def test_ledger_round_trips_through_a_flower_record():
    from flwr.app import ConfigRecord

    ledger = ClientLedger(0.9, 0.1, 1e-5, "rdp", 3.0)
    ledger.record(10)
    ledger.noise_multiplier = 1.2
    ledger.record(5)
    record = ConfigRecord(ledger.to_dict())
    again = ClientLedger.from_dict(dict(record))
    assert again == ledger and merge(again.history) == ((0.9, 0.1, 10), (1.2, 0.1, 5))
    empty = ClientLedger(1.0, 0.1, 1e-5)
    assert ClientLedger.from_dict(dict(ConfigRecord(empty.to_dict()))) == empty


def test_budget_check_looks_ahead_one_round():
    sigma = calibrate_noise(2.0, 1e-4, 0.1, 100)
    ledger = ClientLedger(sigma, 0.1, 1e-4, budget=2.0)
    ledger.record(50)
    assert not ledger.would_exceed(50)  # exactly the planned 100 steps fit
    ledger.record(50)
    assert ledger.epsilon() <= 2.0
    assert ledger.would_exceed(10)


@pytest.mark.parametrize("kind", ["pld", "rdp", "prv"])
def test_calibration_meets_the_target_without_wasting_it(kind):
    sigma = calibrate_noise(3.0, 1e-5, 0.02, 500, kind)
    eps = fresh_epsilon([(sigma, 0.02, 500)], 1e-5, kind)
    assert 2.9 <= eps <= 3.0


def test_too_small_a_budget_is_reported():
    # one accountant call at Opacus' largest sigma, not its ~17 doublings (about 20 s)
    with pytest.raises(BudgetTooSmall, match="cannot be met .* even a noise multiplier of "
                                             "1e\\+06 gives epsilon 0.10") as refused:
        calibrate_noise(1e-4, 1e-5, 0.5, 10_000, "rdp")
    # and a way out: the least target that can be met, or what else to change
    assert "Set target-epsilon to at least 0.10" in str(refused.value)
    assert "accountant = 'pld'" in str(refused.value)
    with pytest.raises(BudgetTooSmall, match="cannot be met .* under dp-accounting's PLD"):
        calibrate_noise(1e-4, 1e-5, 0.5, 10_000)
    # dp-accounting directly agrees that no noise Opacus tries is enough under RDP
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(SelfComposedDpEvent(PoissonSampledDpEvent(0.5, GaussianDpEvent(1e6)), 10_000))
    assert acc.get_epsilon(1e-5) > 1e-4


def test_planned_rounds_follow_flowers_sampling():
    assert planned_rounds(10, 1.0, 1, 10) == 10
    assert planned_rounds(10, 0.1, 1, 100) == 1
    assert planned_rounds(5, 0.34, 1, 3) == 2  # one client a round, 5 rounds over 3 clients
    assert planned_rounds(5, 0.1, 2, 10) == 1


def _cfg(**kw):
    return validate({"dp": "local", **kw})


def test_new_ledger_derives_sigma_from_the_whole_run():
    cfg = _cfg(**{"target-epsilon": 2.0, "num-server-rounds": 4, "batch-size": 32})
    plan = PublicSchedule(400, 32)
    ledger = new_ledger(cfg, plan, 10)
    per_epoch = plan.steps_per_epoch
    assert per_epoch == 13 and ledger.sample_rate == pytest.approx(32 / 400)
    assert ledger.delta == pytest.approx(1 / 4000) and ledger.accountant == "pld"
    eps_full = fresh_epsilon([(ledger.noise_multiplier, 32 / 400, 4 * per_epoch)], 1 / 4000,
                             "pld")
    assert 1.99 <= eps_full <= 2.0
    fixed = new_ledger(_cfg(**{"noise-multiplier": 0.7}), plan, 10)
    assert fixed.noise_multiplier == 0.7 and fixed.budget == 0


def test_bad_local_dp_settings_are_explained():
    with pytest.raises(LocalDPError, match="delta = 0.01 is not below 1/N"):
        new_ledger(_cfg(delta=0.01), PublicSchedule(400, 32), 10)
    with pytest.raises(LocalDPError, match="cannot be met"):
        new_ledger(_cfg(**{"target-epsilon": 1e-4, "accountant": "rdp"}),
                   PublicSchedule(400, 32), 10)
    with pytest.raises(ConfigError, match="Opacus' accountants analyse add/remove"):
        validate({"dp": "local", "dp-relation": "replace-one", "accountant": "rdp"})
    with pytest.raises(ConfigError, match="no public size is used"):
        validate({"dp": "local", "dp-relation": "replace-one", "dp-public-records": 100})
    with pytest.raises(ConfigError, match="gives no privacy"):
        validate({"dp": "local", "noise-multiplier": 0})
    with pytest.raises(ConfigError, match="proximal term would be silently dropped"):
        validate({"dp": "local", "strategy": "fedprox"})
    with pytest.raises(ConfigError, match="noise-multiplier = -1 must be >= 0"):
        validate({"noise-multiplier": -1})
    with pytest.raises(ConfigError, match="max-grad-norm = 0 must be > 0"):
        validate({"max-grad-norm": 0})
    with pytest.raises(ConfigError, match="delta = 1.5 must be < 1"):
        validate({"delta": 1.5})
    with pytest.raises(ConfigError, match="target-epsilon = -1 must be >= 0"):
        validate({"target-epsilon": -1})


def test_unsupported_layer_is_named():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 26 * 26, 10))
    with pytest.raises(UnsupportedModelError, match="BatchNorm.*GroupNorm"):
        check_model(model)


def _private_step(mode, noise, seed=0):
    torch.manual_seed(0)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    model = build_model("small-cnn", (1, 28, 28), 10)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    private = make_private(model, sgd(model, 1.0), make_loader(x, y, 8, seed),
                           noise_multiplier=noise, max_grad_norm=0.5, grad_sample_mode=mode,
                           seed=seed)
    torch.manual_seed(1)
    train_epochs(private.model, private.loader, private.optimizer, 1, torch.device("cpu"),
                 criterion=private.criterion)
    end = private.module().state_dict()
    return private, {k: end[k] - start[k] for k in start}


def test_hooks_and_ghost_clipping_compute_the_same_update():
    hooks, d_hooks = _private_step("hooks", 0.0)
    ghost, d_ghost = _private_step("ghost", 0.0)
    for k in d_hooks:
        assert torch.allclose(d_hooks[k], d_ghost[k], atol=1e-5), k
    assert hooks.history() == ghost.history() == [(0.0, 0.125, 8)]
    assert list(hooks.module().state_dict())[0] == "features.0.weight"  # unwrapped keys


def test_noise_is_added_and_comes_from_torchs_generator():
    _, a = _private_step("ghost", 1.0)
    _, b = _private_step("ghost", 1.0)
    _, clean = _private_step("ghost", 0.0)
    key = "classifier.2.weight"
    assert torch.equal(a[key], b[key])  # reproducible under the same seeds
    assert not torch.allclose(a[key], clean[key])
    # DP-SGD's noise (Opacus): each step adds N(0, (sigma C)^2) to the sum of clipped
    # per-sample gradients and divides by the expected batch size q n = 0.125 * 64 = 8;
    # SGD at lr 1 over the 8 steps of the epoch sums 8 independent draws. So every
    # weight moves by noise of std lr sigma C / (q n) * sqrt(steps) = 0.177 (measured
    # 0.1761 on classifier.0.weight, 16384 weights, and 0.1779 on features.3.weight).
    # Noise-free training follows the same batches, so noisy - clean is that noise up to
    # the small change of the gradients along the noisy trajectory.
    lr, sigma, clip, n, q, steps = 1.0, 1.0, 0.5, 64, 0.125, 8
    expected = lr * sigma * clip / (q * n) * math.sqrt(steps)
    for key in ("classifier.0.weight", "features.3.weight"):
        measured = float((a[key] - clean[key]).std())
        assert measured == pytest.approx(expected, rel=0.05), key


@pytest.mark.parametrize(("name", "optimizer", "noise"), [
    *((name, "sgd", noise) for name in ("small-cnn", "cnn", "mlp") for noise in (0.0, 1.0)),
    ("small-cnn", "adam", 1.0), ("mlp", "adamw", 1.0)])
def test_bookkeeping_takes_the_same_dp_sgd_steps_as_opacus_hooks(name, optimizer, noise):
    # One backward pass (Bu et al. 2023) against Opacus' materialized per-sample
    # gradients: same batches, same clipping, same noise draws, same accounting; the
    # trained weights agree to float rounding after an epoch of 8 steps, whichever client
    # optimiser steps on the noisy clipped gradient (client-optimizer). Adam is compared
    # with noise only: on a near-zero noiseless gradient its step g / sqrt(v) is about
    # sign(g), which turns float rounding into a whole step.
    from types import SimpleNamespace

    from tasks.training import client_optimizer

    t = SimpleNamespace(client_optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 0.01,
                        momentum=0.0, weight_decay=0.0)

    def trained(mode):
        torch.manual_seed(0)
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
        model = build_model(name, (1, 28, 28), 10)
        private = make_private(model, client_optimizer(model, t, for_opacus=True),
                               make_loader(x, y, 8, 3),
                               noise_multiplier=noise, max_grad_norm=0.5,
                               grad_sample_mode=mode, seed=3)
        torch.manual_seed(1)
        train_epochs(private.model, private.loader, private.optimizer, 1,
                     torch.device("cpu"), criterion=private.criterion)
        return private, private.module()

    hooks, a = trained("hooks")
    kept, b = trained("bookkeeping")
    assert kept.history() == hooks.history() == [(noise, 0.125, 8)]  # the same accounting
    inner = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    assert type(kept.optimizer.original_optimizer) is inner[optimizer]
    assert list(b.state_dict()) == list(a.state_dict())  # the plain model, unwrapped
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.allclose(va, vb, atol=1e-5), k
    assert all(p.requires_grad for p in b.parameters())  # hooks removed, params trainable


def test_bookkeeping_steps_on_an_empty_poisson_batch_with_noise_only():
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    private = make_private(model, sgd(model, 1.0), make_loader(x, y, 1, 0),
                           noise_multiplier=1.0, max_grad_norm=1.0,
                           grad_sample_mode="bookkeeping", seed=0)
    logits = private.model(x[:0])
    private.criterion(logits, y[:0]).backward()
    private.optimizer.step()
    moved = private.module().state_dict()
    # no example: the update is N(0, (sigma C)^2) / (q n) per weight, lr 1, q n = 1
    delta = torch.cat([(moved[k] - before[k]).flatten() for k in before])
    assert float(delta.std()) == pytest.approx(1.0, rel=0.05)
    assert private.history() == [(1.0, 0.25, 1)]


def test_bookkeeping_refuses_models_it_does_not_cover():
    model = torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3), torch.nn.Flatten(),
                                torch.nn.Linear(24, 2))  # Opacus has Conv1d; book-keeping not
    with pytest.raises(UnsupportedModelError, match="Conv1d"):
        make_private(model, sgd(model, 0.1), make_loader(torch.randn(4, 1, 8),
                                                         torch.zeros(4).long(), 2, 0),
                     noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="bookkeeping")


def test_auto_mode_choice():
    assert resolve_mode("auto", "cnn") == "bookkeeping"
    assert resolve_mode("auto", "mlp") == "bookkeeping"
    assert resolve_mode("auto", "resnet18") == "bookkeeping"
    assert resolve_mode("auto", "small-cnn") == "bookkeeping"
    for name in ("char-gru", "char-lstm", "char-transformer"):
        assert resolve_mode("auto", name) == "bookkeeping"
    assert resolve_mode("hooks", "cnn") == "hooks"
    assert math.isclose(PublicSchedule(60, 8).sample_rate, 8 / 60)
    assert PublicSchedule(60, 8).steps_per_epoch == 8 and PublicSchedule(5, 8).sample_rate == 1


@pytest.mark.parametrize("name", sorted(rowwise_anonymizers() - {"none"})
                         + ["ksame", "density", "pca", "random"])
def test_rowwise_anonymizers_change_one_released_row_per_changed_record(name):
    # The classification behind dp_sgd_unit: replace one original record (same seed) and
    # count the released rows that change. Row-wise: exactly one; the others: more.
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1, (60, 16)), rng.normal(6, 1, (60, 16))]).astype(
        np.float32)
    y = np.repeat([0, 1], 60)
    params = validate({"features": "embeddings", "anonymizer": name, "k": 5, "dbscan-eps": 3.0,
                       "dbscan-min-samples": 3, "pca-components": 4}).anonymization.params()
    neighbour = x.copy()
    neighbour[7] = rng.normal(3, 1, 16)
    a = anonymize(name, x, y, params, seed=1, num_classes=2)
    b = anonymize(name, neighbour, y, params, seed=1, num_classes=2)
    changed = int((np.abs(a.x - b.x).max(axis=1) > 1e-6).sum())
    if name in rowwise_anonymizers():
        assert changed == 1 and dp_sgd_unit(name, "released") == "record"
    else:
        assert changed > 1 and dp_sgd_unit(name, "released") == "released row"
        assert dp_sgd_unit(name, "original") == "record"


def test_dp_train_data_chooses_between_the_release_and_the_original_records():
    from flwr.app import Context, RecordDict

    rng = np.random.default_rng(0)
    split = Split(torch.from_numpy(rng.normal(size=(80, 8)).astype(np.float32)),
                  torch.from_numpy(np.repeat(np.arange(4), 20)), 4)
    base = {"features": "embeddings", "anonymizer": "ksame", "k": 4, "dp": "local"}
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    x_rel, _, scores = training_data(Client(validate(base), 0, 10, split), ctx)
    x_org, y_org, _ = training_data(
        Client(validate({**base, "dp-train-data": "original"}), 0, 10, split), ctx)
    members, _ = holdout_split(80, 0.1, derive_seed(42, 0))
    torch.testing.assert_close(x_org, split.x[members])
    torch.testing.assert_close(y_org, split.y[members])
    assert len(x_rel) == len(members) and not torch.allclose(x_rel, x_org)
    assert "anon-reid-top1" in scores  # the release is still produced and scored


def test_secure_rng_draws_unpredictable_noise_of_the_right_scale():
    private, _ = _private_step("hooks", 1.0)
    assert not private.optimizer.secure_mode
    torch.manual_seed(0)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    model = build_model("small-cnn", (1, 28, 28), 10)
    secure = make_private(model, sgd(model, 1.0), make_loader(x, y, 8, 0), noise_multiplier=2.0,
                          max_grad_norm=0.5, seed=0, secure=True)
    opt = secure.optimizer
    assert opt.secure_mode and opt.generator is not None
    # batches from an entropy-seeded generator too, on the CPU where they are drawn; the
    # noise's on the training device (a CUDA generator on a GPU: one CPU generator for
    # both failed every DP-SGD step there)
    batches = secure.loader.batch_sampler.generator
    assert batches is not None and batches is not opt.generator
    assert batches.device.type == "cpu" and opt.generator.device.type == "cpu"
    for mode in ("hooks", "bookkeeping"):
        model = build_model("small-cnn", (1, 28, 28), 10)
        private = make_private(model, sgd(model, 1.0), make_loader(x, y, 8, 0),
                               noise_multiplier=2.0, max_grad_norm=0.5, seed=0, secure=True,
                               grad_sample_mode=mode, device=torch.device("cpu"))
        assert private.optimizer.generator.initial_seed() != \
            private.loader.batch_sampler.generator.initial_seed(), mode

    def noise():
        for p in opt.params:
            p.summed_grad = torch.zeros_like(p)
        opt.add_noise()
        return torch.cat([p.grad.flatten() for p in opt.params])  # N(0, (sigma C)^2)

    a, b = noise(), noise()
    assert float(a.std()) == pytest.approx(2.0 * 0.5, rel=0.03)  # sigma C
    assert not torch.allclose(a, b)


def test_the_pre_flight_check_states_the_local_dp_settings_a_run_will_use():
    """What `fedpriv run` prints as "privacy: ..." before any process starts: the noise
    each client calibrated from its own record count and the budget."""
    from experiments.preflight.checks import preflight
    from tasks.config import validate

    cfg = validate({"num-clients": 3, "num-server-rounds": 5, "fraction-train": 0.34,
                    "dp": "local", "target-epsilon": 2.0, "batch-size": 64})
    text = preflight(cfg).privacy
    assert text.startswith("local DP-SGD (record-level): noise multiplier ")
    assert "clipping 1.0, target-epsilon 2.0 per client" in text
    sigma = float(text.split("noise multiplier ")[1].split(",")[0])  # one for every client
    # public N = 4,000 // 3 = 1,333: 21 batches of q = 64/N an epoch, 2 planned rounds
    assert "public N = 1333 records (the expected partition size): q = 0.04801, 21 steps" \
        in text and "add-remove neighbours" in text and "dp-accounting PLD" in text
    assert sigma == pytest.approx(calibrate_noise(2.0, 1 / (10 * 1333), 64 / 1333, 42),
                                  rel=1e-3)


@pytest.mark.parametrize("mode", ["hooks", "bookkeeping"])
def test_with_a_noise_seed_the_noise_owes_nothing_to_torchs_global_generator(mode):
    """clients.local_dp gives DP-SGD's noise a generator of its own (noise_seed): the
    update no longer depends on what else drew from torch's global generator, so clients
    can train side by side in threads with the noise each would draw alone."""
    def update(global_seed, noise_seed):
        torch.manual_seed(0)
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
        model = build_model("small-cnn", (1, 28, 28), 10)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        private = make_private(model, sgd(model, 1.0), make_loader(x, y, 8, 3),
                               noise_multiplier=1.0, max_grad_norm=0.5,
                               grad_sample_mode=mode, seed=3, noise_seed=noise_seed)
        torch.manual_seed(global_seed)
        train_epochs(private.model, private.loader, private.optimizer, 1,
                     torch.device("cpu"), criterion=private.criterion)
        end = private.module().state_dict()
        return torch.cat([(end[k] - start[k]).flatten() for k in start])

    assert torch.equal(update(1, 7), update(2, 7))  # the global generator plays no part
    assert not torch.allclose(update(1, 7), update(1, 8))  # the noise seed does
    assert not torch.equal(update(1, None), update(2, None))  # without it: Opacus' draws
    # and it is the mechanism's noise: the difference of two noise seeds' updates is two
    # independent draws of lr sigma C / (q n) sqrt(steps) per weight (as in
    # test_noise_is_added_and_comes_from_torchs_generator), up to the small change of the
    # gradients along the two noisy trajectories
    expected = 1.0 * 1.0 * 0.5 / (0.125 * 64) * math.sqrt(8) * math.sqrt(2)
    assert float((update(1, 7) - update(1, 8)).std()) == pytest.approx(expected, rel=0.05)


def test_adamw_survives_opacus_swapping_in_its_recurrent_layers():
    """A recurrent model's layers are swapped for Opacus' DP versions and the optimiser
    rebuilt over them: with AdamW too (its defaults hold a setting its constructor does
    not take), with its learning rate and weight decay kept."""
    from types import SimpleNamespace

    from tasks.training import client_optimizer

    torch.manual_seed(0)
    model = build_model("char-gru", (80,), 80)
    t = SimpleNamespace(client_optimizer="adamw", lr=0.003, momentum=0.0, weight_decay=0.01)
    x, y = torch.randint(0, 80, (16, 80)), torch.randint(0, 80, (16,))
    private = make_private(model, client_optimizer(model, t, for_opacus=True),
                           make_loader(x, y, 4, 1),
                           noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="hooks",
                           seed=1)
    inner = private.optimizer.original_optimizer
    assert type(inner) is torch.optim.AdamW
    assert inner.defaults["lr"] == 0.003 and inner.defaults["weight_decay"] == 0.01
    train_epochs(private.model, private.loader, private.optimizer, 1, torch.device("cpu"),
                 criterion=private.criterion)


def test_a_runs_pld_grid_holds_while_its_epsilon_grows_past_ten():
    """Above epsilon 10 the grid is coarser in proportion, rounded up to a power of two:
    never finer than the proportional grid (memory), at most twice as coarse, and the same
    for every round until epsilon doubles, so the one-step PLD (2 s) is built once."""
    from privacy.dp.accounting import _one_step_pld, _rdp_epsilon, pld_interval

    for eps in (0.5, 10.0, 10.01, 13.0, 20.0, 20.5, 77.0, 1e4):
        step = pld_interval(eps)
        proportional = 1e-4 * max(1.0, eps / 10)
        assert proportional <= step < 2 * proportional + 1e-15
    sigma, q, per_round = 0.9, 0.1, 10
    rounds = [r for r in range(1, 60)
              if 10 < _rdp_epsilon(((sigma, q, r * per_round),), 1e-5) <= 20][:4]
    assert len(rounds) == 4  # several rounds in one octave of epsilon
    assert len({pld_interval(_rdp_epsilon(((sigma, q, r * per_round),), 1e-5))
                for r in rounds}) == 1
    before = _one_step_pld.cache_info().misses
    ledger = ClientLedger(noise_multiplier=sigma, sample_rate=q, delta=1e-5)
    ledger.record(rounds[0] * per_round)
    for _ in rounds:
        ledger.epsilon()
        ledger.record(per_round)
    assert _one_step_pld.cache_info().misses - before <= 1


def test_the_composition_and_epsilon_without_python_loops_are_dp_accountings_to_the_bit():
    """dp-accounting walks a composed PMF's tails and its losses above epsilon in Python;
    ours are numpy's sequential running sums with the C library's exp and log: the same
    PMFs and epsilons, on composed PLDs of both relations and on random dense PMFs (zero
    entries, an infinite mass, losses far below zero, every branch of the walk)."""
    import numpy as np
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as plm

    from privacy.dp import accounting as acc

    def same(a, b):
        return (a._lower_loss == b._lower_loss and a._infinity_mass == b._infinity_mass
                and np.array_equal(a._probs, b._probs))

    deltas = (0.0, 1e-15, 1e-10, 1e-5, 1e-3, 0.3)
    for relation in ("add-remove", "replace-one"):
        for sigma, q, steps, interval in ((1.0, 0.08, 65, 1e-4), (0.7, 0.01, 300, 1e-4),
                                          (0.6, 0.5, 50, 2e-3)):
            composed = acc._self_composed(acc._one_step_pld(sigma, q, interval, relation),
                                          steps)
            identity = plm.identity(value_discretization_interval=interval)
            theirs, ours = identity.compose(composed), acc._composed(identity, composed)
            assert same(theirs._pmf_remove, ours._pmf_remove)
            assert same(theirs._pmf_add, ours._pmf_add)
            for delta in deltas:
                assert acc._epsilon_for_delta(ours, delta) == theirs.get_epsilon_for_delta(delta)
    rng = np.random.default_rng(7)

    def outcome(f, *args):
        try:
            return f(*args)
        except OverflowError:  # a loss below -709 that the walk reaches
            return "overflow"

    for _ in range(120):
        size = int(rng.integers(1, 12000))
        probs = rng.random(size) ** rng.uniform(1, 30)
        probs[rng.random(size) < 0.3] = 0
        probs /= max(probs.sum(), 1e-300) * rng.uniform(1, 1.5)
        pmf = pld_pmf.DensePLDPmf(float(rng.choice([1e-4, 1e-2, 1.0, 50.0])),
                                  int(rng.integers(-size, 10)), probs.copy(),
                                  float(rng.choice([0.0, 1e-12, 0.2])), True)
        pld = plm.PrivacyLossDistribution(pmf)
        for delta in deltas:
            mine = outcome(acc._epsilon_for_delta, pld, delta)
            theirs = outcome(pmf.get_epsilon_for_delta, delta)
            assert mine == theirs
        for tail in (0.0, 1e-15, 1e-3, 0.1):
            for pessimistic in (True, False):
                a = pld_pmf._truncate_tails(probs.copy(), tail, pessimistic)
                b = acc._truncated(probs.copy(), tail, pessimistic)
                assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.parametrize(("cpus", "ahead"), [(1, False), (2, True)])
def test_a_client_draws_its_noise_ahead_only_with_a_core_to_spare(cpus, ahead):
    # every runtime gives a client client-cpus cores; with one torch thread on each of
    # them (the default) the thread drawing the next step's noise would only take turns
    # with training, so the draws are made in the step (the same draws either way)
    from flwr.app import Context, RecordDict

    from clients.update import local_update
    from privacy.dp import background
    from tasks.splits import client_split, model_for

    cfg = validate({"dp": "local", "noise-multiplier": 1.0, "client-cpus": cpus})
    for worker in background._WORKERS.values():
        worker.shutdown()
    background._WORKERS.clear()
    client = Client(cfg, 0, 10, client_split(cfg, 0, 10))
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    _, metrics = local_update(client, ctx, model_for(cfg)[0].state_dict(), {"server-round": 1})
    assert metrics["dp-steps"] > 0
    assert ("noise" in background._WORKERS) == ahead


def test_a_client_computes_the_next_rounds_epsilon_ahead_except_after_the_last(monkeypatch):
    """While a round trains, its epsilon is computed ahead, and after it the next round's
    (the federation's time between rounds); after the run's last round nothing more: an
    epsilon no round will report would only take CPU from the clients still training."""
    from flwr.app import Context, RecordDict

    from clients.update import local_update
    from privacy.dp import accounting
    from tasks.splits import client_split, model_for

    asked: list[int] = []
    monkeypatch.setattr(accounting, "_ahead", lambda history, *rest: asked.append(
        sum(n for _, _, n in history)))
    cfg = validate({"dp": "local", "noise-multiplier": 1.0, "num-server-rounds": 2})
    client = Client(cfg, 0, 10, client_split(cfg, 0, 10))
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    state = model_for(cfg)[0].state_dict()
    _, first = local_update(client, ctx, state, {"server-round": 1})
    steps = first["dp-steps"]
    assert asked == [steps, 2 * steps]  # this round's, then the next one's
    _, last = local_update(client, ctx, state, {"server-round": 2})
    assert last["dp-steps"] == 2 * steps and asked == [steps, 2 * steps, 2 * steps]


def test_release_digest_hashes_the_round_the_training_config_and_the_model():
    # the replay check's key: sha256 of json [round, training config] and the state; the
    # config's JSON is converted once per config, the bytes hashed are the same
    import hashlib
    import json
    from dataclasses import asdict

    from clients.local_dp import release_digest

    cpu = torch.device("cpu")
    cfg = validate({"dp": "local", "noise-multiplier": 1.0})
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    h = hashlib.sha256()
    config = {k: v for k, v in asdict(cfg).items() if k not in ("results", "resources")}
    h.update(json.dumps([3, config], sort_keys=True, default=str).encode())
    for key, value in state.items():
        h.update(key.encode())
        h.update(value.numpy().tobytes())
    assert release_digest(cfg, 3, state, cpu) == h.hexdigest()
    assert release_digest(cfg, 3, state, cpu) == h.hexdigest()  # the cached config
    elsewhere = validate({"dp": "local", "noise-multiplier": 1.0, "results-dir": "/tmp/x"})
    assert release_digest(elsewhere, 3, state, cpu) == h.hexdigest()
    assert release_digest(cfg, 4, state, cpu) != h.hexdigest()
    lr = validate({"dp": "local", "noise-multiplier": 1.0, "lr": 0.5})
    assert release_digest(lr, 3, state, cpu) != h.hexdigest()
    assert release_digest(cfg, 3, {**state, "b": torch.zeros(2)}, cpu) != h.hexdigest()
    secure = validate({"dp": "local", "noise-multiplier": 1.0, "secure-rng": True})
    assert release_digest(secure, 3, state, cpu) == ""
