"""Images back from the exact trunk features that Robbing the Fed's trap yields for a CNN
(privacy/attacks/feature_inversion.py), on real MNIST digits and fedpriv's real CNNs."""

from __future__ import annotations

import pytest
import torch

from privacy.attacks.feature_inversion import invert_features, invertible_trunk
from tasks.datasets import load_dataset
from tasks.models import build_model

MEAN, STD, SHAPE = (0.1307,), (0.3081,), (1, 28, 28)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _digits(n: int) -> torch.Tensor:
    """``n`` clients' training digits, classes 0-9 in turn (the stored subset is sorted by
    label)."""
    data = load_dataset("mnist")
    per_class = len(data.y_train) // 10
    rows = [(k % 10) * per_class + k // 10 for k in range(n)]
    assert list(data.y_train[rows]) == [k % 10 for k in range(n)]
    return data.to_tensor(data.x_train[rows])


def _servers_own(n: int = 256) -> torch.Tensor:
    """Digits the server holds itself (test rows: none of the clients' training digits)."""
    data = load_dataset("mnist")
    return data.to_tensor(data.x_test[:n])


def _psnr(found: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each image's PSNR on pixels in [0, 1]."""
    a, b = (found * STD[0] + MEAN[0]).clamp(0, 1), (x * STD[0] + MEAN[0]).clamp(0, 1)
    return -10 * torch.log10(((a - b) ** 2).flatten(1).mean(1).clamp_min(1e-12))


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, SHAPE, 10)


def _invert(trunk: torch.nn.Module, x: torch.Tensor, **kw) -> torch.Tensor:
    with torch.no_grad():
        features = trunk(x)
    found = invert_features(trunk, features, SHAPE, mean=MEAN, std=STD, **kw)
    lo, hi = (0 - MEAN[0]) / STD[0], (1 - MEAN[0]) / STD[0]
    assert found.shape == x.shape
    assert found.min() >= lo - 1e-6 and found.max() <= hi + 1e-6  # in the pixel box
    return _psnr(found, x)


def test_the_mcmahan_cnn_trunk_gives_its_images_back_exactly():
    # 3,136 features for 784 pixels: with the honest initial weights every digit comes
    # back near-exactly (62 dB and up here).
    psnr = _invert(_model("cnn").features, _digits(8), iterations=400)
    assert psnr.min() > 35, psnr


def test_the_small_cnn_needs_the_servers_invertible_trunk():
    # 512 features for 784 pixels. On these 10 digits (one per class): the honest initial
    # weights give 22.1 dB on average (1 above 30 dB), the invertible trunk 35.5 dB (6
    # above 30 dB, 9 above 20 dB).
    x = _digits(10)
    model = _model("small-cnn")
    honest = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = _invert(model.features, x)
    sent = invertible_trunk(model, honest, probe=_servers_own())
    changed = {k for k in honest if not torch.equal(honest[k], sent[k])}
    assert changed == {"features.0.weight", "features.0.bias",
                       "features.3.weight", "features.3.bias"}  # the trunk's convs only
    model.load_state_dict(sent)
    after = _invert(model.features, x)
    assert before.mean() < 26 and (before > 30).float().mean() <= 0.3, before
    assert after.mean() > 30 and (after > 30).float().mean() >= 0.4, after
    assert (after > 20).float().mean() >= 0.7, after
    assert after.mean() > before.mean() + 8


def test_records_are_inverted_independently_of_their_batch():
    trunk = _model("small-cnn").features
    x = _digits(4)
    with torch.no_grad():
        features = trunk(x)
    kw = dict(mean=MEAN, std=STD, iterations=30)
    alone = invert_features(trunk, features[:2], SHAPE, **kw)
    batched = invert_features(trunk, features, SHAPE, **kw)
    assert torch.allclose(alone, batched[:2], atol=1e-5)
    assert all(p.requires_grad for p in trunk.parameters())  # left as it was found


def test_invertible_trunk_refuses_a_model_without_a_sequential_trunk():
    mlp = build_model("mlp", (784,), 10)
    with pytest.raises(ValueError, match="model.features"):
        invertible_trunk(mlp, mlp.state_dict())
