"""A malicious server's trap weights (issue 25, first piece): records fall out of the
*aggregate* of 8 clients' updates verbatim, and local DP-SGD stops it. The clients train
as PyTorch (and Opacus, for DP-SGD) train; the attack reads only the summed update."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from privacy.attacks.imprint import recover, trap_weights
from tasks.datasets import load_dataset
from tasks.models import mlp_net

CLIENTS, BATCH, MEAN, STD = 8, 32, 0.1307, 0.3081


def _cohort_update(width: int, dp_sigma: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cohort's images, what the attack recovers from the mean of their updates)."""
    torch.manual_seed(0)
    data = load_dataset("mnist")
    x, y = data.to_tensor(data.x_train[:1500]), torch.from_numpy(data.y_train[:1500])
    model = mlp_net(784, (width, 64), 10)
    honest = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sent, trap = trap_weights(model, honest, x[CLIENTS * BATCH:])  # server's own rows
    total = {k: torch.zeros_like(v) for k, v in sent.items()}
    for c in range(CLIENTS):  # one local step on a batch of 32, as FedAvg's clients do
        xb, yb = x[c * BATCH:(c + 1) * BATCH], y[c * BATCH:(c + 1) * BATCH]
        local = mlp_net(784, (width, 64), 10)
        local.load_state_dict(sent)
        opt = torch.optim.SGD(local.parameters(), lr=0.05)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xb, yb),
                                             batch_size=BATCH)
        if dp_sigma is not None:
            from opacus import PrivacyEngine

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                local, opt, loader = PrivacyEngine().make_private(
                    module=local, optimizer=opt, data_loader=loader,
                    noise_multiplier=dp_sigma, max_grad_norm=1.0, poisson_sampling=False)
        for xs, ys in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(local(xs), ys).backward()
            opt.step()
        state = {k.removeprefix("_module."): v for k, v in local.state_dict().items()}
        for k in total:
            total[k] += state[k] - sent[k]
    return x[:CLIENTS * BATCH], recover({k: v / CLIENTS for k, v in total.items()}, trap)


def _recovered_share(originals: torch.Tensor, found: torch.Tensor, db: float = 30.0) -> float:
    """Share of the originals that some recovered row matches above ``db`` PSNR (pixels)."""
    if not len(found):
        return 0.0
    a = (originals.reshape(len(originals), -1) * STD + MEAN).clamp(0, 1)
    b = (found * STD + MEAN).clamp(0, 1)
    mse = ((a[:, None, :] - b[None, :, :]) ** 2).mean(-1).clamp(min=1e-10)
    return float(((-10 * torch.log10(mse)).max(1).values > db).double().mean())


def test_trap_weights_recover_most_of_a_cohorts_images_from_the_aggregate():
    originals, found = _cohort_update(1024, None)
    assert _recovered_share(originals, found) > 0.45  # 256 images through the sum of 8
    narrow_originals, narrow = _cohort_update(200, None)
    assert _recovered_share(narrow_originals, narrow) < 0.3  # 200 bins for 256 images


def test_local_dp_sgd_stops_the_trap():
    originals, found = _cohort_update(1024, 1.0)
    assert _recovered_share(originals, found) < 0.02


def test_a_model_without_a_linear_first_layer_is_refused():
    conv = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(2704, 10))
    with pytest.raises(ValueError, match="first layer is linear"):
        trap_weights(conv, conv.state_dict(), torch.zeros(4, 1, 28, 28))
