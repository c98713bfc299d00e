"""Clients of a round trained together (tasks.cohort_training) equal the sequential loop."""

import pytest
import torch

from tasks.cohort_training import CohortError, CohortTraining, train_cohort
from tasks.models import build_model
from tasks.training import make_loader, sgd, train_epochs


def _cohort(name, sizes):
    states, data, seeds = [], [], []
    for i, n in enumerate(sizes):
        torch.manual_seed(10 + i)  # each client starts from its own weights
        states.append(build_model(name, (1, 28, 28), 10).state_dict())
        data.append((torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))))
        seeds.append(100 + i)
    return states, data, seeds


@pytest.mark.parametrize("name", ["small-cnn", "cnn"])
def test_batched_cohort_equals_training_each_client_in_turn(name):
    # Uneven partitions (one batch, a short last batch, more steps than the others):
    # padded and masked, each client's weights and metrics are those of train_epochs.
    sizes = [37, 13, 40]
    states, data, seeds = _cohort(name, sizes)
    training = CohortTraining(lr=0.05, batch_size=16, local_epochs=1, momentum=0.5,
                              weight_decay=1e-3)
    together = train_cohort(build_model(name, (1, 28, 28), 10), states, data, seeds, training)
    for k in range(len(sizes)):
        model = build_model(name, (1, 28, 28), 10)
        model.load_state_dict(states[k])
        ref = train_epochs(model, make_loader(*data[k], 16, seeds[k]),
                           sgd(model, 0.05, 0.5, 1e-3), 1, torch.device("cpu"))
        state, result = together[k]
        assert list(state) == list(model.state_dict())
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
        assert (result.examples, result.steps) == (ref.examples, ref.steps)
        assert result.loss == pytest.approx(ref.loss, rel=1e-5)
        assert result.accuracy == ref.accuracy


def test_two_epochs_keep_each_clients_batch_order():
    states, data, seeds = _cohort("small-cnn", [20, 9])
    training = CohortTraining(lr=0.1, batch_size=8, local_epochs=2)
    together = train_cohort(build_model("small-cnn", (1, 28, 28), 10), states, data, seeds,
                            training)
    for k in range(2):
        model = build_model("small-cnn", (1, 28, 28), 10)
        model.load_state_dict(states[k])
        ref = train_epochs(model, make_loader(*data[k], 8, seeds[k]), sgd(model, 0.1), 2,
                           torch.device("cpu"))
        assert together[k][1].steps == ref.steps
        for key, value in model.state_dict().items():
            torch.testing.assert_close(together[k][0][key], value, rtol=1e-5, atol=1e-6)


def test_batchnorm_and_mixed_architectures_are_refused():
    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4),
                             torch.nn.Flatten(), torch.nn.Linear(4 * 26 * 26, 10))
    data = [(torch.randn(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))]
    training = CohortTraining(lr=0.1, batch_size=2)
    with pytest.raises(CohortError, match="BatchNorm.*GroupNorm"):
        train_cohort(bn, [bn.state_dict()], data, [0], training)
    small = build_model("small-cnn", (1, 28, 28), 10)
    mixed = [small.state_dict(), build_model("cnn", (1, 28, 28), 10).state_dict()]
    with pytest.raises(CohortError, match="client 1.*architecture"):
        train_cohort(small, mixed, data * 2, [0, 1], training)


def test_dp_sgd_cohort_takes_each_clients_opacus_steps():
    # Noise-free DP-SGD: the same Poisson batches as make_private's loader (empty ones
    # included), Opacus' clipping and the division by q n, client by client.
    from privacy.dp.dpsgd import make_private
    from tasks.cohort_training import CohortDP

    sizes = [24, 10, 17]
    states, data, seeds = _cohort("small-cnn", sizes)
    training = CohortTraining(lr=0.1, batch_size=8, local_epochs=1, momentum=0.5)
    together = train_cohort(build_model("small-cnn", (1, 28, 28), 10), states, data, seeds,
                            training, dp=CohortDP(0.0, 0.3))
    for k in range(len(sizes)):
        model = build_model("small-cnn", (1, 28, 28), 10)
        model.load_state_dict(states[k])
        private = make_private(model, sgd(model, 0.1, 0.5), make_loader(*data[k], 8, seeds[k]),
                               noise_multiplier=0.0, max_grad_norm=0.3,
                               grad_sample_mode="hooks", seed=seeds[k])
        ref = train_epochs(private.model, private.loader, private.optimizer, 1,
                           torch.device("cpu"), criterion=private.criterion)
        assert together[k][1].steps == ref.steps == sum(n for _, _, n in private.history())
        for key, value in private.module().state_dict().items():
            torch.testing.assert_close(together[k][0][key], value, rtol=1e-4, atol=1e-6)


def test_dp_sgd_cohort_noise_std_is_sigma_c_over_q_n():
    # One step (n = B: q = 1, q n = 8) at lr 1 without momentum: noisy minus noise-free
    # weights are the noise divided by q n, measured over every weight of 3 clients.
    from tasks.cohort_training import CohortDP

    states, data, seeds = _cohort("small-cnn", [8, 8, 8])
    training = CohortTraining(lr=1.0, batch_size=8)
    model = build_model("small-cnn", (1, 28, 28), 10)
    clean = train_cohort(model, states, data, seeds, training, dp=CohortDP(0.0, 0.5))
    noisy = train_cohort(model, states, data, seeds, training, dp=CohortDP(2.0, 0.5),
                         generator=torch.Generator().manual_seed(0))
    diff = torch.cat([(c[k] - n[k]).flatten()
                      for (c, _), (n, _) in zip(clean, noisy, strict=True) for k in c])
    assert float(diff.std()) == pytest.approx(2.0 * 0.5 / 8, rel=0.02)
    assert abs(float(diff.mean())) < 0.02 * 2.0 * 0.5 / 8
